"""A client of etcd's v3 API over its JSON gateway: what the job's store on etcd needs, and failover.

etcd (3.4 and later) serves its v3 API as JSON over plain HTTP on the client port (``POST
/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange``, ``/v3/kv/txn``, ``/v3/lease/grant``; keys
and values base64, 64-bit numbers as strings), so the standard library is enough: no gRPC stack,
no client package. torch's own etcd backends speak the v2 API through python-etcd, which needs
``--enable-v2`` (gone in etcd 3.6) and, as torch calls it, one endpoint; docs/agent.md says why
this client replaces them.

Failover: the client knows every member; a request that cannot reach one (refused, reset, timed
out) or that the cluster answers with "unavailable" (a leader election, a member cut off from the
quorum) is sent again to the next member until ``timeout_s`` has passed, then
:class:`EtcdUnavailable` names every member and its last error. Only a request that is safe to
send twice is sent twice as it is: reads, puts and deletes; a compare-and-swap fails its compare
the second time and reads back. A counter's increment is not idempotent, so each carries a
unique marker key written in the same transaction (:meth:`EtcdClient.increment`): after an
ambiguous failure the client looks for its marker before trying again, so an increment is
applied once.

Reading is total: any bytes from the network give a value, or an :class:`EtcdError` naming the
member and the problem, never another exception.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

DEFAULT_PORT = 2379
UNAVAILABLE_CODES = (4, 14)  # gRPC DeadlineExceeded, Unavailable: the request may be sent again
RETRIED_MESSAGES = ("leader changed", "no leader", "timed out", "too many requests", "not capable",
                    "lease not found")
MARKER_PREFIX = b"resihp-etcd/increments/"
MARKER_TTL_S = 600  # an increment's marker outlives any retry of it, then vanishes with its lease
MAX_RESPONSE_BYTES = 64 * 2**20


class EtcdError(RuntimeError):
    """An answer of etcd this client cannot use, or a request it refused: one line naming it."""


class EtcdUnavailable(dist.DistStoreError):
    """No member of the cluster answered within the client's timeout (a ``DistStoreError``: to the
    agent it is a store that stopped answering)."""


class _Ambiguous(Exception):
    """The request went out and no answer came back: it may or may not have been applied."""


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port,...`` (a port may be left out: 2379; ``http://`` is accepted) as
    pairs; ``ValueError`` naming the bad part."""
    endpoints = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.startswith("http://"):
            part = part[len("http://"):]
        if "://" in part or "/" in part:
            raise ValueError(f"etcd endpoint {part!r} is not host:port (this client speaks plain HTTP; "
                             "give host:port or http://host:port)")
        try:
            split = urllib.parse.urlsplit("//" + part)
            host, number = split.hostname, split.port or DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(f"etcd endpoint {part!r} is not host:port ({exc})") from None
        if not host:
            raise ValueError(f"etcd endpoint {part!r} names no host")
        endpoints.append((host, number))
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {text!r}; give host:port[,host:port...] of the cluster's members")
    return tuple(endpoints)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise EtcdError(f"etcd answered a {what} that is {type(text).__name__}, not base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise EtcdError(f"etcd answered a {what} that is not base64") from None


def _int(value: Any, what: str) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        raise EtcdError(f"etcd answered a {what} {str(value)[:40]!r} that is not a number") from None


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int


def _kvs(response: Any) -> list[KeyValue]:
    if not isinstance(response, dict):
        raise EtcdError("etcd answered a range that is not an object")
    kvs = response.get("kvs") or []
    if not isinstance(kvs, list) or not all(isinstance(kv, dict) for kv in kvs):
        raise EtcdError("etcd answered a range whose kvs are not a list of objects")
    return [KeyValue(_unb64(kv.get("key", ""), "key"), _unb64(kv.get("value", ""), "value"),
                     _int(kv.get("mod_revision"), "mod_revision")) for kv in kvs]


def range_op(key: bytes, *, prefix: bool = False, count_only: bool = False) -> dict:
    op: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        op["range_end"] = _b64(prefix_end(key))
    if count_only:
        op["count_only"] = True
    return {"request_range": op}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def delete_op(key: bytes) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


def compare(key: bytes, target: str, value: int | bytes) -> dict:
    """A txn's compare: ``target`` MOD (``value`` a mod revision; 0 = the key is absent: CREATE) or
    VALUE (``value`` bytes), for EQUAL."""
    if target == "VALUE":
        return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(bytes(value))}
    if value == 0:
        return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(value)}


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range end for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    """One process's connections to an etcd cluster: one HTTP connection per thread and member,
    every request sent to the member that last answered and, failing that, to the next.

    ``timeout_s`` bounds each call including its failovers; ``request_timeout_s`` bounds one try
    (a member that stopped answering costs that long once, then the client moves on)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout_s: float = 30.0,
                 request_timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self._preferred = random.randrange(len(self.endpoints))  # spread clients over the members
        self._local = threading.local()
        self._lease = 0
        self._lease_until = 0.0
        self._lease_lock = threading.Lock()

    @classmethod
    def from_text(cls, text: str, **kwargs: Any) -> EtcdClient:
        return cls(parse_endpoints(text), **kwargs)

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # ---- one request, with failover ---------------------------------------------------------------

    def _connection(self, index: int) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(index)
        if conn is None:
            host, port = self.endpoints[index]
            conn = conns[index] = http.client.HTTPConnection(host, port, timeout=self.request_timeout_s)
        return conn

    def _drop(self, index: int) -> None:
        conn = getattr(self._local, "conns", {}).pop(index, None)
        if conn is not None:
            conn.close()

    def _try(self, index: int, path: str, body: bytes) -> Any:
        """One request to one member: its JSON answer; ``ConnectionError`` when it was never sent,
        ``_Ambiguous`` when it went out and no usable answer came back, ``EtcdError`` for an answer
        that says the request is wrong."""
        conn = self._connection(index)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
        except OSError as exc:
            self._drop(index)
            raise ConnectionError(str(exc) or type(exc).__name__) from None
        try:
            response = conn.getresponse()
            data = response.read(MAX_RESPONSE_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            self._drop(index)
            raise _Ambiguous(str(exc) or type(exc).__name__) from None
        if len(data) > MAX_RESPONSE_BYTES:
            self._drop(index)
            raise EtcdError(f"etcd at {self._name(index)} answered {path} with over {MAX_RESPONSE_BYTES} bytes")
        try:
            answer = json.loads(data.decode("utf-8")) if data else {}
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _Ambiguous(f"HTTP {response.status} with a body that is not JSON: {data[:120]!r}") from None
        if response.status == 200 and isinstance(answer, dict) and "error" not in answer:
            return answer
        message = str(answer.get("message") or answer.get("error") or answer)[:300] if isinstance(answer, dict) \
            else str(answer)[:300]
        code = answer.get("code") if isinstance(answer, dict) else None
        if code in UNAVAILABLE_CODES or response.status >= 500 and any(m in message for m in RETRIED_MESSAGES) \
                or response.status in (502, 503, 504):
            raise _Ambiguous(f"HTTP {response.status}: {message}")
        raise EtcdError(f"etcd at {self._name(index)} refused {path}: HTTP {response.status}: {message}")

    def _name(self, index: int) -> str:
        host, port = self.endpoints[index]
        return f"{host}:{port}"

    def call(self, path: str, request: dict, *, idempotent: bool = True) -> Any:
        """``request`` to ``path`` on the first member that answers, trying each in turn until
        ``timeout_s``. A non-idempotent request that may have been applied is not sent again:
        ``_Ambiguous`` is raised for the caller to resolve."""
        body = json.dumps(request, separators=(",", ":")).encode()
        deadline = time.monotonic() + self.timeout_s
        errors: dict[str, str] = {}
        pause = 0.01
        while True:
            for attempt in range(len(self.endpoints)):
                index = (self._preferred + attempt) % len(self.endpoints)
                try:
                    answer = self._try(index, path, body)
                except ConnectionError as exc:
                    errors[self._name(index)] = f"unreachable ({exc})"
                    continue
                except _Ambiguous as exc:
                    errors[self._name(index)] = str(exc)
                    if not idempotent:
                        self._preferred = (index + 1) % len(self.endpoints)
                        raise
                    continue
                self._preferred = index
                return answer
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(f"no etcd member answered {path} within {self.timeout_s:g} s: "
                                      + "; ".join(f"{k}: {v}" for k, v in errors.items()))
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    # ---- the operations the store needs -----------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        kvs = _kvs(self.call("/v3/kv/range", {"key": _b64(key)}))
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: bytes, *, count_only: bool = False) -> tuple[list[KeyValue], int]:
        request: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if count_only:
            request["count_only"] = True
        answer = self.call("/v3/kv/range", request)
        return _kvs(answer), _int(answer.get("count"), "count")

    def put(self, key: bytes, value: bytes) -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def delete_prefix(self, prefix: bytes) -> int:
        answer = self.call("/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return _int(answer.get("deleted"), "deleted count")

    def delete(self, key: bytes) -> int:
        return _int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted"), "deleted count")

    def txn(self, compares: list[dict], success: list[dict], failure: list[dict], *,
            idempotent: bool = True) -> tuple[bool, list[dict]]:
        """One transaction: whether the compares held, and the responses of the branch that ran."""
        answer = self.call("/v3/kv/txn", {"compare": compares, "success": success, "failure": failure},
                           idempotent=idempotent)
        responses = answer.get("responses") or []
        if not isinstance(responses, list) or not all(isinstance(r, dict) for r in responses):
            raise EtcdError("etcd answered a txn whose responses are not a list of objects")
        return bool(answer.get("succeeded")), responses

    def compare_and_put(self, key: bytes, mod_revision: int, value: bytes) -> tuple[bool, KeyValue | None]:
        """Write ``value`` if ``key`` is still at ``mod_revision`` (0: absent); the key as it is
        after the transaction (ours, or what another writer put there)."""
        ok, responses = self.txn([compare(key, "MOD", mod_revision)], [put_op(key, value), range_op(key)],
                                 [range_op(key)])
        kvs = _kvs(responses[-1].get("response_range", {})) if responses else []
        return ok, kvs[0] if kvs else None

    def increment(self, key: bytes, amount: int) -> int:
        """Add ``amount`` to the decimal counter under ``key`` (absent: 0) and return the sum,
        applied exactly once: each try writes a marker holding the sum under a new key in the same
        transaction, and after an ambiguous failure the marker says whether it was applied."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            current = self.get(key)
            value = _counter(current.value, key) if current is not None else 0
            total = value + amount
            marker = MARKER_PREFIX + uuid.uuid4().hex.encode()
            try:
                ok, _ = self.txn([compare(key, "MOD", current.mod_revision if current else 0)],
                                 [put_op(key, str(total).encode()), put_op(marker, str(total).encode(), self._marker_lease())],
                                 [], idempotent=False)
            except _Ambiguous:
                ok = self._applied(marker, deadline)
            if ok:
                return total
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(f"could not add to {key!r} within {self.timeout_s:g} s (every try lost a race)")

    def _applied(self, marker: bytes, deadline: float) -> bool:
        """Whether the increment whose marker is ``marker`` was applied (a read, retried with failover)."""
        while True:
            try:
                return self.get(marker) is not None
            except EtcdUnavailable:
                if time.monotonic() >= deadline:
                    raise

    def _marker_lease(self) -> int:
        """A lease the markers are attached to, so they vanish on their own; granted again before it ends."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease == 0 or now > self._lease_until:
                answer = self.call("/v3/lease/grant", {"TTL": str(MARKER_TTL_S)})
                self._lease = _int(answer.get("ID"), "lease id")
                self._lease_until = now + MARKER_TTL_S / 2
            return self._lease


def _counter(value: bytes, key: bytes) -> int:
    try:
        return int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise EtcdError(f"the counter under {key!r} holds {value[:40]!r}, not a number") from None


def kv_of(response: dict) -> KeyValue | None:
    """The first key of a txn's range response (None when the key is absent)."""
    kvs = _kvs(response.get("response_range", {}))
    return kvs[0] if kvs else None

