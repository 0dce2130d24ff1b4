"""Who may look and who may decide: users with scrypt-hashed passwords in a TOML file, and sessions.

Two roles: ``viewer`` looks; ``operator`` also approves, rejects and changes policy. The users
file is the first ``Authenticator``; single sign-on can be added later as another class with the
same ``authenticate`` method (the app only ever sees a ``User``).

File format (written by ``resihp ui --add-user NAME --role operator``)::

    [users.alice]
    role = "operator"
    password = "scrypt$16384$8$1$<salt, base64>$<key, base64>"
    locked = true          # optional: the user can neither sign in nor act (live sessions included)

A session is checked against the file on every page and every action: a user removed, locked, or
given another role since signing in is signed out or acts with the new role at once, not when the
session expires (``Session.check``).

What can go wrong: a missing or malformed file (``UsersFileError`` says which and how to fix it);
a wrong password or unknown user (``AuthError``, with one message for both so a guesser learns
nothing); an expired session (``SessionExpired``); a viewer trying to decide (``NotAllowed``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypedDict, TypeGuard

from collector.private_files import write_private_file

Role = Literal["operator", "viewer"]
ROLES: tuple[Role, ...] = ("operator", "viewer")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1


def is_role(value: object) -> TypeGuard[Role]:
    """Whether ``value`` names a console role; the one check the users file and ``add_user`` share."""
    return value in ROLES


class UserEntry(TypedDict, total=False):
    """One user as the users file stores it."""

    role: Role
    password: str
    locked: bool


class AuthError(Exception):
    """Sign-in refused."""


class UsersFileError(Exception):
    """The users file is missing or malformed."""


class SessionExpired(Exception):
    """The session is older than the configured lifetime."""


class SessionRevoked(SessionExpired):
    """The session's user was removed or locked since signing in (or the users file cannot say)."""


class NotAllowed(Exception):
    """The signed-in user's role does not allow the action."""


def hash_password(password: str, *, n: int = _SCRYPT_N, r: int = _SCRYPT_R, p: int = _SCRYPT_P) -> str:
    """An scrypt hash with a fresh 16-byte salt, self-describing (its parameters travel with it)."""
    if not password:
        raise ValueError("an empty password cannot be stored; choose one")
    salt = os.urandom(16)
    key = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, dklen=32)
    return f"scrypt${n}${r}${p}${base64.b64encode(salt).decode()}${base64.b64encode(key).decode()}"


def verify_password(password: str, stored: str) -> bool:
    """Constant-time check of ``password`` against a ``hash_password`` string."""
    try:
        scheme, n, r, p, salt_b64, key_b64 = stored.split("$")
        if scheme != "scrypt":
            return False
        salt, key = base64.b64decode(salt_b64), base64.b64decode(key_b64)
        got = hashlib.scrypt(password.encode(), salt=salt, n=int(n), r=int(r), p=int(p), dklen=len(key))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, key)


@dataclass(frozen=True)
class User:
    name: str
    role: Role

    @property
    def actor(self) -> str:
        """How this user is named on every event it causes."""
        return f"ui:{self.name}"

    @property
    def can_decide(self) -> bool:
        return self.role == "operator"


