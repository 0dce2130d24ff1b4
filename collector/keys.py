"""The platform's signing keys on disk: one Ed25519 key pair per role and one per person.

Why asymmetric: a reader needs only public keys to check a control event, so whoever can verify
can no longer forge. Each process holds the public keys of every signer and the private keys of
only what it writes itself (collector/auth.py loads a private key the first time the process signs
with it).

A key directory (``RESIHP_KEYS``, default ``.resihp/keys``; mode 0700, owned by whoever runs the
platform) holds::

    public.json         {"version": 2, "algorithm": "ed25519", "keys": {KEY_ID: public key, hex}}
                        every process reads it; writable by its owner only, since a key added here
                        is trusted to sign
    KEY_ID.key          KEY_ID's private key (PKCS#8 PEM, mode 0600); a host gets only the ones
                        its processes sign with (``resihp keys export``)

Key ids are the roles (:data:`ROLES`) and ``person.NAME`` for a person who decides from the command
line (``cli:NAME``). A person's key signs only that person's events; the web console signs for its
signed-in users (``ui:NAME``) with the ``console`` key.

:class:`KeyDir` makes a directory (atomically, so processes that start together agree on one set),
adds a person, exports what one host needs and reads both halves, refusing files others can write
or read. Old HMAC key files (``{"version": 1, "keys": {role: hex}}``) are read by
:func:`read_legacy` for verification only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from collector.private_files import private_dir, write_new_file

ROLES: tuple[str, ...] = ("engine", "analytics", "console", "executor", "rank")
PERSON = "person."  # a person's key id: person.alice signs cli:alice's decisions
PUBLIC_FILE = "public.json"
PUBLIC_VERSION = 2
LEGACY_VERSION = 1  # HMAC-SHA256 secrets, one per role: verified when asked, never used to sign
# A key id is the part of a signature before ':' (collector/events.py SIGNATURE_PATTERN: 64 characters).
KEY_ID = re.compile(r"[a-z][a-z0-9_.@+-]{0,63}")
PERSON_NAME = re.compile(r"[a-z0-9][a-z0-9_.@+-]{0,56}")


class KeyFileError(RuntimeError):
    """A key cannot be used: missing, unreadable, malformed, or open to other users."""


def person_key_id(name: str) -> str:
    """The key id of person ``name`` (``alice`` -> ``person.alice``); refuses a name a key id cannot hold."""
    if not PERSON_NAME.fullmatch(name):
        raise KeyFileError(f"person name {name!r} cannot name a key: use lower-case letters, digits and _.@+- "
                           "(at most 57 characters, starting with a letter or digit)")
    return PERSON + name


def person_of(key_id: str) -> str | None:
    """The person a key id names (``person.alice`` -> ``alice``), or None for a role's key."""
    return key_id[len(PERSON):] if key_id.startswith(PERSON) else None


def role_of(key_id: str) -> str:
    """The role a key id signs under: a person's key writes what the console writes."""
    return "console" if key_id.startswith(PERSON) else key_id


def public_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes_raw().hex()


def fingerprint(key: Ed25519PublicKey) -> str:
    """A short name for a public key, to compare two hosts' files by eye."""
    import hashlib

    return hashlib.sha256(key.public_bytes_raw()).hexdigest()[:16]


def private_from_hex(value: str, what: str) -> Ed25519PrivateKey:
    """A private key from 64 hex digits (its raw 32 bytes), as ``RESIHP_KEY_<ROLE>`` carries it."""
    try:
        raw = bytes.fromhex(value)
        if len(raw) != 32:
            raise ValueError(f"{len(raw)} bytes")
        return Ed25519PrivateKey.from_private_bytes(raw)
    except ValueError:
        raise KeyFileError(f"{what} is not an Ed25519 private key; give its 32 bytes as 64 hex digits "
                           "(or leave it unset and use the key directory's KEY_ID.key)") from None


def _open_to_others(mode: int, bits: int) -> bool:
    return bool(mode & bits)


def _pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _public_json(keys: dict[str, Ed25519PublicKey]) -> bytes:
    body = {"version": PUBLIC_VERSION, "algorithm": "ed25519", "keys": {k: public_hex(v) for k, v in sorted(keys.items())}}
    return (json.dumps(body, indent=1) + "\n").encode()


