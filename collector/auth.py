"""Who may change a job: per-role keys, signed control events, and the readers' door.

Anyone who can write to the bus can write any event, so an event's ``source`` proves nothing. A
control event — one that can make the engine plan, the trainer reshape or a rank run work — is
therefore signed: an Ed25519 signature over its canonical bytes (id, kind, schema, job, source,
seq, time and payload) with the private key of whoever wrote it, carried in the envelope's
``signature`` as ``KEY_ID:hex``. :data:`WRITERS` says which roles may write which kinds; everything
else (telemetry, rank health, ``control.rejected``) stays unsigned and is never trusted for control.

Keys (collector/keys.py): one Ed25519 key pair per role (:data:`ROLES`) and one per person who
decides from the command line (``person.NAME``, signing as ``cli:NAME``). Every process reads the
public keys of all of them; it loads a private key only when it first signs with it, and a host
holds only the private keys of what its processes write (``resihp keys export``). So whoever can
verify cannot forge: a rank, which holds the ``rank`` key, can sign a probe result and nothing
else, and a person's key signs only that person's decisions. Signatures of the earlier HMAC scheme
(``role:`` and 64 hex digits) verify only against the old key file named by
``RESIHP_LEGACY_KEYS`` and are never made (docs/security.md, "Keys").

Every reader that acts verifies (:class:`Gate`): what fails becomes a ``control.rejected`` event,
once per event id, published by the reader that refused it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from collector.codec import decode, encode
from collector.events import SIGNATURE_PATTERN, ControlRejected, Envelope, EventFactory, Payload
from collector.keys import (
    PERSON, ROLES, KeyDir, KeyFileError, person_key_id, person_of, private_from_hex, read_legacy, role_of,
)
from collector.plan import DEVICE_LISTS
from collector.settings import environment

__all__ = ["AUTO_ACTOR", "CONSOLE_SOURCES", "PERSON", "ROLES", "WRITERS", "Gate", "KeyFileError", "Keyring",
           "Refusals", "Signer", "canonical_bytes", "create_keys", "key_path", "load_keyring", "needs_signature",
           "operator_key"]

log = logging.getLogger("resihp.auth")

# kind -> the roles whose signature it must carry (a person's key counts as the console's)
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
    "node.spare": ("executor",),  # a spare agent waiting for a place: the engine orders its join
    "plan.current": ("executor",),  # what runs: the engine plans on it and the fold supersedes plans by it
    "plan.capabilities": ("executor",),  # what the job can run: the engine proposes only that
    "probe.result": ("rank",),  # a rank's answer: it confirms an incident and names the slow device
    "telemetry.hang": ("executor",),  # a node agent's hang finding: it opens a fail-stop incident
    "analytics.bus_outage": ("analytics",),  # why no rank was judged dead meanwhile
    "analytics.telemetry_notice": ("analytics",),  # what the console tells operators to declare
    # the job's clock for the engine's waits, and a node agent's hang deadline: an unsigned one stamped
    # ahead would end every wait, a tiny one would call every step a hang
    "analytics.prediction": ("analytics",),
}
UI_SOURCE, CLI_SOURCE = "ui:", "cli:"
CONSOLE_SOURCES = (UI_SOURCE, CLI_SOURCE)  # a console-signed event names its person: ui:alice, cli:bob
AUTO_ACTOR = "policy:auto"
_NAMESPACE = uuid.UUID("9a4f1e0c-2b7d-4c55-8e3a-6d1f0b7c2e95")
_SIGNATURE = re.compile(SIGNATURE_PATTERN)
_HMAC_HEX = 64  # an HMAC-SHA256 signature of the earlier scheme; an Ed25519 one is 128 hex digits


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


def _stat(path: Path) -> tuple[int, ...] | None:
    """What changes when a key file is replaced or edited (None: no such file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size, st.st_mode)


