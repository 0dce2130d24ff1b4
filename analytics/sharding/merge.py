"""The merge step of sharded analytics: per-replica summaries in, the job-level verdict out.

Shards (analytics/sharding/shards.py) each score whole DP replicas into ``ReplicaSummary``s
(analytics/sharding/replica_summary.py); this one process per job collects an iteration's summaries,
centres the ranks and links across the job, teaches its cost model the units of the TP groups it
does not suspect, and runs the detector's judgement in the single process's order
(analytics/detection/detector.py ``judge_iteration``, with ``SummaryScorer``: σ, the judges, the incident
book, the prediction, health). After each iteration it publishes its fits
(``DetectorFits``), with which the shards predict the job's next iteration, as the single process
predicts with the fits of the iterations before. It never touches a chunk, so its cost grows with
ranks and replicas, not with chunks.

An iteration is judged once every replica of its epoch's plan (``plan.current`` or a reconfigure
command, read from the control topic) sent its summary, strictly in order. Without the plan the merge
cannot know how many replicas make the job, and judging the replicas that happened to arrive first
would centre the job on a part of it: it waits (``flush`` at the end of a recording judges what is
there). Trainers and the simulator announce their plan before their first iteration. The first
summary of each (epoch, iteration, replica) counts; a copy (a shard replaying after a rebalance) and
a summary of an iteration already judged are dropped and counted in ``duplicates``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np

from analytics.detection.facts import IterationFacts
from analytics.detection.detector import Detector, judge_iteration
from analytics.detection.config import DetectorConfig
from analytics.sharding.replica_summary import (
    LIVENESS_ARRAYS, ReplicaJobView, fits_event, replica_job_view, summary_shape_problem, unpack_all,
)
from analytics.detection.scoring import FrameScore, fit_ranks, forget_suspects, group_tags, learn_units
from collector.bus import Bus
from collector.auth import Gate, Signer
from collector.events import (
    Envelope, LivenessBatch, Payload, PlanCurrent, ReconfigureCommand, ReplicaSummary,
)


log = logging.getLogger(__name__)
LIVENESS_HELD_ROWS = 1 << 20  # liveness rows the merge holds before applying them (``JobMerge.settle``)


@dataclass
class JobMerge:
    """The merge for one job: feed it the control events (plans) and the shards' ReplicaSummaries."""

    job: str
    config: DetectorConfig = field(default_factory=DetectorConfig)
    duplicates: int = 0
    malformed: int = 0  # summaries and liveness batches whose arrays the merge cannot use (logged, not applied)

    def __post_init__(self) -> None:
        self.detector = Detector(self.job, self.config)
        self._waiting: dict[tuple[int, int], dict[int, ReplicaSummary]] = {}
        self._judged: tuple[int, int] = (-1, -1)
        self._replicas: dict[int, set[int]] = {}  # epoch -> replicas of its plan
        self._heard: list[LivenessBatch] = []  # liveness not applied yet (``settle``)
        self._heard_rows = 0
        self._usable_shape: tuple[int, object] | None = None  # (ranks, layout) of the last usable summary
        self._usable_liveness: tuple[int, object] | None = None  # (rows, layout) of the last usable liveness batch
        self._due_cache: dict[int, tuple[tuple, set[int]]] = {}  # epoch -> (the declarations, replicas due)

    def on_event(self, event: Envelope) -> list[Payload]:
        p = event.payload
        if event.job != self.job:
            return []
        if isinstance(p, ReplicaSummary):
            key = (p.epoch, p.iteration)
            if key <= self._judged or p.replica in self._waiting.get(key, {}):
                self.duplicates += 1
                return []
            if (p.ranks, p.layout) != self._usable_shape:  # a uniform plan's replicas send one shape: checked once
                if (problem := summary_shape_problem(p)) is not None:
                    self.malformed += 1  # as a lost summary: the replica is judged missing, the merge goes on
                    log.warning("%s", json.dumps({"event": "summary_malformed", "job": self.job, "shard": p.shard,
                                                  "replica": p.replica, "iteration": p.iteration, "problem": problem,
                                                  "malformed": self.malformed}))
                    return []
                self._usable_shape = (p.ranks, p.layout)
            self._waiting.setdefault(key, {})[p.replica] = p
            return self._judge_ready(final=False)
        if isinstance(p, LivenessBatch):
            self._heard.append(p)
            self._heard_rows += p.rows
            return self.settle() if self._heard_rows >= LIVENESS_HELD_ROWS else []
        out = self.settle()
        if isinstance(p, (PlanCurrent, ReconfigureCommand)):
            self._replicas[p.plan.epoch] = set(range(len(p.plan.pipelines)))
        return out + self.detector.on_event(event) + self._judge_ready(final=False)

    def settle(self) -> list[Payload]:
        """Apply the liveness batches held so far, as one batch of arrays through the fail-stop
        watch (``Detector.on_liveness``): per batch its cost is a few numpy operations, so the merge
        holds the shards' batches until it judges an iteration, reads another kind of event, ends
        a poll (``MergeWorker.step``) or holds ``LIVENESS_HELD_ROWS``. When the dead set changes
        the fits are published again with it: a replica with a dead rank completes without it, as
        the single process judges an iteration without the dead."""
        if not self._heard:
            return []
        det = self.detector
        dead_before = set(det.dead)
        out: list[Payload] = []
        held, self._heard, self._heard_rows = self._heard, [], 0
        parts: list[LivenessBatch] = []
        for p in held:
            if p.declared:  # declarations apply in order: the rows read before them first
                out += self._ingest(parts)
                parts = []
                # every shard forwards its copy of a declaration (each partition holds one): once is enough
                out += [x for d in p.declared if d not in det.declarations for x in det.on_declared(d)]
            if (p.rows, p.layout) != self._usable_liveness:  # shards send one shape: checked once
                if not _liveness_usable(p):
                    self.malformed += 1
                    log.warning("%s", json.dumps({"event": "liveness_malformed", "job": self.job, "shard": p.shard,
                                                  "rows": p.rows, "malformed": self.malformed}))
                    continue
                self._usable_liveness = (p.rows, p.layout)
            parts.append(p)
        out += self._ingest(parts)
        if det.dead != dead_before:
            out.append(fits_event(det.model, *self._judged, det.plans, det.dead))
        return out + self._judge_ready(final=False)

    def _ingest(self, parts: list[LivenessBatch]) -> list[Payload]:
        if not parts:
            return []
        kind, rank, epoch, iteration, time_s, interval_s = unpack_all(parts, LIVENESS_ARRAYS).values()
        return self.detector.on_liveness(kind, rank.astype(np.int64), epoch.astype(np.int64),
                                         iteration.astype(np.int64), time_s, interval_s)

    def _due(self, epoch: int) -> set[int] | None:
        """The replicas whose summaries an iteration of ``epoch`` waits for: every replica of the
        plan that holds a traced rank. A replica its producer traces none of (``TracingDeclared``)
        sends no summary, and waiting for it held every iteration until the end of the log."""
        want = self._replicas.get(epoch)
        det = self.detector
        plan = det.plan(epoch)
        if want is None or plan is None or not det.declarations:
            return want
        cached = self._due_cache.get(epoch)
        if cached is not None and cached[0] is det.declarations:  # a declaration makes a new tuple
            return cached[1]
        untraced = det.untraced(epoch)
        due = {p.replica for p in plan.pipelines if any(d not in untraced for st in p.stages for d in st.devices)}
        self._due_cache[epoch] = (det.declarations, due)
        return due

    def flush(self) -> list[Payload]:
        """Judge every iteration still waiting (end of a recording)."""
        return self.settle() + self._judge_ready(final=True)

    def _judge_ready(self, final: bool) -> list[Payload]:
        out: list[Payload] = []
        while self._waiting:
            key = min(self._waiting)
            have = self._waiting[key]
            want = self._due(key[0])
            if not final and (want is None or len(have) < len(want) or not want <= have.keys()):
                return out
            out += self.settle()  # the liveness read before this iteration's last summary counts for it
            if key not in self._waiting:
                continue  # settling judged it
            del self._waiting[key]
            self._judged = key
            out += self.judge(*key, [have[r] for r in sorted(have)])
        return out

    def judge(self, epoch: int, iteration: int, parts: list[ReplicaSummary]) -> list[Payload]:
        """One iteration from its replicas' summaries, in the single process's order
        (``judge_iteration``): the new plan's resets, the cost model taught by the unsuspected TP
        groups' units, the ranks and links centred, the judgement; then the fits for the shards'
        next iteration."""
        view = replica_job_view(epoch, iteration, parts, self.detector.layer_lookup(epoch))
        return judge_iteration(self.detector, view.frame, SummaryScorer(view, self.detector))


