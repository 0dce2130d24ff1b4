"""Who may change a job: per-role keys, signed control events, and the readers' door.

Anyone who can write to the bus can write any event, so an event's ``source`` proves nothing. A
control event — one that can make the engine plan, the trainer reshape or a rank run work — is
therefore signed: HMAC-SHA256 over its canonical bytes (id, kind, schema, job, source, seq, time
and payload) with the key of the role that wrote it, carried in the envelope's ``signature`` as
``role:hex``. :data:`WRITERS` says which roles may write which kinds; everything else (telemetry,
predictions, ``control.rejected``) stays unsigned and is never trusted for control.

Keys: one 32-byte secret per role (:data:`ROLES`), from ``RESIHP_KEY_<ROLE>`` (hex) or the key file
``RESIHP_KEYS`` (default ``.resihp/keys.json``, mode 0600), which the first process that needs it
creates. HMAC keys are symmetric: a process that verifies a role's events holds that role's key, so
on one machine every process shares one key file; split the file per host for a wider boundary
(docs/security.md, "Keys").

Every reader that acts verifies (:class:`Gate`): what fails becomes a ``control.rejected`` event,
once per event id, published by the reader that refused it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from collector.codec import decode, encode
from collector.events import SIGNATURE_PATTERN, ControlRejected, Envelope, EventFactory, Payload
from collector.plan import DEVICE_LISTS
from collector.private_files import private_dir
from collector.settings import environment

log = logging.getLogger("resihp.auth")

ROLES: tuple[str, ...] = ("engine", "analytics", "console", "executor")
KEY_BYTES = 32

# kind -> the roles whose signature it must carry
WRITERS: dict[str, tuple[str, ...]] = {
    "command.reconfigure": ("engine", "executor"),  # the executor: the launcher's own on-death policy
    "plan.proposed": ("engine",), "plan.verified": ("engine",), "plan.rolled_back": ("engine",),
    "plan.withheld": ("engine",),
    "plan.decision": ("console", "engine"),  # the engine only as policy:auto, under a console's policy
    "policy.changed": ("console",),
    "incident.opened": ("analytics",), "incident.confirmed": ("analytics",), "incident.updated": ("analytics",),
    "incident.resolved": ("analytics",), "analytics.cost_model": ("analytics",), "probe.request": ("analytics",),
    "command.ack": ("executor",),
    "command.node": ("engine", "console"),  # an order for one node agent (resihp run): the engine or an operator
    "command.node_ack": ("executor",),  # the node agent's answer
    "plan.current": ("executor",),  # what runs: the engine plans on it and the fold supersedes plans by it
    "plan.capabilities": ("executor",),  # what the job can run: the engine proposes only that
    "probe.result": ("executor",),  # a rank's answer: it confirms an incident and names the slow device
    "analytics.bus_outage": ("analytics",),  # why no rank was judged dead meanwhile
}
CONSOLE_SOURCES = ("ui:", "cli:")  # a console-signed event names its person: ui:alice, cli:bob
AUTO_ACTOR = "policy:auto"
_NAMESPACE = uuid.UUID("9a4f1e0c-2b7d-4c55-8e3a-6d1f0b7c2e95")
_SIGNATURE = re.compile(SIGNATURE_PATTERN)


def needs_signature(kind: str) -> bool:
    return kind in WRITERS


def canonical_bytes(event: Envelope) -> bytes:
    """What a signature covers: the envelope's header and payload as sorted, compact JSON (the
    signature itself left out), so signer and verifier agree whatever order the wire had. A plan's
    devices are lists here whatever form the wire gives them (``DEVICE_LISTS``): signatures made
    before plans wrote them as ranges still verify."""
    body = {"id": event.id, "kind": event.kind, "schema": event.schema_version, "job": event.job,
            "source": event.source, "seq": event.seq, "time_s": event.time_s,
            "payload": event.payload.model_dump(mode="json", context={DEVICE_LISTS: True})}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class KeyFileError(RuntimeError):
    """The key file cannot be used (unreadable, malformed, or readable by others)."""


@dataclass(frozen=True)
class Keyring:
    """The role keys this process holds. ``path`` says where they came from, for error messages."""

    keys: Mapping[str, bytes]
    path: str = "<given>"

    @classmethod
    def generate(cls, path: str = "<generated>") -> Keyring:
        return cls({role: secrets.token_bytes(KEY_BYTES) for role in ROLES}, path)

    def sign(self, event: Envelope, role: str) -> Envelope:
        """``event`` with ``role``'s signature. The event is first taken through the wire format,
        so the bytes signed are the bytes every reader will rebuild after decoding."""
        wire = decode(encode(event.model_copy(update={"signature": None})))
        return wire.model_copy(update={"signature": self.sign_bytes(canonical_bytes(wire), role)})

    def sign_bytes(self, data: bytes, role: str) -> str:
        """``role``'s signature over ``data`` as ``role:hex``: the one primitive every signed channel
        (bus events, rendezvous store records) uses."""
        key = self.keys.get(role)
        if key is None:
            raise KeyFileError(f"no {role} key in {self.path}; add one (or delete the file to generate a fresh set)")
        return f"{role}:{hmac.new(key, data, hashlib.sha256).hexdigest()}"

    def verify_bytes(self, data: bytes, signature: object, allowed: tuple[str, ...], what: str) -> tuple[str, str | None]:
        """(role, None) when ``signature`` is a valid signature of ``data`` by one of ``allowed``;
        else (role or "", why not). Total: any object, any text, any bytes give a reason, never an
        exception, so no record can stop the reader that checks it. ``what`` names the record in
        the reason."""
        if not signature:
            return "", f"unsigned {what}: only {'/'.join(allowed)} may write it (signed)"
        if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
            return "", f"{what} carries a malformed signature (expected ROLE:HEX)"
        role, _, mac = signature.partition(":")
        if role not in allowed:
            return role, f"{what} signed as {role!r}, but only {'/'.join(allowed)} may write it"
        key = self.keys.get(role)
        if key is None:
            return role, f"no {role} key in {self.path} to check {what}"
        expected = hmac.new(key, data, hashlib.sha256).hexdigest().encode("ascii")
        if not hmac.compare_digest(expected, mac.encode("ascii")):
            return role, (f"{what} carries a {role} signature that does not verify with the keys in {self.path}: "
                          "altered, or signed with another key set")
        return role, None

    def verify(self, event: Envelope) -> str | None:
        """None when ``event`` may act; else why not, in one line an operator can act on. Total, as
        :meth:`verify_bytes`: an event built in-process around the wire's checks still gets a reason."""
        allowed = WRITERS.get(event.kind)
        if allowed is None:
            return None
        what = f"{event.kind} from {event.source!r}"
        try:
            data = canonical_bytes(event)
        except (TypeError, ValueError) as exc:  # a payload that cannot be serialised cannot have been signed
            return f"{what} cannot be put in canonical form ({type(exc).__name__}); refused unverified"
        role, reason = self.verify_bytes(data, event.signature, allowed, what)
        return reason if reason is not None else _authorship(event, role)