@dataclass(eq=False)
class Keyring:
    """The keys this process holds: every signer's public key, and private keys for what it signs.

    ``store`` is the key directory: a private key not ``given`` is read from it the first time the
    process signs with it (so a process holds only the private keys it uses), and public.json is
    read again when it has changed and a signature names an unknown key or fails (a person added,
    a key replaced, while readers run). ``legacy`` holds old HMAC secrets, for verifying only.
    ``path`` says where the keys came from, for error messages."""

    public: dict[str, Ed25519PublicKey]
    private: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    path: str = "<given>"
    store: KeyDir | None = None
    legacy: Mapping[str, bytes] = field(default_factory=dict)
    legacy_path: str = ""
    _public_stat: tuple[int, ...] | None = None

    @classmethod
    def generate(cls, path: str = "<generated>") -> Keyring:
        """A fresh in-memory set holding every role's private key (tests, benchmarks)."""
        private = {role: Ed25519PrivateKey.generate() for role in ROLES}
        return cls({role: key.public_key() for role, key in private.items()}, private, path)

    # ---- signing -------------------------------------------------------------------------------

    def can_sign(self, key_id: str) -> bool:
        try:
            self.signing_key(key_id)
        except KeyFileError:
            return False
        return True

    def signing_key(self, key_id: str) -> Ed25519PrivateKey:
        """``key_id``'s private key, loaded on first use; raises :class:`KeyFileError` naming the fix
        when this process does not hold it or it does not match the public key readers check with."""
        key = self.private.get(key_id)
        if key is not None:
            return key
        if self.store is not None:
            key = self.store.read_private(key_id)
        if key is None:
            where = f"{self.store.private_path(key_id)} does not exist" if self.store else f"{self.path} holds no private keys"
            raise KeyFileError(
                f"this process cannot sign as {key_id}: {where}. A host holds only the private keys of what its "
                f"processes write; on the host that holds the key set run `resihp keys export --key {key_id} --out DIR` "
                "and point RESIHP_KEYS at DIR (or `resihp keys add-person NAME` for a person)")
        public = self.public.get(key_id)
        if public is None and self._refresh():
            public = self.public.get(key_id)
        if public is None:
            raise KeyFileError(f"{key_id}'s private key has no public key in {self.path}: no reader could check what it "
                               "signs; copy public.json from the host that made the key")
        if public.public_bytes_raw() != key.public_key().public_bytes_raw():
            raise KeyFileError(f"{key_id}'s private key does not match its public key in {self.path}: readers would "
                               "refuse what it signs; export both again from the same key set (`resihp keys export`)")
        self.private[key_id] = key
        return key

    def sign(self, event: Envelope, role: str) -> Envelope:
        """``event`` with ``role``'s signature (a role or ``person.NAME``). The event is first taken
        through the wire format, so the bytes signed are the bytes every reader will rebuild."""
        wire = decode(encode(event.model_copy(update={"signature": None})))
        return wire.model_copy(update={"signature": self.sign_bytes(canonical_bytes(wire), role)})

    def sign_bytes(self, data: bytes, role: str) -> str:
        """``role``'s signature over ``data`` as ``KEY_ID:hex`` (``role`` is a role or a person's key
        id): the one primitive every signed channel (bus events, rendezvous store records) uses.
        Raises :class:`KeyFileError` when this process does not hold that private key."""
        return f"{role}:{self.signing_key(role).sign(bytes(data)).hex()}"

    # ---- verifying -----------------------------------------------------------------------------

    def _refresh(self) -> bool:
        """Read public.json again if it changed since it was read; True when it did. Never raises:
        a reader that cannot read the new file keeps the keys it has."""
        if self.store is None:
            return False
        now = _stat(self.store.public_path)
        if now is None or now == self._public_stat:
            return False
        try:
            public = self.store.read_public()
        except (KeyFileError, OSError) as exc:
            log.warning("kept the public keys read before: %s", exc)
            return False
        for role, key in self.private.items():
            public.setdefault(role, key.public_key())
        self.public, self._public_stat = public, now
        return True

    def verify_bytes(self, data: bytes, signature: object, allowed: tuple[str, ...], what: str) -> tuple[str, str | None]:
        """(key id, None) when ``signature`` is a valid signature of ``data`` by one of ``allowed``
        (a role; a person's key counts as ``console``); else (key id or "", why not). Total: any
        object, any text, any bytes give a reason, never an exception, so no record can stop the
        reader that checks it. ``what`` names the record in the reason."""
        key_id, reason, _ = self._check(data, signature, allowed, what)
        return key_id, reason

    def _check(self, data: object, signature: object, allowed: tuple[str, ...], what: str) -> tuple[str, str | None, bool]:
        """:meth:`verify_bytes`, and whether the signature was of the legacy HMAC scheme."""
        if not signature:
            return "", f"unsigned {what}: only {'/'.join(allowed)} may write it (signed)", False
        if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
            return "", f"{what} carries a malformed signature (expected KEY_ID:HEX)", False
        if not isinstance(data, bytes | bytearray):
            return "", f"{what} has no bytes to check ({type(data).__name__}); refused unverified", False
        key_id, _, hexsig = signature.partition(":")
        if role_of(key_id) not in allowed:
            return key_id, f"{what} signed as {key_id!r}, but only {'/'.join(allowed)} may write it", False
        if len(hexsig) == _HMAC_HEX:
            return (key_id, *self._check_legacy(bytes(data), key_id, hexsig, what))
        public = self.public.get(key_id)
        if public is None and self._refresh():
            public = self.public.get(key_id)
        if public is None:
            return key_id, (f"no public key for {key_id} in {self.path} to check {what} (a person added since? "
                            "copy public.json from the host that holds the key set)"), False
        raw = bytes.fromhex(hexsig)
        try:
            public.verify(raw, bytes(data))
        except InvalidSignature:
            newer = self.public.get(key_id) if self._refresh() else None
            try:
                if newer is None:
                    raise InvalidSignature
                newer.verify(raw, bytes(data))
            except InvalidSignature:
                return key_id, (f"{what} carries a signature by {key_id} that does not verify with the keys in "
                                f"{self.path}: altered, or signed with another key set"), False
        return key_id, None, False

    def _check_legacy(self, data: bytes, key_id: str, hexsig: str, what: str) -> tuple[str | None, bool]:
        secret = self.legacy.get(key_id)
        if secret is None:
            return (f"{what} carries an HMAC signature ({key_id}:…), the platform's earlier key scheme; to verify a log "
                    "signed before the move to Ed25519 set RESIHP_LEGACY_KEYS to its old key file"), True
        expected = hmac.new(secret, data, hashlib.sha256).hexdigest().encode("ascii")
        if not hmac.compare_digest(expected, hexsig.encode("ascii")):
            return (f"{what} carries a {key_id} HMAC signature that does not verify with the legacy keys in "
                    f"{self.legacy_path}: altered, or signed with another key set"), True
        return None, True

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
        key_id, reason, legacy = self._check(data, event.signature, allowed, what)
        return reason if reason is not None else _authorship(event, key_id, legacy)


