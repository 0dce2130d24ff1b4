"""One analytics shard: the rank reports of the DP replicas it holds, folded into per-replica frames.

Why this split: at 100k ranks one process spends most of an iteration on per-rank work — decoding
every report, assembling the iteration, flattening chunks into arrays (analytics/frame.py) — and that
work divides by replica. Telemetry is keyed ``job/replica-D`` (collector/topics.py), so each member
of the analytics consumer group receives whole replicas. A shard groups a replica's reports per
(epoch, iteration), and once the replica is complete flattens them with ``build_frame`` and emits a
``ReplicaFrame``: the replica's frame arrays as columns. The merge (analytics/merge.py) concatenates
a job's replicas back into the frame the single process would have built and judges it there, so the
incidents are the same by construction.

A replica is complete when every rank it holds reported the iteration. Which ranks those are comes
from the plan when the shard has seen one; otherwise it is learned: the ranks that reported the
replica's previous completed iteration, and for the first iteration of an epoch, the ranks that
reported it once some rank of the replica has moved on to a later one.

The shard keeps no state worth saving: what it holds is reports of replicas not yet complete. It
commits its consumer offsets only below the oldest report still pending (``safe_positions``), so a
shard that dies, or loses a partition in a rebalance, hands the partition over at a point from which
the next owner rebuilds every unfinished replica from the log. Replicas it had already emitted may be
emitted again; the merge keeps the first copy of each (epoch, iteration, replica).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from analytics.frame import IterationFrame, build_frame
from collector.bus import Bus, TopicPartition
from collector.events import Envelope, PlanCurrent, RankIteration, ReconfigureCommand, ReplicaFrame

# The frame arrays a ReplicaFrame carries, by the rows they index.
RANK_COLUMNS = ("rank", "tp", "pp", "dp", "cp", "node", "wall_s")
CHUNK_COLUMNS = ("c_rank", "c_kind", "c_mb", "c_vs", "c_tokens", "c_s2", "c_start", "c_dur", "c_own")
COMM_COLUMNS = ("k_rank", "k_op", "k_peer", "k_mb", "k_bytes", "k_dur", "k_wait", "k_group")
DONE_KEPT = 64  # iterations per replica whose emission is remembered (a rebalance re-reads far fewer)
INT_COLUMNS = frozenset({"rank", "tp", "pp", "dp", "cp", "node", "c_rank", "c_kind", "c_mb", "c_vs",
                         "k_rank", "k_op", "k_peer", "k_mb", "k_group"})


def frame_columns(frame: IterationFrame) -> dict[str, list[float | None]]:
    """The frame's arrays as JSON-able lists (NaN as null; layer ranges are left to the merge,
    which holds the plan)."""
    out: dict[str, list[float | None]] = {}
    for name in (*RANK_COLUMNS, *CHUNK_COLUMNS, *COMM_COLUMNS):
        arr = getattr(frame, name)
        if name in INT_COLUMNS or arr.dtype == bool:
            out[name] = arr.astype(np.int64).tolist()
        else:
            out[name] = [None if math.isnan(x) else x for x in arr.tolist()]
    return out


@dataclass
class _Pending:
    reports: dict[int, RankIteration] = field(default_factory=dict)
    first_offset: dict[tuple[str, int], int] = field(default_factory=dict)  # per (topic, partition)


@dataclass
class ReplicaShard:
    """The per-replica fold of one analytics shard, for one job. Feed it events with ``on_event``;
    it returns the ReplicaFrames to publish."""

    job: str
    name: str = ""
    _pending: dict[tuple[int, int, int], _Pending] = field(default_factory=dict)  # (epoch, iteration, replica)
    _members: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (epoch, replica) -> ranks
    _planned: set[int] = field(default_factory=set)  # epochs whose members come from the plan
    _top: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, replica) -> latest iteration seen
    _done: set[tuple[int, int, int]] = field(default_factory=set)  # emitted (epoch, iteration, replica)
    emitted: int = 0

    def on_event(self, event: Envelope, where: tuple[str, int, int] | None = None) -> list[ReplicaFrame]:
        """Fold one event; ``where`` = (topic, partition, offset) it was read from, for safe commits."""
        p = event.payload
        if event.job != self.job:
            return []
        if isinstance(p, (PlanCurrent, ReconfigureCommand)):
            self._planned.add(p.plan.epoch)
            for d, role in p.plan.roles.items():
                self._members.setdefault((p.plan.epoch, role.replica), set()).add(int(d))
            return self._ready()
        if not isinstance(p, RankIteration):
            return []
        key = (p.epoch, p.iteration, p.coords.dp)
        if key in self._done:
            return []  # re-read after a rebalance: that replica's iteration is out already
        pend = self._pending.setdefault(key, _Pending())
        pend.reports.setdefault(p.rank, p)
        if where is not None:
            pend.first_offset.setdefault((where[0], where[1]), where[2])
        rk = (p.epoch, p.coords.dp)
        self._top[rk] = max(self._top.get(rk, -1), p.iteration)
        return self._ready()

    def flush(self) -> list[ReplicaFrame]:
        """Emit every replica still waiting (end of a recording)."""
        return [self._emit(k) for k in sorted(self._pending)]

    def _ready(self) -> list[ReplicaFrame]:
        out = []
        for key in sorted(self._pending):
            epoch, iteration, replica = key
            members = self._members.get((epoch, replica))
            have = set(self._pending[key].reports)
            if members is None:
                # learned: the first iteration of an epoch waits until the replica moved on
                if self._top.get((epoch, replica), -1) <= iteration:
                    continue
                self._members[(epoch, replica)] = have
            elif not members <= have:
                continue
            out.append(self._emit(key))
        return out

    def _emit(self, key: tuple[int, int, int]) -> ReplicaFrame:
        epoch, iteration, replica = key
        pend = self._pending.pop(key)
        self._done.add(key)
        if len(self._done) > 4 * DONE_KEPT * max(len(self._top), 1):  # remember the recent ones only
            self._done = {k for k in self._done if k[1] > self._top.get((k[0], k[2]), -1) - DONE_KEPT}
        if epoch not in self._planned:
            self._members[(epoch, replica)] = set(pend.reports)
        frame = build_frame(list(pend.reports.values()))
        self.emitted += 1
        return ReplicaFrame(epoch=epoch, iteration=iteration, replica=replica, ranks=frame.num_ranks,
                            shard=self.name, columns=frame_columns(frame))

    def replicas_emitted(self) -> set[int]:
        """The replicas this shard emitted frames of (recently): which replicas it holds."""
        return {k[2] for k in self._done}

    def safe_positions(self, read: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Per partition, the offset a successor may resume from without losing a pending report:
        the oldest pending report's offset, or ``read`` (just past what was read) when none pends."""
        out = dict(read)
        for pend in self._pending.values():
            for tp, off in pend.first_offset.items():
                if tp in out:
                    out[tp] = min(out[tp], off)
        return out