class SummaryScorer:
    """The merge's scoring (``FrameScorer``), from the replicas' summaries: the shards predicted
    and centred within their replicas; the merge teaches the cost model, centres across the job,
    and after the judgement publishes the fits the shards predict the next iteration with."""

    def __init__(self, view: ReplicaJobView, detector: Detector) -> None:
        self.view, self.detector = view, detector
        self.tags = group_tags(view.frame)

    def score(self, suspects: set[int], stand_out: float) -> tuple[FrameScore, IterationFacts]:
        view, frame, det = self.view, self.view.frame, self.detector
        clean = fit_ranks(frame, suspects)
        tags = self.tags
        row = np.clip(np.searchsorted(frame.rank, view.u_rank), 0, max(frame.num_ranks - 1, 0))
        u_own = np.where(clean[row] & (frame.rank[row] == view.u_rank), view.u_own, np.nan)
        learn_units(det.model, frame.iteration, view.u_keys, view.u_class, view.u_tokens, view.u_s2, u_own,
                    u_group=tags[row] if len(row) else None)
        return view.score(clean), view.facts

    def forget(self) -> list[Payload]:
        """The suspects the next iteration starts with lose what they taught before the fits go out:
        the single process forgets them before it predicts that iteration, the shards predict it
        with these fits."""
        frame, det = self.view.frame, self.detector
        forget_suspects(det.model, self.tags, frame.rank, det.suspects(frame))
        return [fits_event(det.model, frame.epoch, frame.iteration, det.plans, det.dead)]


