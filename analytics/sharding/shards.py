"""One analytics shard: the rank reports of the DP replicas it holds, scored into per-replica summaries.

Why this split: at 100k ranks one process spends most of an iteration on per-rank work — decoding
every report, assembling the iteration, flattening chunks into arrays (analytics/detection/frame.py), scoring
every chunk against the cost model — and that work divides by replica. Telemetry is keyed
``job/replica-D`` (collector/topics.py), so each member of the analytics consumer group receives
whole replicas. A shard groups a replica's reports per (epoch, iteration); once the replica is
complete and the merge's cost-model fits of the job's previous iteration are in
(``DetectorFits``), it scores the replica and emits a ``ReplicaSummary``
(analytics/sharding/replica_summary.py). The merge (analytics/sharding/merge.py) judges the job from the summaries.

A replica is complete when every rank it holds reported the iteration. Which ranks those are comes
from the plan when the shard has seen one; otherwise it is learned: the ranks that reported the
replica's previous completed iteration, and for the first iteration of an epoch, the ranks that
reported it once some rank of the replica has moved on to a later one.

Which fits: those the merge published after judging iteration i−1 (i−k when the producer traces
every k-th step), for a replica's iteration i — the single process predicts iteration i with the
fits the iterations before taught it. A shard
waits for them when the job has an iteration i−1 it knows of (it saw reports of iteration i−1 or
earlier); at the first iteration it ever saw it predicts with the latest fits it has, or with none
(classes are then fitted from its own replicas, see analytics/sharding/replica_summary.py).

The shard keeps no state worth saving: what it holds is reports of replicas not yet emitted. It
commits its consumer offsets only below the oldest report still held (``safe_positions``), so a
shard that dies, or loses a partition in a rebalance, hands the partition over at a point from which
the next owner rebuilds every unfinished replica from the log. Replicas it had already emitted may be
emitted again; the merge keeps the first copy of each (epoch, iteration, replica).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Set
from dataclasses import dataclass, field

import numpy as np

from analytics.detection.admission import EpochShape, undetectable
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import tracing_at
from analytics.detection.frame import LayerLookup, build_frame
from analytics.detection.p2p_waits import P2PWaitInference
from analytics.sharding.replica_summary import LIVENESS_ARRAYS, pack, summarize_replica
from collector.auth import Gate
from collector.bus import Bus, TopicPartition
from collector.events import (
    DetectorFits, Envelope, Heartbeat, LivenessBatch, PlanCurrent, RankIteration, ReconfigureCommand, ReplicaSummary,
    TracingDeclared,
)
from collector.plan import Plan

READ_AHEAD = 2  # iterations a shard reads past the oldest one waiting only for the merge's fits
DONE_KEPT = 64  # iterations per replica whose emission is remembered (a rebalance re-reads far fewer)
FITS_KEPT = 64  # the merge's latest fits kept, by iteration
log = logging.getLogger(__name__)


@dataclass
class _Pending:
    reports: dict[int, RankIteration] = field(default_factory=dict)
    complete: bool = False  # every rank reported: waits for the fits of the job's previous iteration
    first_offset: dict[tuple[str, int], int] = field(default_factory=dict)  # per (topic, partition)


@dataclass
class ReplicaShard:
    """The per-replica fold of one analytics shard, for one job. Feed it events with ``on_event``
    (rank reports, plans, the merge's fits); it returns the ReplicaSummaries to publish."""

    job: str
    name: str = ""
    config: DetectorConfig = field(default_factory=DetectorConfig)
    _pending: dict[tuple[int, int, int], _Pending] = field(default_factory=dict)  # (epoch, iteration, replica)
    _open: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (epoch, replica) -> its pending iterations
    _members: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (epoch, replica) -> ranks
    _plans: dict[int, Plan] = field(default_factory=dict)
    _layers: dict[int, LayerLookup] = field(default_factory=dict)
    _top: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, replica) -> latest iteration seen
    _done: set[tuple[int, int, int]] = field(default_factory=set)  # emitted (epoch, iteration, replica)
    _fits: dict[int, DetectorFits] = field(default_factory=dict)  # iteration -> the merge's fits after it
    _lowest: int | None = None  # the lowest iteration this shard saw a report of
    _read_to: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # (topic, partition) -> newest
    # (epoch, iteration) of a report read from it
    _dead: set[int] = field(default_factory=set)  # ranks the merge holds dead (its latest fits say)
    _dead_from: tuple[int, int] = (-2, -2)  # the fits that said so
    _heard: list[tuple[int, int, int, int, float, float]] = field(default_factory=list)  # liveness rows
    _iterations: dict[int, list[int]] = field(default_factory=dict)  # epoch -> iterations reported, sorted (recent)
    _declared: list[TracingDeclared] = field(default_factory=list)  # read since the last LivenessBatch
    _tracing: tuple[TracingDeclared, ...] = ()  # every declaration read (the newest per epoch)
    _shapes: dict[tuple[str, int], EpochShape] = field(default_factory=dict)  # what undetectable admitted
    # whether this job's undeclared p2p timers hold waits, told from its replicas' own records: the merge
    # centres and judges links on what each shard read (the single process says so as an event)
    _p2p_waits: P2PWaitInference = field(default_factory=P2PWaitInference)
    emitted: int = 0
    skipped: int = 0  # events kept out by analytics/detection/admission.py's rule
    failed: int = 0  # replica iterations whose summary could not be made (logged, left out)

    def on_event(self, event: Envelope, where: tuple[str, int, int] | None = None) -> list[ReplicaSummary]:
        """Fold one event; ``where`` = (topic, partition, offset) it was read from, for safe commits."""
        p = event.payload
        if event.job != self.job:
            return []
        why = undetectable(event, self._shapes)
        if why is not None:
            self.skipped += 1
            log.warning("shard %s, job %s: event %s (%s) is kept from the summaries: %s", self.name, event.job,
                        event.id, event.kind, why)
            return []
        if isinstance(p, DetectorFits):
            if (p.epoch, p.iteration) >= self._dead_from:
                self._dead, self._dead_from = set(p.dead), (p.epoch, p.iteration)
            held = self._fits.get(p.iteration)
            if held is None or (held.epoch, held.iteration) <= (p.epoch, p.iteration):
                self._fits[p.iteration] = p
            if len(self._fits) > FITS_KEPT:
                self._fits.pop(min(self._fits))
            return self._ready()
        if isinstance(p, (PlanCurrent, ReconfigureCommand)):
            self._plans[p.plan.epoch] = p.plan
            for pipe in p.plan.pipelines:  # a replica's members, stage by stage (once per plan)
                members = self._members.setdefault((p.plan.epoch, pipe.replica), set())
                for stage in pipe.stages:
                    members.update(stage.devices)
            return self._ready()
        if isinstance(p, Heartbeat):
            self._heard.append((1, p.rank, p.epoch, p.iteration, event.time_s, p.interval_s))
            return []
        if isinstance(p, TracingDeclared):
            self._declared.append(p)  # for the merge; and a replica's untraced ranks are not waited for
            self._tracing = tuple(d for d in self._tracing if d.epoch != p.epoch) + (p,)
            return self._ready()
        if not isinstance(p, RankIteration):
            return []
        self._heard.append((0, p.rank, p.epoch, p.iteration, event.time_s, 0.0))
        key = (p.epoch, p.iteration, p.coords.dp)
        if key in self._done:
            return []  # re-read after a rebalance: that replica's iteration is out already
        self._lowest = p.iteration if self._lowest is None else min(self._lowest, p.iteration)
        pend = self._pending.get(key)
        if pend is None:
            pend = self._pending[key] = _Pending()
            self._open.setdefault((p.epoch, p.coords.dp), set()).add(p.iteration)
        pend.reports.setdefault(p.rank, p)
        if where is not None:
            pend.first_offset.setdefault((where[0], where[1]), where[2])
            read = self._read_to.get((where[0], where[1]))
            if read is None or read < key[:2]:
                self._read_to[(where[0], where[1])] = key[:2]
        rk = (p.epoch, p.coords.dp)
        self._top[rk] = max(self._top.get(rk, -1), p.iteration)
        seen = self._iterations.setdefault(p.epoch, [])
        if not seen or seen[-1] != p.iteration:  # most reports are of the newest iteration: no search
            at = bisect.bisect_left(seen, p.iteration)
            if at == len(seen) or seen[at] != p.iteration:
                seen.insert(at, p.iteration)
                del seen[:-DONE_KEPT]
        return self._ready(rk)

    def flush(self) -> list[ReplicaSummary]:
        """Emit every replica still waiting (end of a recording), with the fits at hand."""
        out = [self._emit(k, self._best_fits(*k[:2])) for k in sorted(self._pending)]
        return [s for s in out if s is not None]

    def _ready(self, replica: tuple[int, int] | None = None) -> list[ReplicaSummary]:
        """Emit what is ready. After a rank report only its replica's iterations can have become
        ready (``replica`` = (epoch, replica)); fits, plans and declarations can change any."""
        keys = sorted(self._pending) if replica is None else sorted(
            (replica[0], i, replica[1]) for i in self._open.get(replica, ()))
        out = []
        for key in keys:
            epoch, iteration, replica_id = key
            pend = self._pending[key]
            if not pend.complete:
                members = self._members.get((epoch, replica_id))
                have = pend.reports.keys()
                if members is None:
                    # learned: the first iteration of an epoch waits until the replica moved on
                    if self._top.get((epoch, replica_id), -1) <= iteration:
                        continue
                    self._members[(epoch, replica_id)] = set(have)
                elif not self._all_reported(self._traced(members, epoch), have):
                    continue
                pend.complete = True
            before = self._previous_reported(epoch, iteration)
            fits = self._fits.get(iteration - 1 if before is None else before)
            if fits is not None and (fits.epoch, fits.iteration) < (epoch, iteration):
                summary = self._emit(key, fits)
            elif self._lowest is not None and iteration <= self._lowest:
                summary = self._emit(key, self._best_fits(epoch, iteration))
            else:
                continue  # the merge has not judged the job's previous iteration yet
            if summary is not None:
                out.append(summary)
        return out

    def _previous_reported(self, epoch: int, iteration: int) -> int | None:
        """The job's iteration before ``iteration`` that this shard saw reports of: the one whose
        fits the single process predicts ``iteration`` with. A producer that traces every k-th
        step (``TracingDeclared.step_every``) sends nothing for the steps between, and the merge
        judges and fits none of them: waiting for iteration − 1's fits there waited for ever. Read
        from the reports, not the declaration: a declaration lands in one partition, so one shard."""
        seen = self._iterations.get(epoch, [])
        at = bisect.bisect_left(seen, iteration)
        return seen[at - 1] if at else None

    def _all_reported(self, due: set[int], have: Set[int]) -> bool:
        """Every rank in ``due`` that the merge does not hold dead reported. Counted first: until
        the replica's last report the count alone says no, and a set difference of its ranks for
        each of its reports was a fifth of a shard's fold."""
        return len(have) + len(self._dead) >= len(due) and due - self._dead <= have

    def _traced(self, members: set[int], epoch: int) -> set[int]:
        """The members whose reports are due: a rank its producer declared untraced sends none."""
        declared = tracing_at(self._tracing, epoch)
        return members if declared is None else {r for r in members if declared.rank_traced(r)}

    def take_liveness(self) -> LivenessBatch | None:
        """The heartbeats, report progress and tracing declarations read since the last call, for
        the merge's fail-stop watch (shards hold whole replicas, but liveness is judged against the
        whole job)."""
        if not self._heard and not self._declared:
            return None
        rows = np.array(self._heard, dtype=float).reshape(-1, len(LIVENESS_ARRAYS))
        declared, self._heard, self._declared = self._declared, [], []
        layout, blob = pack(dict(zip(LIVENESS_ARRAYS, rows.T)))
        return LivenessBatch(rows=len(rows), shard=self.name, layout=layout, blob=blob, declared=declared)

    def _best_fits(self, epoch: int, iteration: int) -> DetectorFits | None:
        """The latest fits from before (epoch, iteration)."""
        before = [f for f in self._fits.values() if (f.epoch, f.iteration) < (epoch, iteration)]
        return max(before, key=lambda f: (f.epoch, f.iteration)) if before else None

    def _emit(self, key: tuple[int, int, int], fits: DetectorFits | None) -> ReplicaSummary | None:
        """The replica iteration's summary; None when its reports cannot make one (logged and
        counted in ``failed``: a writer on the telemetry topic can send reports the schema admits
        and no job makes, and one replica iteration must not stop the shard)."""
        epoch, iteration, replica = key
        pend = self._pending.pop(key)
        still = self._open[(epoch, replica)]
        still.discard(iteration)
        if not still:
            del self._open[(epoch, replica)]
        self._done.add(key)
        if len(self._done) > 4 * DONE_KEPT * max(len(self._top), 1):  # remember the recent ones only
            self._done = {k for k in self._done if k[1] > self._top.get((k[0], k[2]), -1) - DONE_KEPT}
        plan = self._plans.get(epoch)
        if plan is None:
            self._members[(epoch, replica)] = set(pend.reports)
        elif epoch not in self._layers:
            self._layers[epoch] = LayerLookup(plan)
        if fits is not None and fits.epoch != epoch and epoch not in fits.planned_epochs:
            fits = None  # a new layout without a plan: the single process forgets its fits too
        try:
            frame, _ = self._p2p_waits.read(build_frame(list(pend.reports.values()), self._layers.get(epoch)))
            summary = summarize_replica(
                frame, fits, window_iterations=self.config.window_iterations,
                chunk_quantile=self.config.chunk_quantile,
                schedule=(plan.schedule, plan.virtual_stages) if plan is not None else (None, None),
                replicas=len(plan.pipelines) if plan is not None else None, replica=replica, shard=self.name)
        except Exception:  # see the docstring: logged, counted, the shard goes on
            self.failed += 1
            log.exception("shard %s, job %s: replica %d of iteration %d (epoch %d) cannot be summarised; left out",
                          self.name, self.job, replica, iteration, epoch)
            return None
        self.emitted += 1
        return summary

    def waiting_for_fits(self) -> bool:
        """Some replica is complete and waits only for the merge's fits."""
        return any(p.complete for p in self._pending.values())

    def read_enough(self) -> set[tuple[str, int]]:
        """The partitions read READ_AHEAD iterations past the oldest replica that waits only for
        the merge's fits. Once every partition a shard holds is, reading on would only pile
        reports up, and the merge waits on none of them: it waits for an iteration older than that
        replica's, whose reports precede, in their partition, those of READ_AHEAD iterations later
        (a partition never read is not in the set, so it is read)."""
        waiting = [k[:2] for k, p in self._pending.items() if p.complete]
        if not waiting:
            return set()
        epoch, iteration = min(waiting)
        return {tp for tp, read in self._read_to.items() if read >= (epoch, iteration + READ_AHEAD)}

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


