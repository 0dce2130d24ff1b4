"""Fail-stop recovery inside the job: the survivors re-form the world and go on, smaller.

Under ``resihp run --on-failure shrink`` the agent does not tear the worker group down when a rank
dies: it counts the loss (``resihp/lost-count``) and marks the rank lost (``resihp/lost/<rank>``)
in the ranks' store (:func:`open_ranks_store`: the bootstrap store, or the round's keys on etcd
under ``--rdzv-backend etcd``), and leaves the survivors running. A data-parallel job then
recovers in place with :class:`ShrinkingWorld`, one method per step of the protocol (read it the
way torchft's manager reads):

    detect        a collective failed: it raised (a peer's socket closed), or the loss count moved
                  while the rank waited in it. Waiting is what makes recovery fast: a rank blocked
                  on a live peer that has itself given up gets no error until the gloo timeout, so
                  every collective runs asynchronously and the rank polls the count while it waits
                  (a store round trip every 2 ms). The old group is dropped, not destroyed: its
                  worker threads may still be blocked until their timeout
    close         the quorum of generation g+1: every rank of the old world has either joined
                  (``resihp/world/<g+1>/join/<rank>``, with the steps it has committed) or been
                  marked lost by its agent; the survivors, in rank order, are the new world
    rebuild       a new gloo default group over them (its rendezvous under ``resihp/world/<g+1>/pg/``)
    restore       the state of the survivor with the most committed steps is broadcast to all (a
                  peer that stepped just before the failure had the full reduced gradient, so its
                  state is the right one; peers that had not stepped take it)
    first step    the caller's next step finished; the phases go to the agent (a JSON file in the
                  flight directory) which logs and publishes them (trainer/agent/node.py)

A rank can also be *benched*: marked lost while it still runs (the agent does this to the rank a
hang report names: a SIGSTOPped or stuck rank). Its peers shrink as above. When it runs again
(SIGCONT), its next collective notices the loss count, it finds itself marked lost and asks to
rejoin (``resihp/rejoin/<rank>``, ``resihp/rejoin-count``); the world agrees at the next step
boundary (:meth:`admit`, a one-number all-reduce per step), grows by it as generation g+1 and
hands it the state like any restore. That re-admission is a recovery too, with the same phases.

A replacement (its agent took a dead node's place, trainer/agent/vacancy.py) starts with its rank
marked lost: it forms no group and joins the same way (:meth:`join`), at the next step boundary.

Every record here that decides something — a lost mark, a join, a request to rejoin, an admission,
a grown world's members, the end — is signed (trainer/agent/signed_store.py) for the rendezvous
round its agent names (``RESIHP_STORE_SCOPE``); the counters only wake ranks up. A stranger who
reaches the ranks' store cannot mark a rank lost, join the world or take a lost rank's place.

Rank ids are the ranks torch gave at start and stay the identity of a process across generations
(plans and flight records name them); ``rank`` / ``world_size`` are the current generation's.

The groups are ``ProcessGroupGloo`` objects used directly (not torch's default group), so a new
one can be made while an abandoned one still has a collective in flight; a process that abandoned
one should leave with ``os._exit`` (its teardown would wait for those threads).

What can fail: a rank that joined dies before the new group forms (its peers' rendezvous waits out
``timeout_s``, then raises); the agent never marks a silent peer lost (``close`` raises after
``timeout_s``, naming it).
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from collector.settings import elastic_environment, environment
from collector.auth import load_keyring
from trainer.agent.etcd_store import open_store_address
from trainer.agent.signed_store import RANK_WRITERS, SignedStore, rank_role

LOST_KEY = "resihp/lost/{rank}"
LOST_COUNT_KEY = "resihp/lost-count"  # added to before the rank's key is set
REJOIN_COUNT_KEY = "resihp/rejoin-count"
DRAIN_COUNT_KEY = "resihp/drain-count"  # added to after a node's agent asked to drain its ranks
POLL_S = 0.002
Phase = Literal["detected", "rendezvous closed", "new world", "state restored", "first step"]
PHASES: tuple[Phase, ...] = ("detected", "rendezvous closed", "new world", "state restored", "first step")


def lost_key(rank: int) -> str:
    return LOST_KEY.format(rank=rank)


DONE_KEY = "resihp/done"
STORE_SCOPE_ENV = "RESIHP_STORE_SCOPE"  # the agent tells its ranks the round their records belong to


class WorldFinished(Exception):
    """The world finished the job while this rank waited to rejoin it: nothing is left to do."""


class Departed(WorldFinished):
    """This rank left the world at a step boundary because its agent drains its node (a node
    stop): the world goes on without it, and it has nothing left to do (it exits 0)."""


class PeerLost(RuntimeError):
    """A rank of this world was lost while this rank waited in a collective."""


def mark_lost(records: SignedStore, rank: int, exitcode: int | None, *, wake: bool = True) -> None:
    """The agent's side: count the loss first, so a rank that sees the mark also sees the count.
    ``exitcode`` None: the rank died with its agent, which another agent noticed. The mark is
    signed; the count is only a wake-up (a stranger's add costs the ranks a look, :meth:`ShrinkingWorld._wait`).
    ``wake`` False: the rank already left the world (drained), nobody waits for it, and the mark
    only says that its place is open (a replacement's rank finds itself lost and joins)."""
    records.store.delete_key(admitted_key(rank))  # a rank benched again must be admitted again
    if wake:
        records.store.add(LOST_COUNT_KEY, 1)
    records.set(lost_key(rank), {"exitcode": exitcode})


def drain(records: SignedStore, ranks: list[int]) -> None:
    """The agent's side of a node stop: ask the world to let ``ranks`` go at its next step boundary
    (signed, one record per rank; the count, added to after, is a wake-up)."""
    for rank in ranks:
        records.set(drain_key(rank), {"drain": True})
    records.store.add(DRAIN_COUNT_KEY, 1)


def drain_key(rank: int) -> str:
    return f"resihp/drain/{rank}"


def is_lost(records: SignedStore, rank: int) -> bool:
    """Whether an agent marked ``rank`` lost: a signed mark only (a forged one is refused, reported)."""
    return records.valid(lost_key(rank))


def rank_records(store: dist.Store, rank: int) -> SignedStore:
    """A rank's signed records in the ranks' store, signed as a rank (:func:`rank_role`)."""
    keyring = load_keyring()
    return SignedStore(store, store_scope(), reader=f"rank-{rank}", keyring=keyring, role=rank_role(keyring))


def store_scope() -> str:
    """The scope of this rank's signed records in the ranks' store: the rendezvous round its agent
    names (``RESIHP_STORE_SCOPE``), else torch elastic's run id."""
    return environment().store_scope or elastic_environment().TORCHELASTIC_RUN_ID


def open_ranks_store(timeout_s: float) -> dist.Store:
    """The store this round's ranks meet in: on etcd when the agent names one (``RESIHP_RANKS_STORE``,
    ``--rdzv-backend etcd``: nothing the ranks need lives in an agent), else the bootstrap TCPStore
    (MASTER_ADDR/MASTER_PORT, served by the agent of node 0)."""
    address = environment().ranks_store
    if address:
        return open_store_address(address, timeout_s)
    env = elastic_environment()
    return dist.TCPStore(env.MASTER_ADDR, env.MASTER_PORT, is_master=False, timeout=timedelta(seconds=timeout_s))


def admitted_key(rank: int) -> str:
    return f"resihp/admitted/{rank}"


def recovery_file(flight_dir: str, generation: int) -> str:
    return os.path.join(flight_dir, f"recovery-g{generation}.json")


def shrink_enabled() -> bool:
    """Whether the agent that started this rank keeps survivors running (``--on-failure shrink``)."""
    return environment().on_failure == "shrink"


@dataclass
class Recovery:
    """One recovery as this rank saw it: each phase's duration on this host's clock."""

    generation: int
    world: tuple[int, ...]
    lost: tuple[int, ...]
    failed_op: str
    step: int = 0
    source: int = -1
    durations_s: dict[str, float] = field(default_factory=dict)


class ShrinkingWorld:
    """The process group of a data-parallel job that outlives its ranks' deaths."""

    def __init__(self, store: dist.Store, ranks: tuple[int, ...], rank_id: int, timeout_s: float,
                 joining: bool = False, records: SignedStore | None = None) -> None:
        """``joining``: this process replaces a lost rank of a running world (its agent took a dead
        node's place, trainer/agent/vacancy.py); it forms no group until :meth:`join` admits it.
        ``records``: the signed records in ``store`` (default: scoped by :func:`store_scope`)."""
        self.store, self.world, self.rank_id, self.timeout_s = store, ranks, rank_id, timeout_s
        self.records = records or rank_records(store, rank_id)
        self.joining = joining
        self.everyone = ranks  # every rank the job started with: who may ask to rejoin
        self.generation = 0
        self._rejoin_seen = 0
        self._drain_seen = 0
        self.recoveries: list[Recovery] = []
        self.abandoned: list[Any] = []  # kept: dropping one joins its blocked threads
        self._pending: Recovery | None = None
        self._mark = 0.0
        self._lost_seen = 0
        self.group: Any = None if joining else self._group(0)

    @classmethod
    def from_env(cls, timeout_s: float = 30.0) -> ShrinkingWorld:
        """Join generation 0 over the ranks' store (:func:`open_ranks_store`); or, when
        this rank is already marked lost there, it is a replacement that must :meth:`join`."""
        env = elastic_environment()
        store = open_ranks_store(timeout_s)
        records = rank_records(store, env.RANK)
        joining = is_lost(records, env.RANK)
        return cls(store, tuple(range(env.WORLD_SIZE)), env.RANK, timeout_s, joining=joining, records=records)

    @property
    def rank(self) -> int:
        return self.world.index(self.rank_id)

    @property
    def world_size(self) -> int:
        return len(self.world)

    def _group(self, generation: int) -> Any:  # a ProcessGroupGloo: torch's stubs omit its collectives
        self._lost_seen = self.store.add(LOST_COUNT_KEY, 0)
        prefixed = dist.PrefixStore(f"resihp/world/{generation}/pg/", self.store)
        return dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timedelta(seconds=self.timeout_s))

    # ---- collectives that notice a lost peer --------------------------------------------------------

    def _wait(self, work: Any, op: str) -> None:
        """Wait for ``work``; ``PeerLost`` when the loss count moved. The count is a wake-up a
        stranger can add to as well: that costs one re-formation of the same world (:meth:`close`
        counts only signed marks), never a rank."""
        while not work.is_completed():
            if self.store.add(LOST_COUNT_KEY, 0) != self._lost_seen:
                raise PeerLost(f"{op}: a rank of generation {self.generation} was lost")
            time.sleep(POLL_S)
        work.wait()  # the collective's own error, if it failed

    def all_reduce(self, tensor: torch.Tensor, op: str = "all_reduce") -> None:
        """Sum ``tensor`` over the world, in place."""
        self._wait(self.group.allreduce([tensor]), op)

    def broadcast(self, tensor: torch.Tensor, source: int, op: str = "broadcast") -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = source
        self._wait(self.group.broadcast([tensor], opts), op)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1), "barrier")

    def agree_max(self, value: int, op: str) -> int:
        """The largest of every rank's ``value``: how the world agrees on one thing at a step boundary."""
        return self.agree_max_each([value], op)[0]

    def agree_max_each(self, values: list[int], op: str) -> list[int]:
        """The largest of every rank's value at each position (one all-reduce)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.group.allreduce([tensor], opts), op)
        return [int(v) for v in tensor]

    # ---- the steps --------------------------------------------------------------------------------

    def detect(self, failed_op: str, op_started: float) -> Recovery:
        """The collective ``failed_op`` (entered at ``op_started``, ``time.monotonic``) raised: leave
        the old group. 'detected' lasts from entering the op to now: how long this rank sat in it."""
        now = time.monotonic()
        self.abandoned.append(self.group)
        rec = Recovery(self.generation + 1, (), (), failed_op)
        rec.durations_s["detected"] = now - op_started
        self._mark = time.monotonic()
        return rec

    def close(self, rec: Recovery, step: int) -> None:
        """Join generation g+1 and wait until every rank of the old world joined or was marked lost
        (signed records only: a forged join or mark is refused, reported, and waited past)."""
        prefix = f"resihp/world/{rec.generation}/join/"
        self.records.set(f"{prefix}{self.rank_id}", {"step": step})
        deadline = time.monotonic() + self.timeout_s
        while True:
            joined = [r for r in self.world if self.records.valid(f"{prefix}{r}", RANK_WRITERS)]
            lost = [r for r in self.world if r not in joined and is_lost(self.records, r)]
            if len(joined) + len(lost) == len(self.world):
                break
            if time.monotonic() > deadline:
                silent = sorted(set(self.world) - set(joined) - set(lost))
                raise TimeoutError(f"generation {rec.generation}: ranks {silent} neither joined nor were marked lost "
                                   f"within {self.timeout_s:g} s; is every agent running with --on-failure shrink?")
            time.sleep(0.002)
        rec.world, rec.lost = tuple(joined), tuple(lost)
        self._phase(rec, "rendezvous closed")

    def rebuild(self, rec: Recovery) -> None:
        """The new default group over the survivors."""
        self.world, self.generation = rec.world, rec.generation
        self.group = self._group(rec.generation)
        self._phase(rec, "new world")

    def restore(self, rec: Recovery, step: int, state: Callable[[], Any], load: Callable[[Any], None]) -> int:
        """Every survivor takes the state of the one with the most committed steps (the lowest rank
        among equals); returns that step count."""
        steps = torch.zeros(self.world_size, dtype=torch.int64)
        steps[self.rank] = step
        self.all_reduce(steps, "all_reduce(steps)")
        source = int(torch.argmax(steps))  # the first maximum: the lowest rank among equals
        size = torch.zeros(1, dtype=torch.int64)
        payload = b""
        if source == self.rank:
            buffer = io.BytesIO()
            torch.save(state(), buffer)
            payload = buffer.getvalue()
            size[0] = len(payload)
        self.broadcast(size, source, "broadcast(state size)")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(
            int(size[0]), dtype=torch.uint8)
        self.broadcast(data, source, "broadcast(state)")
        if source != self.rank:
            load(torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))
        rec.step, rec.source = int(steps[source]), self.world[source]
        self._phase(rec, "state restored")
        return rec.step

    def stepped(self) -> Recovery | None:
        """The caller finished a step. The first after a recovery closes it: its phases go to the
        agent (rank 0 of the new world writes them where the agent looks). Returns the recovery."""
        rec, self._pending = self._pending, None
        if rec is None:
            return None
        self._phase(rec, "first step")
        self.recoveries.append(rec)
        flight_dir = environment().flight_dir
        if flight_dir and self.rank == 0:
            path = recovery_file(flight_dir, rec.generation)
            with open(f"{path}.tmp", "w") as f:
                json.dump(rec.__dict__, f)
            os.replace(f"{path}.tmp", path)
        return rec

    def rejoin(self, rec: Recovery, step: int, state: Callable[[], Any], load: Callable[[Any], None]) -> int:
        """This rank was benched (marked lost while alive): ask to rejoin, wait until the world
        admits it (no bound: the world may be busy for a long time), then take the state.
        ``WorldFinished`` if the world ends the job first."""
        self.records.set(f"resihp/rejoin/{self.rank_id}", {"step": step})
        self.store.add(REJOIN_COUNT_KEY, 1)  # a wake-up: the world admits only signed requests
        while (generation := self.records.read(admitted_key(self.rank_id), _generation, RANK_WRITERS)) is None:
            if self.records.valid(DONE_KEY, RANK_WRITERS):
                raise WorldFinished(f"rank {self.rank_id}: the world finished the job while it waited to rejoin")
            time.sleep(0.01)
        rec.generation = generation
        rec.world, self._rejoin_seen, self._drain_seen = self._members(generation)
        self._phase(rec, "rendezvous closed")
        self.rebuild(rec)
        return self.restore(rec, step, state, load)

    def admit(self, step: int, state: Callable[[], Any], load: Callable[[Any], None]) -> int:
        """At a step boundary, every rank of the world: grow by the benched ranks that asked to
        rejoin, and shrink by the ranks whose agent drains them (a node stop), if any (all agree
        through one all-reduce); returns the step to go on from, or raises :class:`Departed` on a
        rank that leaves here. A drain loses no work: every rank finished the step, so the ones
        that stay hold the whole state and nothing is redone.
        The counts only say that someone asked: rank 0 admits a rank only on its signed request
        and lets one go only on its agent's signed drain, so a stranger's request (a process that
        claims a lost rank's id to receive the model's state) is refused and reported, and the
        world re-forms as it was."""
        started = time.monotonic()
        asked, draining = self.agree_max_each([self.store.add(REJOIN_COUNT_KEY, 0), self.store.add(DRAIN_COUNT_KEY, 0)],
                                              "all_reduce(rejoin requests)")
        if asked <= self._rejoin_seen and draining <= self._drain_seen:
            return step
        self._rejoin_seen, self._drain_seen = max(asked, self._rejoin_seen), max(draining, self._drain_seen)
        generation = self.generation + 1
        members_key = f"resihp/world/{generation}/members"
        if self.rank == 0:
            joiners = [r for r in self.everyone if r not in self.world and self.records.valid(f"resihp/rejoin/{r}", RANK_WRITERS)]
            leavers = [r for r in self.world if self.records.valid(drain_key(r))]  # agents' records only
            self.records.set(members_key, {"members": sorted({*self.world, *joiners} - set(leavers)),
                                           "rejoin_seen": self._rejoin_seen, "drain_seen": self._drain_seen})
            for r in leavers:
                self.store.delete_key(drain_key(r))
            for r in joiners:
                self.store.delete_key(f"resihp/rejoin/{r}")
                self.store.delete_key(lost_key(r))
                self.records.set(admitted_key(r), {"generation": generation})
        members, _, _ = self._members(generation)
        if self.rank_id not in members:
            self.abandoned.append(self.group)
            raise Departed(f"rank {self.rank_id} left the world after step {step}: its node is stopping")
        joined = tuple(r for r in members if r not in self.world)
        left = tuple(r for r in self.world if r not in members)
        what = " and ".join(part for part in (f"rejoin of ranks {list(joined)}" if joined else "",
                                              f"drain of ranks {list(left)}" if left else "") if part)
        rec = Recovery(generation, members, left, what or "rejoin of ranks []")
        rec.durations_s["detected"] = time.monotonic() - started
        self._mark = time.monotonic()
        self._phase(rec, "rendezvous closed")
        self.abandoned.append(self.group)
        self.rebuild(rec)
        if joined:  # a newcomer needs the state; after a drain alone, every rank already holds it
            restored = self.restore(rec, step, state, load)
        else:
            restored, rec.step, rec.source = step, step, self.world[0]
            self._phase(rec, "state restored")
        self._pending = rec
        return restored

    def _members(self, generation: int) -> tuple[tuple[int, ...], int, int]:
        """Who generation ``generation`` (changed by :meth:`admit`) holds, and the rejoin requests
        and drains it answered: a rank taken back must not count those as new at its next step. Waits for
        rank 0's signed record (a forged one is refused, reported, and waited past) up to the timeout."""
        key = f"resihp/world/{generation}/members"
        deadline = time.monotonic() + self.timeout_s
        while (record := self.records.read(key, _members, RANK_WRITERS)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {generation}: no signed member list from the world's rank 0 within "
                                   f"{self.timeout_s:g} s under {key}")
            time.sleep(0.002)
        return record

    def join(self, state: Callable[[], Any], load: Callable[[Any], None]) -> int:
        """A replacement's first step: ask to join, wait until the world admits it at a step
        boundary, take the state; returns the step to go on from. ``WorldFinished`` if the world
        ends the job first."""
        rec = Recovery(0, (), (), "join of a replacement")
        rec.durations_s["detected"] = 0.0
        self._mark = time.monotonic()
        restored = self.rejoin(rec, 0, state, load)
        self.joining, self._pending = False, rec
        return restored

    def finish(self) -> None:
        """The job is done (every rank of the world, after its last collective): a benched rank
        still waiting to rejoin stops waiting."""
        if self.rank == 0:
            self.records.set(DONE_KEY, {"generation": self.generation})

    # ---- the protocol -----------------------------------------------------------------------------

    def recover(self, failed_op: str, op_started: float, step: int, state: Callable[[], Any],
                load: Callable[[Any], None]) -> int:
        """detect → close → rebuild → restore (or, for a benched rank, detect → rejoin); returns the
        committed step to go on from."""
        rec = self.detect(failed_op, op_started)
        if is_lost(self.records, self.rank_id):
            restored = self.rejoin(rec, step, state, load)
            self._pending = rec
            return restored
        self.close(rec, step)
        self.rebuild(rec)
        restored = self.restore(rec, step, state, load)
        self._pending = rec
        return restored

    def _phase(self, rec: Recovery, phase: str) -> None:
        now = time.monotonic()
        rec.durations_s[phase] = now - self._mark
        self._mark = now


def _generation(body: Any) -> int:
    """An admission's body: ``{"generation": G}``."""
    generation = body["generation"]
    if type(generation) is not int or generation < 0:
        raise ValueError(f"generation {generation!r} is not a generation")
    return generation


def _members(body: Any) -> tuple[tuple[int, ...], int, int]:
    """A changed world's body: ``{"members": [...], "rejoin_seen": N, "drain_seen": M}``."""
    members = tuple(body["members"])
    counts = (body["rejoin_seen"], body["drain_seen"])
    if not all(type(r) is int for r in members) or not all(type(c) is int for c in counts):
        raise ValueError("members are rank ids, rejoin_seen and drain_seen counts")
    return members, *counts