def _liveness_usable(p: LivenessBatch) -> bool:
    """Whether the batch's layout holds the six arrays of ``p.rows`` rows each (a shard of another
    build may not): applying part of a batch would misalign ranks and times. (A blob of another
    length than its layout's never decodes: collector/events.py ``PackedArrays``.)"""
    lengths = {name: n for name, _, n in p.layout}
    return all(lengths.get(n) == p.rows for n in LIVENESS_ARRAYS)


class MergeWorker:
    """The merge on the bus: reads the analytics topic (ReplicaSummaries) and the control topic
    (plans) from their beginning as its own group, keeps one JobMerge per job, and publishes what
    they raise. It keeps no state of its own: restarted, it replays both topics and rebuilds it, and
    its publication is at-least-once (a restart republishes what the replay raises again; the
    single-process path's exactly-once outbox is analytics/projections/detector_projection.py)."""

    def __init__(self, bus: Bus, group: str, config: DetectorConfig | None = None) -> None:
        from collector import topics
        from collector.stream import EventStream

        self.bus = bus
        self.config = config or DetectorConfig()
        self.merges: dict[str, JobMerge] = {}
        self.stream = EventStream(bus, group, [topics.ANALYTICS, topics.CONTROL])
        self.stream.seek_to_beginning()
        self.gate = Gate("analytics-merge")

    def step(self, max_records: int = 20_000, timeout_s: float = 0.5) -> int:
        last_s: dict[str, float] = {}  # per job, its newest event's time: what settling answers
        for d in self.stream.poll(max_records, timeout_s):
            e = d.event
            if not self.gate.admit(e, time_s=e.time_s):
                continue  # a forged plan.current or command must not reshape the judged job
            if (not isinstance(e.payload, (ReplicaSummary, LivenessBatch, PlanCurrent, ReconfigureCommand))
                    and e.job not in self.merges):
                continue
            merge = self.merges.get(e.job)
            if merge is None:
                merge = self.merges[e.job] = JobMerge(e.job, self.config)
            self._publish(e.job, merge.on_event(e), e.time_s)
            last_s[e.job] = e.time_s
        for job, t in last_s.items():  # the poll's liveness, judged before the next poll
            self._publish(job, self.merges[job].settle(), t)
        if rejected := self.gate.take():
            self.bus.publish(rejected)
        return self.stream.last_polled

    def close(self) -> None:
        self.stream.close()

    def _publish(self, job: str, out: list[Payload], time_s: float) -> None:
        if out:
            from collector.events import EventFactory

            f = Signer(EventFactory(job, "analytics-merge"), "analytics", self.gate.keyring)
            self.bus.publish([f.make(p, time_s=time_s) for p in out])