def _authorship(event: Envelope, role: str) -> str | None:
    """A verified signature proves the role; these rules tie the named person to it."""
    actor = getattr(event.payload, "actor", None)
    if role == "console":
        if not event.source.startswith(CONSOLE_SOURCES):
            return f"console-signed {event.kind} from {event.source!r}: a console source names a person (ui:NAME)"
        if actor is not None and actor != event.source:
            return f"{event.kind} names actor {actor!r} but was written by {event.source!r}"
    elif role == "engine" and actor is not None and actor != AUTO_ACTOR:
        return f"engine-signed {event.kind} names actor {actor!r}: the engine decides only as {AUTO_ACTOR}"
    return None


# ---- the key file ----------------------------------------------------------------------------------


def key_path() -> Path:
    return Path(environment().keys).expanduser()


def _from_env() -> dict[str, bytes]:
    env = environment()
    out = {}
    for role in ROLES:
        value = getattr(env, f"key_{role}")
        if value:
            try:
                out[role] = bytes.fromhex(value)
            except ValueError:
                raise KeyFileError(f"RESIHP_KEY_{role.upper()} is not hex; give {KEY_BYTES * 2} hex digits") from None
    return out


def _read(path: Path) -> dict[str, bytes]:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"key file {path} is open to other users (mode {stat.filemode(mode)}); chmod 600 {path}")
    try:
        data = json.loads(path.read_text())
        return {role: bytes.fromhex(hexkey) for role, hexkey in data["keys"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyFileError(f"key file {path} is malformed ({exc!r}); delete it to generate a fresh set "
                           "(every process of the platform must then restart)") from None


def create_key_file(path: Path) -> bool:
    """Write a fresh key set to ``path`` (0600) unless one exists; True when this call made it.
    Written aside and linked into place, so two processes starting at once agree on one set."""
    if path.exists():
        return False
    private_dir(path.parent)  # 0700 when made here: the DuckDB files beside it need a closed directory
    fresh = Keyring.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "keys": {r: k.hex() for r, k in fresh.keys.items()}}, f)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


