"""The job's store on etcd: the rendezvous of a multi-node job, and every record of the agents
and ranks, on a cluster that outlives any node.

Under ``resihp run --rdzv-backend etcd --rdzv-endpoint HOST:PORT,HOST:PORT,...`` nothing of the
job lives in an agent: torch's dynamic rendezvous keeps its state in etcd
(:class:`EtcdRendezvousBackend`), the rendezvous rounds' stores (registrations, flight records,
torch's exit barrier) and the job's own records (vacancies) are :class:`EtcdStore` prefixes of
one key space, and so is the store the ranks meet in (lost marks, joins, the shrinking world's
gloo rendezvous; :func:`ranks_store_address`), which under the c10d rendezvous lives in node 0's
agent. Any node's agent, node 0's included, can then die and the job go on; any etcd member can,
as long as a majority answers.

The layout, under ``/resihp/rdzv/<run id>/``:

    state                   torch's rendezvous state (pickled by torch; signed here)
    store/<key>             the job store: torch's round prefixes ``torch.rendezvous.<id>.<round>/…``,
                            vacancies (trainer/agent/vacancy.py)
    ranks/<round prefix>/   the ranks' store of one round (trainer/agent/shrink.py)

Trust: etcd's own authentication (TLS client certificates, users and roles) decides who reaches
the keys; beyond that, what changes the job is signed as on the c10d store
(trainer/agent/signed_store.py). The rendezvous state, which torch unpickles, is signed too:
a state nobody of the job wrote is refused with :class:`RendezvousStateError` naming the key,
never unpickled. Counters are wake-ups only, as on every store.

What can fail: no member answers within the timeout (``EtcdUnavailable``, a ``DistStoreError``:
the agent ends with one line naming the members and their errors); a key waited for does not
appear in time (``DistStoreError``, as a TCPStore's wait).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler

from collector.auth import Keyring, load_keyring
from trainer.agent.etcd_client import (EtcdClient, EtcdError, EtcdUnavailable, compare, kv_of, parse_endpoints,
                                       put_op, range_op)
from trainer.agent.signed_store import RecordRefused, decode_record, encode_record

SCHEME = "etcd://"
ROOT = "/resihp/rdzv/{run_id}/"
STATE_KEY = "state"
POLL_S = (0.002, 0.05)  # a wait polls from the first bound, backing off to the second


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d store (what torch's rendezvous, gloo and our signed records use) over a key prefix
    in etcd: ``set``/``get``/``add``/``compare_set``/``check``/``wait``/``delete_key``/
    ``num_keys``/``multi_get``/``multi_set``, with a TCPStore's meaning.

    ``get`` and ``wait`` block until the keys exist or the timeout passes (polling: etcd's watch
    streams need a connection per wait, and waits here are short). ``add(key, 0)`` only reads the
    counter (the ranks poll a counter this way while they wait in a collective): an absent
    counter reads 0 and stays absent."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client, self.prefix, self.wait_timeout = client, prefix, timeout

    def _key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def set(self, key: str, value: str | bytes) -> None:
        self.client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self.client.get(self._key(key))
        if kv is None:  # deleted between the wait and the read
            return self.get(key)
        return kv.value

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            kv = self.client.get(self._key(key))
            if kv is None:
                return 0
            try:
                return int(kv.value.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                raise EtcdError(f"the counter {key!r} holds {kv.value[:40]!r}, not a number") from None
        return self.client.increment(self._key(key), amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``desired`` if ``key`` held ``expected`` (or was absent and ``expected`` is empty); the
        value after the call, as TCPStore's ``compare_set``."""
        full, want, new = self._key(key), _bytes(expected), _bytes(desired)
        condition = compare(full, "MOD", 0) if not want else compare(full, "VALUE", want)
        _, responses = self.client.txn([condition], [put_op(full, new), range_op(full)], [range_op(full)])
        kv = kv_of(responses[-1]) if responses else None
        return kv.value if kv is not None else want

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._counts(keys))

    def _counts(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        _, responses = self.client.txn([], [range_op(self._key(k), count_only=True) for k in keys], [])
        counts = []
        for r in responses:
            rng = r.get("response_range")
            counts.append(int(rng.get("count", 0) or 0) if isinstance(rng, dict) else 0)
        return counts

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        bound = (timeout or self.wait_timeout).total_seconds()
        deadline = time.monotonic() + bound
        pause = POLL_S[0]
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {bound:g} s for keys {list(keys)[:8]} under "
                                          f"{self.prefix!r} in etcd ({self.client.describe()})")
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        return self.client.get_prefix(self.prefix.encode(), count_only=True)[1]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(keys)
        _, responses = self.client.txn([], [range_op(self._key(k)) for k in keys], [])
        values = [kv_of(r) for r in responses]
        if len(values) != len(keys) or any(v is None for v in values):  # one was deleted meanwhile
            return [self.get(k) for k in keys]
        return [v.value for v in values if v is not None]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.client.txn([], [put_op(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)], [])

    def has_extended_api(self) -> bool:
        return True  # multi_get, multi_set: one round trip through a PrefixStore too

    # The names the C++ side calls through the pybind trampoline (a PrefixStore over this store).
    getNumKeys = num_keys
    deleteKey = delete_key
    compareSet = compare_set

    def delete_prefix(self) -> None:
        """Remove every key of this store (the job's keys, when the job has ended)."""
        self.client.delete_prefix(self.prefix.encode())