def _authorship(event: Envelope, key_id: str, legacy: bool = False) -> str | None:
    """A verified signature proves the key; these rules tie the named person to it. The console's
    key signs for the web console's signed-in users (ui:NAME); a person's key only as that person
    on the command line (cli:NAME). Under the legacy HMAC scheme the console's key signed both."""
    actor = getattr(event.payload, "actor", None)
    person = person_of(key_id)
    if person is not None:
        if event.source != f"{CLI_SOURCE}{person}":
            return (f"{event.kind} from {event.source!r} is signed with {key_id}'s key, which signs only as "
                    f"{CLI_SOURCE}{person}")
    elif key_id == "console":
        if not event.source.startswith(CONSOLE_SOURCES if legacy else (UI_SOURCE,)):
            why = (f"console-signed {event.kind} from {event.source!r}: a console source names a person (ui:NAME)")
            if event.source.startswith(CLI_SOURCE):
                why += "; a command-line operator signs with their own key (resihp keys add-person NAME)"
            return why
    elif key_id == "engine" and actor is not None and actor != AUTO_ACTOR:
        return f"engine-signed {event.kind} names actor {actor!r}: the engine decides only as {AUTO_ACTOR}"
    if role_of(key_id) == "console" and actor is not None and actor != event.source:
        return f"{event.kind} names actor {actor!r} but was written by {event.source!r}"
    return None


