"""Rate limit and lockout for console sign-in, per user name and per client address.

Why: the users file holds scrypt hashes, but nothing stopped a script from guessing passwords as fast
as scrypt allows. Each user name and each client address counts its consecutive failures; at the
threshold it is locked out for ``lockout_s``, and each further lockout of the same key doubles the
time (up to ``max_lockout_s``). While either the user name or the client is locked, sign-in is
refused without checking the password, so a lockout also stops an attacker learning a password.
Unknown user names are counted like known ones, so a lockout says nothing about which names exist.

A success clears the user name's record and the client's failure count (not its lockout history).
The client threshold is higher than the user threshold because many people may share one address
(an office NAT, a reverse proxy).

State lives in the console process, shared by every browser session of it (a restart forgets it;
the published ``ui.signin_failed`` events keep the record). It is bounded: past ``max_keys`` entries
the oldest unlocked ones are forgotten, so a flood of made-up names cannot fill memory.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from collector.events import SignInFailed


class LockedOut(Exception):
    """Sign-in refused because the user name or the client is locked out; the message says until when."""


@dataclass
class _Record:
    failures: int = 0
    lockouts: int = 0
    locked_until_s: float = 0.0


@dataclass(frozen=True)
class GuardPolicy:
    max_user_failures: int = 5
    max_client_failures: int = 20
    lockout_s: float = 60.0  # the first lockout; each next one of the same key doubles
    max_lockout_s: float = 3600.0
    max_keys: int = 10_000


class SignInGuard:
    """Counts failures per ("user", name) and ("client", address); thread-safe."""

    def __init__(self, policy: GuardPolicy = GuardPolicy()) -> None:
        self.policy = policy
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, user: str, client: str, now_s: float) -> None:
        """Raise LockedOut if the user name or the client may not try now."""
        with self._lock:
            until = max(self._get(("user", user)).locked_until_s, self._get(("client", client)).locked_until_s)
        if now_s < until:
            at = dt.datetime.fromtimestamp(until, dt.timezone.utc).strftime("%H:%M:%S UTC")
            raise LockedOut(f"too many failed sign-ins for this user name or from this address: locked until {at}. "
                            "Wait and try again, or ask an operator to check the Security page.")

    def failed(self, user: str, client: str, *, known_user: bool, now_s: float) -> SignInFailed:
        """Count one failure and return the event that records it (it names ``user`` only if known)."""
        p = self.policy
        with self._lock:
            locks: list[Literal["user", "client"]] = []
            until: float | None = None
            counts: dict[str, int] = {}
            keys: tuple[tuple[Literal["user", "client"], str, int], ...] = (
                ("user", user, p.max_user_failures), ("client", client, p.max_client_failures))
            for kind, key, limit in keys:
                rec = self._get((kind, key), create=True)
                rec.failures += 1
                counts[kind] = rec.failures
                if rec.failures >= limit:
                    rec.lockouts += 1
                    rec.failures = 0
                    rec.locked_until_s = now_s + min(p.lockout_s * 2 ** (rec.lockouts - 1), p.max_lockout_s)
                    locks.append(kind)
                    until = max(until or 0.0, rec.locked_until_s)
            self._trim(now_s)
        return SignInFailed(user=user if known_user else "", client=client,
                            reason="wrong_password" if known_user else "unknown_user",
                            user_failures=counts["user"], client_failures=counts["client"],
                            locks=locks, locked_until_s=until)

    def succeeded(self, user: str, client: str) -> None:
        with self._lock:
            self._records.pop(("user", user), None)
            rec = self._records.get(("client", client))
            if rec is not None:
                rec.failures = 0

    def _get(self, key: tuple[str, str], *, create: bool = False) -> _Record:
        rec = self._records.get(key)
        if rec is None:
            rec = _Record()
            if create:
                self._records[key] = rec
        else:
            self._records.move_to_end(key)
        return rec

    def _trim(self, now_s: float) -> None:
        excess = len(self._records) - self.policy.max_keys
        if excess <= 0:
            return
        for key in [k for k, r in self._records.items() if r.locked_until_s <= now_s][:excess]:
            del self._records[key]