class EtcdRendezvousBackend(RendezvousBackend):
    """torch's dynamic rendezvous state in one etcd key, written by compare-and-swap on its
    modification revision (the token), and signed: torch unpickles the state, so a state the job's
    agents did not write is refused (``RendezvousStateError``) before torch sees it."""

    def __init__(self, client: EtcdClient, run_id: str, keyring: Keyring | None = None) -> None:
        self.client, self.run_id = client, run_id
        self.key = (ROOT.format(run_id=run_id) + STATE_KEY).encode()
        self.keyring = keyring or load_keyring()

    @property
    def name(self) -> str:
        return "etcd"

    def _seal(self, state: bytes) -> bytes:
        return encode_record(self.keyring, STATE_KEY, self.run_id, base64.b64encode(state).decode())

    def _unseal(self, raw: bytes) -> bytes:
        try:
            body = decode_record(self.keyring, STATE_KEY, self.run_id, raw)
            if not isinstance(body, str):
                raise RecordRefused(STATE_KEY, "its body is not base64 text")
            return base64.b64decode(body, validate=True)
        except (RecordRefused, ValueError) as exc:
            raise RendezvousStateError(f"the rendezvous state of job {self.run_id!r} in etcd "
                                       f"({self.key.decode()}) is refused: {exc}; only the job's agents write it, "
                                       "signed with the executor key: check who else writes to this etcd") from None

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self.client.get(self.key)
        except (EtcdUnavailable, EtcdError) as exc:
            raise RendezvousConnectionError(f"etcd: {exc}") from None
        return None if kv is None else (self._unseal(kv.value), kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        revision = token if type(token) is int and token > 0 else 0
        try:
            written, kv = self.client.compare_and_put(self.key, revision, self._seal(state))
        except (EtcdUnavailable, EtcdError) as exc:
            raise RendezvousConnectionError(f"etcd: {exc}") from None
        return None if kv is None else (self._unseal(kv.value), kv.mod_revision, written)


def etcd_client(endpoints: str, timeout_s: float) -> EtcdClient:
    """A client of the cluster at ``endpoints`` (``host:port,...``); ``ValueError`` on a bad list."""
    return EtcdClient(parse_endpoints(endpoints), timeout_s=timeout_s)


def job_store(client: EtcdClient, run_id: str, timeout_s: float) -> EtcdStore:
    """The job's store: torch's round stores are prefixes of it, and the vacancies live in it."""
    return EtcdStore(client, ROOT.format(run_id=run_id) + "store/", timedelta(seconds=timeout_s))


def etcd_handler(client: EtcdClient, store: EtcdStore, params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous for ``params`` (its run id, node counts, timeouts) with its state in
    etcd and its rounds' stores in ``store`` (:func:`job_store`)."""
    return create_handler(store, EtcdRendezvousBackend(client, params.run_id), params)


def ranks_store_address(client: EtcdClient, run_id: str, round_prefix: str) -> str:
    """Where the ranks of one rendezvous round meet (``etcd://host:port,.../prefix``): what the
    agent gives its ranks (``RESIHP_RANKS_STORE``) in place of the bootstrap TCPStore in node 0's agent."""
    return f"{SCHEME}{client.describe()}{ROOT.format(run_id=run_id)}ranks/{round_prefix}/"


def open_store_address(address: str, timeout_s: float) -> EtcdStore:
    """The store at an address :func:`ranks_store_address` made; ``ValueError`` naming a bad one."""
    if not address.startswith(SCHEME) or "/" not in address[len(SCHEME):]:
        raise ValueError(f"store address {address!r} is not etcd://HOST:PORT,.../PREFIX")
    endpoints, _, prefix = address[len(SCHEME):].partition("/")
    return EtcdStore(EtcdClient(parse_endpoints(endpoints), timeout_s=timeout_s), "/" + prefix,
                     timedelta(seconds=timeout_s))


def reachable(client: EtcdClient) -> None:
    """Raise ``EtcdUnavailable`` unless some member answers (one read)."""
    client.get(b"/resihp/rdzv/")