def shard_all(shard: ReplicaShard, events: Iterable[Envelope]) -> list[ReplicaFrame]:
    """Every ReplicaFrame a shard emits over a recording, flushed at its end."""
    out: list[ReplicaFrame] = []
    for e in events:
        out += shard.on_event(e)
    return out + shard.flush()


_REBALANCING = frozenset({"CommitFailedError", "RebalanceInProgressError"})


class ShardWorker:
    """A ReplicaShard on the bus: one member of the analytics consumer group on the telemetry topic.

    Each step polls, folds, publishes the ReplicaFrames that completed, and only then commits the
    group offsets, and only up to ``safe_positions``: a member that dies at any instant leaves its
    partitions to the next owner at a point from which every unfinished replica is rebuilt from the
    log (nothing lost); a replica emitted twice is dropped by the merge (nothing doubled)."""

    def __init__(self, bus: Bus, job: str, group: str, name: str = "", instance_id: str | None = None) -> None:
        from collector import topics
        from collector.stream import EventStream

        self.bus = bus
        self.shard = ReplicaShard(job, name)
        self.stream = EventStream(bus, group, [topics.TELEMETRY], instance_id=instance_id)
        self._committed: dict[tuple[str, int], int] = {}

    def step(self, max_records: int = 20_000, timeout_s: float = 0.2) -> int:
        """One poll; returns the records consumed."""
        from collector.events import EventFactory

        deliveries = self.stream.poll(max_records, timeout_s)
        frames: list[ReplicaFrame] = []
        for d in deliveries:
            frames += self.shard.on_event(d.event, (d.topic, d.partition, d.offset))
        if frames:
            f = EventFactory(self.shard.job, f"shard:{self.shard.name}")
            self.bus.publish([f.make(fr) for fr in frames])
        owned = self.stream.consumer.positions()  # only partitions still ours may be committed
        read = {(tp.topic, tp.partition): off for tp, off in self.stream.positions_after_poll().items() if tp in owned}
        safe = self.shard.safe_positions(read)
        if safe and safe != self._committed:
            try:
                self.stream.commit({TopicPartition(t, p): off for (t, p), off in safe.items()})
                self._committed = safe
            except Exception as exc:  # noqa: BLE001 - kafka's errors when a rebalance is taking them
                if type(exc).__name__ not in _REBALANCING:
                    raise
                # Not committed: the next owner resumes from the previous commit, older hence still safe.
        return self.stream.last_polled

    def close(self) -> None:
        self.stream.close()
