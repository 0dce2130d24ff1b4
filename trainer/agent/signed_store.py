"""Signed records in a rendezvous store: how the launcher, the agents and the ranks tell each other
what to do, so that a stranger who reaches the store cannot.

A torch TCPStore has no authentication: whoever reaches its port reads, writes and deletes every
key. On a multi-node job the store listens on the network (``--rdzv-bind``), so a record in it —
a plan post, a lost-rank mark, an agent's registration, a vacancy, a rank's request to rejoin — is
only as trustworthy as its signature. Every such record is written as

    {"body": BODY, "signature": "ROLE:HEX"}

where the signature (collector/auth.py's ``Keyring.sign_bytes``) covers the canonical bytes of
``{"format", "key", "scope", "body"}``: the key the record was written under and the **scope**, the
run it belongs to (the launcher's run id; for an agent's stores the rendezvous id, or the
rendezvous round's prefix, which holds the id and the round). A record copied under another key,
or replayed from another run or round, does not verify.

Reading is total: any bytes under any key give the body or a :class:`RecordRefused` naming the key
and the reason, never another exception. :meth:`SignedStore.read` treats a refused record as absent,
logs it and reports it once (``control.rejected`` where the reader has a bus), so a forged record
neither steers nor stops the loop that polls it.

Who may write what: the launcher and the node agents sign as ``executor`` (posts, probes, aborts,
lost marks, registrations, flight records, vacancies); ranks sign what ranks write (arrivals,
outcomes, progress, joins, requests to rejoin, the grown world's members) as ``rank`` where they
hold that key, else as ``executor``; a reader accepts each key from those roles only.

Counters (``store.add``) cannot carry a signature. None decides anything on its own here: each is a
wake-up or a hint, and what a reader then does comes from signed records (each use says how).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from collector.auth import Keyring, Refusals, load_keyring
from collector.events import ControlRejected

log = logging.getLogger("resihp.store")

AGENT_WRITERS: tuple[str, ...] = ("executor",)  # the launcher's and the agents' records: posts, marks, places
RANK_WRITERS: tuple[str, ...] = ("executor", "rank")  # what ranks write: arrivals, outcomes, joins, admissions
SIGNING_ROLE = "executor"  # what the launcher and the node agents sign as
FORMAT = "resihp.store/1"
MAX_RECORD_BYTES = 16 * 2**20  # a 100k-device plan is under 1 MB
REJECTED_KIND = "store.record"
_NAMESPACE = uuid.UUID("5d0c7a52-7e0b-4f1e-9a57-3c2b1f9e6a41")

T = TypeVar("T")


def rank_role(keyring: Keyring) -> str:
    """What a rank signs its records as: ``rank`` where this process holds that key, else the
    executor's key its launcher gave it."""
    return "rank" if keyring.can_sign("rank") else SIGNING_ROLE


class RecordRefused(ValueError):
    """A store record that is not a valid signed record of this key and scope: never acted on."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"store record {key!r} refused: {reason}")
        self.key, self.reason = key, reason


def signed_bytes(key: str, scope: str, body: Any) -> bytes:
    """What the signature covers: the record's key, its scope and its body, as canonical JSON."""
    return json.dumps({"format": FORMAT, "key": key, "scope": scope, "body": body}, sort_keys=True,
                      separators=(",", ":")).encode()


def encode_record(keyring: Keyring, key: str, scope: str, body: Any, role: str = SIGNING_ROLE) -> bytes:
    """The bytes to store under ``key``: ``body`` (JSON-able) with ``role``'s signature."""
    signature = keyring.sign_bytes(signed_bytes(key, scope, body), role)
    return json.dumps({"body": body, "signature": signature}, separators=(",", ":")).encode()  # ASCII


def decode_record(keyring: Keyring, key: str, scope: str, raw: object,
                  allowed: tuple[str, ...] = AGENT_WRITERS) -> Any:
    """The body of a record read from ``key``; :class:`RecordRefused` for anything else (total:
    no other exception, whatever ``raw`` holds)."""
    if not isinstance(raw, (bytes, bytearray)):
        raise RecordRefused(key, f"the store returned {type(raw).__name__}, not bytes")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordRefused(key, f"{len(raw)} bytes, over the {MAX_RECORD_BYTES}-byte bound of a store record")
    try:
        outer = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordRefused(key, f"not a signed record (not UTF-8 JSON: {str(exc)[:200]}); only the job's "
                                 "launcher, agents and ranks write here, signed with the job's keys") from None
    if not isinstance(outer, dict) or set(outer) != {"body", "signature"}:
        raise RecordRefused(key, "not a signed record (expected exactly the fields body and signature); only the "
                                 "job's launcher, agents and ranks write here, signed with the job's keys")
    try:
        data = signed_bytes(key, scope, outer["body"])
    except (ValueError, TypeError, RecursionError) as exc:
        raise RecordRefused(key, f"its body cannot be signed ({str(exc)[:200]})") from None
    _, reason = keyring.verify_bytes(data, outer["signature"], allowed, f"store record {key!r} of {scope!r}")
    if reason is not None:
        raise RecordRefused(key, reason)
    return outer["body"]