class Authenticator(Protocol):
    def authenticate(self, name: str, password: str) -> User: ...

    def current(self, name: str) -> User:
        """``name`` as the users are now (its role may have changed); raises SessionRevoked when it is
        no longer a user or is locked."""
        ...

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a user (for the sign-in record only; never shown to the one signing in)."""
        ...


class UsersFile:
    """The TOML users file. Re-read on each sign-in, so added users need no restart."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, UserEntry]:
        if not self.path.exists():
            raise UsersFileError(
                f"no users file at {self.path}; create one with "
                f"`resihp ui --add-user NAME --role operator --users {self.path}`")
        try:
            data = tomllib.loads(self.path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UsersFileError(f"users file {self.path} is not valid TOML: {exc}") from None
        users = data.get("users", {})
        if not isinstance(users, dict):
            raise UsersFileError(f"users file {self.path}: [users] must be a table of users")
        entries: dict[str, UserEntry] = {}
        for name, entry in users.items():
            role = entry.get("role") if isinstance(entry, dict) else None
            password = entry.get("password") if isinstance(entry, dict) else None
            locked = entry.get("locked", False) if isinstance(entry, dict) else None
            if not is_role(role) or not isinstance(password, str) or not isinstance(locked, bool):
                raise UsersFileError(
                    f"users file {self.path}: user {name!r} needs role = one of {list(ROLES)}, a password hash and "
                    "optionally locked = true or false; rewrite it with `resihp ui --add-user`")
            entries[name] = {"role": role, "password": password, "locked": locked}
        return entries

    def knows(self, name: str) -> bool:
        try:
            return name in self.load()
        except UsersFileError:
            return False

    def authenticate(self, name: str, password: str) -> User:
        entry = self.load().get(name)
        # Hash even for an unknown user, so timing does not tell which names exist.
        stored = entry["password"] if entry else "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAA"
        if not verify_password(password, stored) or entry is None:
            raise AuthError("wrong user name or password")
        if entry.get("locked"):
            raise AuthError(f"user {name} is locked; ask whoever keeps the users file")
        return User(name, entry["role"])

    def current(self, name: str) -> User:
        try:
            entry = self.load().get(name)
        except UsersFileError as exc:  # fail closed: nothing is done on a role nobody can confirm
            raise SessionRevoked(f"cannot confirm your account ({exc}); nothing was changed") from None
        if entry is None:
            raise SessionRevoked(f"user {name} is no longer in the users file; you were signed out (nothing was changed)")
        if entry.get("locked"):
            raise SessionRevoked(f"user {name} is locked; you were signed out (nothing was changed)")
        return User(name, entry["role"])

    def set_locked(self, name: str, locked: bool) -> None:
        """Lock (or unlock) one user: a locked user cannot sign in, and a live session of theirs ends
        at its next page or action."""
        users = self.load()
        if name not in users:
            raise ValueError(f"no user {name!r} in {self.path}")
        users[name]["locked"] = locked
        self._write(users)

    def add_user(self, name: str, role: str, password: str) -> None:
        """Add or replace one user; other users are kept. Written atomically and 0600 from its first
        byte (a fresh file beside it, renamed into place): the hashes are for no one else to guess at."""
        if not _NAME.match(name):
            raise ValueError(f"user name {name!r}: use 1–64 letters, digits, '_', '.' or '-'")
        if not is_role(role):
            raise ValueError(f"role {role!r}: choose one of {list(ROLES)}")
        users = self.load() if self.path.exists() else {}
        users[name] = {"role": role, "password": hash_password(password), "locked": False}
        self._write(users)

    def _write(self, users: dict[str, UserEntry]) -> None:
        lines = ["# ResiHP console users; write with `resihp ui --add-user`. Passwords are scrypt hashes.", ""]
        for n in sorted(users):
            lines += [f"[users.{n}]", f'role = "{users[n]["role"]}"', f'password = "{users[n]["password"]}"']
            lines += ["locked = true", ""] if users[n].get("locked") else [""]
        write_private_file(self.path, "\n".join(lines).encode())


@dataclass(frozen=True)
class Session:
    """A signed-in user and when the sign-in stops being valid. With ``users`` (the console always
    gives it) every check asks the users file again, so a removed, locked or demoted user loses
    what they could do at once rather than after the session's 8 hours; without it (a session
    made in code) the role it was made with stands."""

    user: User
    signed_in_at_s: float
    expires_at_s: float
    users: Authenticator | None = field(default=None, compare=False, repr=False)

    def check(self, now_s: float) -> User:
        """The user as they are now. Raises SessionExpired, or SessionRevoked (removed, locked)."""
        if now_s >= self.expires_at_s:
            raise SessionExpired(f"your session as {self.user.name} expired; sign in again (nothing was changed)")
        return self.users.current(self.user.name) if self.users is not None else self.user

    def require_operator(self, now_s: float, action: str) -> User:
        """The user, if the session is live and the role may ``action``; otherwise raise."""
        user = self.check(now_s)
        if not user.can_decide:
            raise NotAllowed(f"{user.name} is a viewer: only operators can {action}. Nothing was changed.")
        return user