_REBALANCING = frozenset({"CommitFailedError", "RebalanceInProgressError"})


class ShardWorker:
    """A ReplicaShard on the bus: one member of the analytics consumer group on the telemetry topic,
    plus a reader of its own over the analytics and control topics for the merge's fits and the
    plans (every shard needs all of those, so they are not split by the group).

    Each step reads the fits and plans that arrived, polls telemetry, folds, publishes the
    ReplicaSummaries that are ready, and only then commits the group offsets, and only up to
    ``safe_positions``: a member that dies at any instant leaves its partitions to the next owner at
    a point from which every unfinished replica is rebuilt from the log (nothing lost); a replica
    emitted twice is dropped by the merge (nothing doubled)."""

    def __init__(self, bus: Bus, job: str, group: str, name: str = "", instance_id: str | None = None,
                 config: DetectorConfig | None = None) -> None:
        import uuid

        from collector import topics
        from collector.stream import EventStream

        self.bus = bus
        self.shard = ReplicaShard(job, name, config or DetectorConfig())
        self.stream = EventStream(bus, group, [topics.TELEMETRY], instance_id=instance_id)
        # From the start of the log at assignment, not at construction: on Kafka a consumer holds no
        # partitions until its group's join completes, so a seek made earlier reaches nothing and
        # the group would start at the end, past fits the merge published meanwhile, which a
        # complete replica then waits for forever.
        self.side = EventStream(bus, f"{group}.fits.{uuid.uuid4().hex[:8]}", [topics.ANALYTICS, topics.CONTROL],
                                on_assign=lambda parts: {tp: 0 for tp in parts})
        self._committed: dict[tuple[str, int], int] = {}
        # Plans and commands steer which ranks a replica waits for: only signed ones may (the merge's gate, too).
        self.gate = Gate(f"analytics-shard:{name}" if name else "analytics-shard")

    def step(self, max_records: int = 20_000, timeout_s: float = 0.2) -> int:
        """One poll of each; returns the telemetry records consumed."""
        from collector.events import EventFactory

        # While complete replicas wait for the merge's fits, wait on those rather than on telemetry,
        # and stop reading telemetry once every partition is READ_AHEAD iterations past them:
        # decoding the next iteration overlaps the merge's round trip, and a shard catching up on a
        # backlog holds a few iterations of reports, not the whole backlog. (Not polling at all, not
        # kafka-python's pause: with records of a partition left over from a poll, its resume lost
        # them. A rebalance waits on a member's poll, so a held shard polls while its group joins:
        # held through one, the survivors of a killed shard would wait for fits that need the
        # replicas the rebalance hands them.)
        waiting = self.shard.waiting_for_fits()
        owned = {(tp.topic, tp.partition) for tp in self.stream.consumer.positions()}
        held = bool(owned) and owned <= self.shard.read_enough() and not self.stream.consumer.joining()
        ready: list[ReplicaSummary] = []
        for d in self.side.poll(10_000, timeout_s if waiting else 0.0):
            if (isinstance(d.event.payload, (DetectorFits, PlanCurrent, ReconfigureCommand))
                    and self.gate.admit(d.event, time_s=d.event.time_s)):
                ready += self.shard.on_event(d.event)
        for d in [] if held else self.stream.poll(max_records, 0.0 if waiting else timeout_s):
            ready += self.shard.on_event(d.event, (d.topic, d.partition, d.offset))
        heard = self.shard.take_liveness()
        if ready or heard:
            f = EventFactory(self.shard.job, f"shard:{self.shard.name}")
            self.bus.publish([f.make(x) for x in ([heard] if heard else []) + ready])
        if rejected := self.gate.take():
            self.bus.publish(rejected)
        mine = self.stream.consumer.positions()  # only partitions still ours may be committed
        read = {(tp.topic, tp.partition): off for tp, off in self.stream.positions_after_poll().items() if tp in mine}
        safe = self.shard.safe_positions(read)
        if safe and safe != self._committed:
            try:
                self.stream.commit({TopicPartition(t, p): off for (t, p), off in safe.items()})
                self._committed = safe
            except Exception as exc:  # kafka's errors when a rebalance is taking them
                if type(exc).__name__ not in _REBALANCING:
                    raise
                # Not committed: the next owner resumes from the previous commit, older hence still safe.
        return 0 if held else self.stream.last_polled

    def close(self) -> None:
        self.stream.close()
        self.side.close()