class SignedStore:
    """One store's signed records for one scope, as one process writes and reads them.

    ``reader`` names this process in its refusals (``agent-HOST-PID``, ``rank-3``, ``trainer``);
    ``report`` gets one ``control.rejected`` payload per refused record (the same bytes under the
    same key are reported once), e.g. a telemetry publisher's ``publish``; without it refusals
    are only logged."""

    def __init__(self, store: dist.Store, scope: str, *, reader: str, keyring: Keyring | None = None,
                 report: Callable[[ControlRejected], None] | None = None, role: str = SIGNING_ROLE) -> None:
        self.store, self.scope, self.reader = store, scope, reader
        self.keyring = keyring or load_keyring()
        self.report, self.role = report, role
        self.refused: Refusals = Refusals()  # bounded: forgeries cost a stranger nothing

    def with_store(self, store: dist.Store, scope: str | None = None) -> SignedStore:
        """The same signer and reporter on another store (a ``PrefixStore`` of this one, say)."""
        other = SignedStore(store, self.scope if scope is None else scope, reader=self.reader, keyring=self.keyring,
                            report=self.report, role=self.role)
        other.refused = self.refused
        return other

    def encode(self, key: str, body: Any) -> bytes:
        return encode_record(self.keyring, key, self.scope, body, self.role)

    def set(self, key: str, body: Any) -> None:
        """Write ``body`` under ``key``, signed."""
        self.store.set(key, self.encode(key, body).decode())  # ASCII JSON

    def has(self, key: str) -> bool:
        """Whether something is stored under ``key`` (signed or not: :meth:`read` says which)."""
        return self.store.check([key])

    def decode(self, key: str, raw: object, parse: Callable[[Any], T] | None = None,
               allowed: tuple[str, ...] = AGENT_WRITERS) -> T:
        """``raw`` (read from ``key``) verified as written by one of ``allowed`` and parsed;
        :class:`RecordRefused` (reported) if not."""
        try:
            body = decode_record(self.keyring, key, self.scope, raw, allowed)
            return parse(body) if parse is not None else body
        except RecordRefused as exc:
            self.refuse(key, raw, exc.reason)
            raise
        except Exception as exc:  # noqa: BLE001 - a signed body of the wrong shape is refused, never raised
            reason = f"signed, but not what this key holds ({type(exc).__name__}: {str(exc)[:300]})"
            self.refuse(key, raw, reason)
            raise RecordRefused(key, reason) from None

    def get(self, key: str, parse: Callable[[Any], T] | None = None, allowed: tuple[str, ...] = AGENT_WRITERS) -> T:
        """The record under ``key``, waiting for it as ``store.get`` does; :class:`RecordRefused`
        (reported) when it is not a valid signed record."""
        return self.decode(key, self.store.get(key), parse, allowed)

    def read(self, key: str, parse: Callable[[Any], T] | None = None,
             allowed: tuple[str, ...] = AGENT_WRITERS) -> T | None:
        """The record under ``key``, or None when there is none or it is refused (reported)."""
        if not self.store.check([key]):
            return None
        try:
            return self.decode(key, self.store.get(key), parse, allowed)
        except RecordRefused:
            return None

    def read_many(self, keys: Sequence[str], parse: Callable[[Any], T] | None = None,
                  allowed: tuple[str, ...] = AGENT_WRITERS) -> list[T | None]:
        """:meth:`read` of several keys (None for each missing or refused); one round trip when
        all are there."""
        if not self.store.check(list(keys)):
            return [self.read(key, parse, allowed) for key in keys]
        out: list[T | None] = []
        for key, raw in zip(keys, self.store.multi_get(list(keys))):
            try:
                out.append(self.decode(key, raw, parse, allowed))
            except RecordRefused:
                out.append(None)
        return out

    def valid(self, key: str, allowed: tuple[str, ...] = AGENT_WRITERS) -> bool:
        """Whether a valid signed record by one of ``allowed`` is stored under ``key``."""
        return self.read(key, allowed=allowed) is not None

    def refuse(self, key: str, raw: object, reason: str) -> None:
        """Log and report a refused record, once per (key, bytes)."""
        digest = hashlib.sha256(raw if isinstance(raw, (bytes, bytearray)) else repr(raw).encode()).hexdigest()
        rid = uuid.uuid5(_NAMESPACE, f"{self.reader}/{self.scope}/{key}/{digest}").hex
        if not self.refused.remember(rid, reason):
            return
        log.warning("%s refused store record %r of %r: %s", self.reader, key, self.scope, reason)
        if self.report is None:
            return
        try:
            self.report(ControlRejected(event_id=rid, kind=REJECTED_KIND, source=f"store:{key}"[:200],
                                        reason=f"store record {key!r}: {reason}"[:2000], reader=self.reader))
        except Exception as exc:  # noqa: BLE001 - the log line above still says it
            log.warning("%s cannot report the refused store record %r: %s", self.reader, key, exc)