_cache: dict[tuple, Keyring] = {}


def load_keyring(create: bool = True) -> Keyring:
    """This process's keys: ``RESIHP_KEY_<ROLE>`` where set, else the key file (made on first use
    when ``create``). Cached per file version, so a reader may call it per event."""
    path = key_path()
    env = _from_env()
    if len(env) < len(ROLES) and create:
        create_key_file(path)
    try:
        st = path.stat()
        cache_key: tuple = (str(path), (st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode), tuple(sorted(env.items())))
    except FileNotFoundError:
        cache_key = (str(path), None, None, tuple(sorted(env.items())))
    cached = _cache.get(cache_key)
    if cached is not None:
        return cached
    keys = _read(path) if cache_key[1] is not None else {}
    keys.update(env)
    ring = Keyring(keys, str(path) if len(env) < len(ROLES) else "RESIHP_KEY_*")
    _cache.clear()
    _cache[cache_key] = ring
    return ring


# ---- writers and readers ---------------------------------------------------------------------------


class Signer:
    """An :class:`EventFactory` whose control events carry ``role``'s signature (others pass as made)."""

    def __init__(self, factory: EventFactory, role: str, keyring: Keyring | None = None) -> None:
        self.factory, self.role = factory, role
        self.keyring = keyring or load_keyring()

    @property
    def source(self) -> str:
        return self.factory.source

    def make(self, payload: Payload, *, time_s: float | None = None, event_id: str | None = None) -> Envelope:
        return self.sign(self.factory.make(payload, time_s=time_s, event_id=event_id))

    def sign(self, event: Envelope) -> Envelope:
        return self.keyring.sign(event, self.role) if needs_signature(event.kind) else event


REFUSALS_KEPT = 10_000  # refused ids a reader remembers: enough to report each forgery of a burst once


class Refusals(OrderedDict[str, str]):
    """Refused event id -> why, the newest :data:`REFUSALS_KEPT` only.

    Why bounded: every forged event adds an id, and whoever can write the bus can write forgeries
    without end; a reader must not grow with them. An id that has fallen out and comes back is
    reported again under the same derived ``control.rejected`` id, which every reader that applies
    each event id once (analytics, the console) drops."""

    def remember(self, event_id: str, reason: str) -> bool:
        """Keep ``event_id``; False when it was already kept."""
        if event_id in self:
            self.move_to_end(event_id)
            return False
        self[event_id] = reason
        if len(self) > REFUSALS_KEPT:
            self.popitem(last=False)
        return True


@dataclass
class Gate:
    """A reader's door to control events: :meth:`admit` lets through what verifies, and each
    refusal becomes one ``control.rejected`` event (its id derives from the reader and the refused
    event's id, so a reader that replays its log re-derives the same one). :meth:`take` hands the
    rejections over for the reader to publish."""

    reader: str
    keyring: Keyring = field(default_factory=load_keyring)
    rejected: Refusals = field(default_factory=Refusals)  # refused event id -> why
    _pending: list[Envelope] = field(default_factory=list)
    _published: Refusals = field(default_factory=Refusals)  # ids of our rejections already on the log

    def admit(self, event: Envelope, time_s: float | None = None) -> bool:
        reason = self.keyring.verify(event)
        if reason is None:
            return True
        self.refuse(event, reason, time_s)
        return False

    def refuse(self, event: Envelope, reason: str, time_s: float | None = None) -> None:
        """Report ``event`` as refused (once per event id), for a reason the gate or its reader found."""
        if not self.rejected.remember(event.id, reason):
            return
        log.warning("%s refused %s %s from %r (job %s): %s", self.reader, event.kind, event.id, event.source,
                    event.job, reason)
        payload = ControlRejected(event_id=event.id, kind=event.kind, source=event.source, reason=reason[:2000],
                                  reader=self.reader)
        rid = uuid.uuid5(_NAMESPACE, f"{self.reader}/{event.job}/{event.id}").hex
        self._pending.append(EventFactory(event.job, self.reader).make(payload, time_s=time_s, event_id=rid))

    def note(self, event: Envelope) -> None:
        """A reader that replays its log sees its own earlier rejections: they need no second copy."""
        p = event.payload
        if isinstance(p, ControlRejected) and p.reader == self.reader:
            self._published.remember(event.id, "")

    def take(self) -> list[Envelope]:
        out = [e for e in self._pending if e.id not in self._published]
        self._pending = []
        return out