@dataclass(frozen=True)
class KeyDir:
    """One key directory: ``public.json`` and the private keys it holds (see the module's docstring)."""

    path: Path

    @property
    def public_path(self) -> Path:
        return self.path / PUBLIC_FILE

    def private_path(self, key_id: str) -> Path:
        if not KEY_ID.fullmatch(key_id):
            raise KeyFileError(f"{key_id!r} is not a key id (a role, or person.NAME)")
        return self.path / f"{key_id}.key"

    def exists(self) -> bool:
        return self.public_path.exists()

    # ---- reading -------------------------------------------------------------------------------

    def check_directory(self) -> None:
        """Refuse a directory others can write: whoever can replace public.json can add a signer."""
        try:
            mode = self.path.stat().st_mode
        except FileNotFoundError:
            raise KeyFileError(f"no key directory {self.path}; make one with `resihp keys create` "
                               "(or copy one made by `resihp keys export`)") from None
        if not stat.S_ISDIR(mode):
            raise KeyFileError(self._not_a_directory())
        if _open_to_others(mode, stat.S_IWGRP | stat.S_IWOTH):
            raise KeyFileError(f"key directory {self.path} is writable by other users (mode {stat.filemode(mode)}); "
                               f"chmod 700 {self.path}")

    def _not_a_directory(self) -> str:
        return (f"RESIHP_KEYS={self.path} is a file, not a key directory: an HMAC key file of an earlier version "
                "of the platform? Point RESIHP_KEYS at a directory (made on first use) and RESIHP_LEGACY_KEYS at "
                "that file to keep verifying the logs it signed (docs/security.md, \"Keys\")")

    def read_public(self) -> dict[str, Ed25519PublicKey]:
        """Every signer's public key. Raises :class:`KeyFileError` naming the fix."""
        self.check_directory()
        path = self.public_path
        mode = path.stat().st_mode
        if _open_to_others(mode, stat.S_IWGRP | stat.S_IWOTH):
            raise KeyFileError(f"public key file {path} is writable by other users (mode {stat.filemode(mode)}): "
                               f"anyone could add a signer; chmod 644 {path}")
        try:
            data = json.loads(path.read_text())
            if data.get("version") != PUBLIC_VERSION or data.get("algorithm") != "ed25519":
                raise ValueError(f"version {data.get('version')!r}, algorithm {data.get('algorithm')!r}")
            keys = {}
            for key_id, value in data["keys"].items():
                if not KEY_ID.fullmatch(key_id):
                    raise ValueError(f"key id {key_id!r}")
                keys[key_id] = Ed25519PublicKey.from_public_bytes(bytes.fromhex(value))
            return keys
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyFileError(f"public key file {path} is malformed ({exc}); copy it again from the host that "
                               "made the key set (`resihp keys export`)") from None

    def read_private(self, key_id: str) -> Ed25519PrivateKey | None:
        """``key_id``'s private key, or None when this directory does not hold it."""
        path = self.private_path(key_id)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return None
        if _open_to_others(mode, stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"private key {path} is open to other users (mode {stat.filemode(mode)}); chmod 600 {path}")
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"private key {path} is not a PEM private key ({exc}); export it again "
                               "(`resihp keys export`)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"private key {path} is a {type(key).__name__}, not Ed25519; export it again")
        return key

    def private_ids(self) -> list[str]:
        """The key ids whose private keys this directory holds."""
        return sorted(p.name[:-4] for p in self.path.glob("*.key") if KEY_ID.fullmatch(p.name[:-4]))

    # ---- writing -------------------------------------------------------------------------------

    def create(self) -> bool:
        """Make a fresh set, one key pair per role, unless the directory has one; True when this
        call made it. Written in a private directory beside it and renamed into place, so two
        processes starting at once agree on one set."""
        if self.exists():
            return False
        if self.path.exists() and not self.path.is_dir():
            raise KeyFileError(self._not_a_directory())
        if self.path.is_dir() and any(self.path.iterdir()):
            raise KeyFileError(f"key directory {self.path} has files but no {PUBLIC_FILE}; copy public.json into "
                               "it, or empty it to make a fresh set")
        private_dir(self.path.parent)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.mkdir(mode=0o700)
        try:
            os.chmod(tmp, 0o700)
            pairs = {role: Ed25519PrivateKey.generate() for role in ROLES}
            for role, key in pairs.items():
                write_new_file(tmp / f"{role}.key", _pem(key), 0o600)
            write_new_file(tmp / PUBLIC_FILE, _public_json({r: k.public_key() for r, k in pairs.items()}), 0o644)
            try:
                os.rename(tmp, self.path)  # onto nothing, or an empty directory: atomic
            except OSError:
                if self.exists():
                    return False  # another process made it first: use theirs
                raise
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer of public.json at a time (two people added at once both stay)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _replace_public(self, keys: dict[str, Ed25519PublicKey]) -> None:
        tmp = self.path / f".{PUBLIC_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        write_new_file(tmp, _public_json(keys), 0o644)
        os.replace(tmp, self.public_path)

    def add_person(self, name: str, out: Path | None = None, *, replace: bool = False) -> Path:
        """A key pair for person ``name``: the public half into public.json, the private half
        into ``out`` (a directory: the person's own, made 0700 with a copy of public.json) or this
        directory. Returns the private key's path. Refuses a person who has a key unless ``replace``
        (the old key then stops verifying)."""
        key_id = person_key_id(name)
        with self._locked():
            keys = self.read_public()
            if key_id in keys and not replace:
                raise KeyFileError(f"{key_id} has a key already ({fingerprint(keys[key_id])}); pass --replace to "
                                   "give them a new one (events signed with the old one then stop verifying)")
            key = Ed25519PrivateKey.generate()
            keys[key_id] = key.public_key()
            target = KeyDir(out) if out is not None else self
            if out is not None:
                private_dir(target.path)
                os.chmod(target.path, 0o700)
            path = target.private_path(key_id)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            write_new_file(tmp, _pem(key), 0o600)
            os.replace(tmp, path)
            self._replace_public(keys)
        if out is not None:
            target.copy_public_from(self)
        return path

    def copy_public_from(self, source: KeyDir) -> None:
        data = source.public_path.read_bytes()
        tmp = self.path / f".{PUBLIC_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        write_new_file(tmp, data, 0o644)
        os.replace(tmp, self.public_path)

    def export(self, key_ids: Iterable[str], out: Path) -> list[Path]:
        """What one host needs into directory ``out`` (0700): public.json and the private keys of
        ``key_ids`` only. Returns the files written."""
        public = self.read_public()
        wanted = list(dict.fromkeys(key_ids))
        missing = [k for k in wanted if self.read_private(k) is None]
        if missing:
            raise KeyFileError(f"{self.path} holds no private key for {', '.join(missing)} (it has: "
                               f"{', '.join(self.private_ids()) or 'none'}); export from where it was made")
        unknown = [k for k in wanted if k not in public]
        if unknown:
            raise KeyFileError(f"{', '.join(unknown)} is not in {self.public_path}")
        target = KeyDir(out)
        private_dir(out)
        os.chmod(out, 0o700)
        target.copy_public_from(self)
        written = [target.public_path]
        for key_id in wanted:
            dest = target.private_path(key_id)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}")
            write_new_file(tmp, self.private_path(key_id).read_bytes(), 0o600)
            os.replace(tmp, dest)
            written.append(dest)
        return written


def read_legacy(path: Path) -> dict[str, bytes]:
    """The HMAC secrets of an old key file, to verify what it signed. Refused when others can read it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(f"RESIHP_LEGACY_KEYS names {path}, which does not exist; unset it or point it at the "
                           "old key file") from None
    if _open_to_others(mode, stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"legacy key file {path} is open to other users (mode {stat.filemode(mode)}); chmod 600 {path}")
    try:
        data = json.loads(path.read_text())
        if data.get("version") != LEGACY_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {LEGACY_VERSION}")
        return {role: bytes.fromhex(value) for role, value in data["keys"].items() if role in ROLES}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyFileError(f"legacy key file {path} is not an HMAC key file ({exc}); point RESIHP_LEGACY_KEYS "
                           "at the keys.json the old logs were signed with") from None