def operator_key(actor: str, *, create: bool = False) -> str:
    """The key that signs an operator's event: the console's for ``ui:NAME`` (the web console signs
    for the users it signed in), ``person.NAME`` for ``cli:NAME``. ``create`` makes that person's key
    in this process's key directory (and the directory, on first use) when it is missing: for the
    platform's own automation on a local key set (the demo, the closed loop) and for the login user
    of a host whose key directory they can write anyway; never for another person, whose key an
    administrator makes (``resihp keys add-person``)."""
    if actor.startswith(UI_SOURCE):
        return "console"
    if not actor.startswith(CLI_SOURCE):
        raise KeyFileError(f"{actor!r} names no operator: use cli:NAME (your own key) or ui:NAME (the web console)")
    key_id = person_key_id(actor[len(CLI_SOURCE):])
    if create:
        store = KeyDir(key_path())
        store.create()
        if store.read_private(key_id) is None:
            try:
                store.add_person(actor[len(CLI_SOURCE):])
            except KeyFileError:
                if store.read_private(key_id) is None:  # not a race with another process making it: a real refusal
                    raise
    return key_id


# ---- the key directory -----------------------------------------------------------------------------


def key_path() -> Path:
    return Path(environment().keys).expanduser()


def create_keys(path: Path) -> bool:
    """Make a fresh key set in directory ``path`` unless it has one; True when this call made it."""
    return KeyDir(path).create()


_cache: dict[tuple, Keyring] = {}


def load_keyring(create: bool = True) -> Keyring:
    """This process's keys: the public keys of the key directory ``RESIHP_KEYS`` (made on first use
    when ``create``), private keys from ``RESIHP_KEY_<ROLE>`` where set and otherwise read from the
    directory when first used, and the legacy HMAC secrets of ``RESIHP_LEGACY_KEYS``. Cached per file
    version, so a reader may call it per event."""
    env = environment()
    path = Path(env.keys).expanduser()
    store = KeyDir(path)
    if path.is_file():
        raise KeyFileError(store._not_a_directory())
    given = tuple((role, value) for role in ROLES if (value := getattr(env, f"key_{role}")))
    if len(given) < len(ROLES) and create:
        store.create()
    legacy_path = Path(env.legacy_keys).expanduser() if env.legacy_keys else None
    public_stat = _stat(store.public_path)
    cache_key = (str(path), public_stat, given, str(legacy_path), legacy_path and _stat(legacy_path))
    cached = _cache.get(cache_key)
    if cached is not None:
        return cached
    public = store.read_public() if public_stat is not None else {}
    private = {role: private_from_hex(value, f"RESIHP_KEY_{role.upper()}") for role, value in given}
    for role, key in private.items():
        known = public.setdefault(role, key.public_key())
        if known.public_bytes_raw() != key.public_key().public_bytes_raw():
            raise KeyFileError(f"RESIHP_KEY_{role.upper()} is not the private half of the {role} key in "
                               f"{store.public_path} (an HMAC key of an earlier version, or another key set's); "
                               "unset it, or give the key of this set (`resihp keys export`)")
    ring = Keyring(public, private, str(path) if public_stat is not None else "RESIHP_KEY_*",
                   store if public_stat is not None else None,
                   read_legacy(legacy_path) if legacy_path else {}, str(legacy_path or ""), public_stat)
    _cache.clear()
    _cache[cache_key] = ring
    return ring


# ---- writers and readers ---------------------------------------------------------------------------


class Signer:
    """An :class:`EventFactory` whose control events carry ``role``'s signature (others pass as made).

    ``role`` is a role or a person's key id. The private key is loaded here, so a process that does
    not hold it learns at start (:class:`KeyFileError`), not at its first control event."""

    def __init__(self, factory: EventFactory, role: str, keyring: Keyring | None = None) -> None:
        self.factory, self.role = factory, role
        self.keyring = keyring or load_keyring()
        self.keyring.signing_key(role)

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
