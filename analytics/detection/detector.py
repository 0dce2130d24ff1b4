"""The workload-aware detector: telemetry in, incidents and health out.

It folds the event stream. Rank reports are grouped per (epoch, iteration) into a frame
(analytics/detection/frame.py) once the iteration is complete: every rank of the running plan reported it, or
its own stream moved past it, or it is dead (analytics/detection/arrival.py; judged on each rank's own stream,
never on the order in which streams arrive). Each frame is scored against the cost model
(analytics/detection/scoring.py) and read by the judges (analytics/detection/judges/), each owning one
statistic behind one signature: the rank CUSUM and the link CUSUM (analytics/detection/config.py
explains the statistic), the communication excess, the sweep of untraced ranks, the prediction and
the rank health. They report fail-slow incidents to the IncidentBook (analytics/detection/incidents.py),
which carries them through opened → confirmed → updated → resolved. Heartbeats and telemetry gaps
feed the fail-stop watch (analytics/detection/fail_stop.py) and the hidden-stop watch (analytics/detection/hidden_stop.py).

The order in which an iteration is judged (begin → suspects → score → judge → forget) is
``judge_iteration``: the single process runs it on a frame's chunks (``ChunkScorer``), the sharded
merge on its replicas' summaries (analytics/sharding/merge.py).

It returns payloads to publish; it never touches a bus or a database, so the same object runs in
the live consumer, in ``resihp detect`` over a trace, and in the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from analytics.detection.arrival import FrameAssembler
from analytics.detection.cost_model import CostModel
from analytics.detection.cost_publish import CostPublisher
from analytics.detection.facts import ChunkFacts, IterationFacts
from analytics.detection.judges.base import FrameView, JobContext
from analytics.detection.judges.comm_excess import CommExcess
from analytics.detection.judges.health import HealthJudge
from analytics.detection.judges.link_cusum import LinkCusum
from analytics.detection.judges.noise import JobNoise
from analytics.detection.judges.prediction import PredictionJudge
from analytics.detection.judges.rank_cusum import RankCusum
from analytics.detection.judges.sweep import SweepJudge
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from analytics.detection.fail_stop_progress import distinct
from analytics.detection.frame import IterationFrame, LayerLookup, build_frame
from analytics.detection.hidden_stop import HiddenStopWatch
from analytics.detection.incidents import IncidentBook
from analytics.detection.p2p_waits import NOTICE as P2P_NOTICE
from analytics.detection.p2p_waits import WAIT_SPREAD, P2PWaitInference
from analytics.detection.scoring import FrameScore, score_frame
from collector.events import (
    Envelope, HangReported, Heartbeat, Payload, PlanCurrent, ProbeResult, RankIteration, ReconfigureCommand, TelemetryNotice,
    TracingDeclared,
)
from collector.plan import Plan


@dataclass
class DetectorStats:
    frames: int = 0
    late_reports: int = 0
    inferred_frames: int = 0


# The layout of a pickled Detector (its state moves with the consumer's offsets, see
# analytics/projections/detector_projection.py). Bump it when a change to these classes makes an old pickle
# unreadable or wrong; a consumer then refuses the old state and names the way out (--rebuild).
STATE_VERSION = 8


@dataclass
class Detector:
    """Streaming detector for one job (``job`` names the job its events are about)."""

    job: str
    config: DetectorConfig = field(default_factory=DetectorConfig)

    def __post_init__(self) -> None:
        window = self.config.window_iterations
        self.model = CostModel(window)
        self.book = IncidentBook(self.job, self.config)
        self.fail_stop = FailStopWatch(self.config)
        self.hidden_stop = HiddenStopWatch()
        self.arrival = FrameAssembler(self.config)
        self.costs = CostPublisher(self.config)
        self.context = JobContext(self.job, self.config, self.model, self.book, self.fail_stop, self.arrival)
        self.noise = JobNoise(window)
        self.ranks = RankCusum()
        self.links = LinkCusum()
        self.comm = CommExcess(window)
        self.sweep = SweepJudge(self.comm.hidden)
        self.prediction = PredictionJudge(window)
        self.health = HealthJudge()
        self.p2p_waits = P2PWaitInference()
        self.stats = DetectorStats()
        self.epoch = -1
        self._layers: dict[int, LayerLookup] = {}
        self._sorted_expected: tuple[frozenset[int], np.ndarray] | None = None  # ``_sorted_ranks``
        self.last_frame: IterationFrame | None = None
        self.last_score: FrameScore | None = None

    def retune(self, config: DetectorConfig) -> None:
        """Go on under ``config``: a restarted analytics consumer restores this detector and applies
        the config it was started with (``--detector-config``), or a tuning would reach only jobs
        first seen after it. Thresholds are read from the config at each use, so they apply from
        the next event; the window sizes the state (histories, cost fits), so changing it needs
        the log replayed (``resihp analytics --rebuild``)."""
        if config == self.config:
            return
        if config.window_iterations != self.config.window_iterations:
            raise ValueError(f"job {self.job}: window_iterations {self.config.window_iterations} → "
                             f"{config.window_iterations} resizes the detector's state; replay the log with "
                             "`resihp analytics --rebuild` to apply it")
        old = self.config
        for part in (self, *vars(self).values()):  # every part holds the one config object it was built with
            if getattr(part, "config", None) is old:
                part.config = config

    # ---- what the sharded merge reads of the job ----------------------------------------------------

    @property
    def plans(self) -> dict[int, Plan]:
        """Every plan announced, by epoch."""
        return self.arrival.plans

    def plan(self, epoch: int) -> Plan | None:
        return self.arrival.plans.get(epoch)

    @property
    def declarations(self) -> tuple[TracingDeclared, ...]:
        """Every tracing declaration seen; a new one makes a new tuple (identity says it changed)."""
        return self.arrival.tracing

    def untraced(self, epoch: int) -> set[int]:
        """The ranks of ``epoch``'s plan that its tracing declaration leaves out."""
        return self.arrival.untraced(epoch)

    @property
    def dead(self) -> set[int]:
        """The ranks judged dead (fail-stop)."""
        return self.fail_stop.dead

    # ---- input ------------------------------------------------------------------------------------

    def on_event(self, event: Envelope) -> list[Payload]:
        """Fold one event; returns what to publish because of it."""
        p = event.payload
        if event.job != self.job:
            return []
        if isinstance(p, RankIteration):
            return self._on_report(p, event.time_s)
        if isinstance(p, Heartbeat):
            return self.on_heartbeat(p, event.time_s)
        if isinstance(p, TracingDeclared):
            return self.on_declared(p)
        if isinstance(p, HangReported):
            return self.book.fail_stop(self.fail_stop.hung(p.ranks, p.iteration, p.op, p.stuck_for_s))
        if isinstance(p, ProbeResult):
            if self.hidden_stop.answer(p.probe_id, p.rank):
                return []
            swept = self.sweep.answer(p, self.context)
            return swept if swept is not None else self.book.probe_result(p)
        if isinstance(p, (PlanCurrent, ReconfigureCommand)):
            self.arrival.add_plan(p.plan)
            self.fail_stop.plan_announced(p.plan.epoch, set(p.plan.roles),
                                          p.gpus_per_node if isinstance(p, PlanCurrent) else None)
            return self._flush_ready(True)
        return []

    def on_declared(self, p: TracingDeclared) -> list[Payload]:
        """A producer's tracing declaration: which ranks and steps report (and so may be missed)."""
        self.arrival.declare(p)
        return self.book.fail_stop(self.fail_stop.declare(p)) + self._flush_ready(True)

    def on_heartbeat(self, p: Heartbeat, time_s: float) -> list[Payload]:
        """A heartbeat: liveness, the hidden-stop judgement, and iterations it completes."""
        dead_before = len(self.fail_stop.dead)
        self.arrival.heard(p.epoch, p.rank)
        out = self.book.fail_stop(self.fail_stop.heartbeat(p, time_s))
        out += self.hidden_stop.judge_stall(time_s, self.context)
        check = len(self.fail_stop.dead) != dead_before or not self.arrival.oldest_has(p.rank)
        return out + self._flush_ready(check)

    def report_seen(self, rank: int, epoch: int, iteration: int, time_s: float) -> list[Payload]:
        """A rank report's liveness alone (the sharded merge: a shard holds the report itself)."""
        return self.book.fail_stop(self.fail_stop.telemetry(rank, epoch, iteration, time_s))

    def on_liveness(self, kind: np.ndarray, rank: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
                    time_s: np.ndarray, interval_s: np.ndarray) -> list[Payload]:
        """A shard's heartbeats (``kind`` 1) and report progress (0), in the order it read them (the
        sharded merge, analytics/sharding/merge.py): the fail-stop watch takes the batch as arrays
        (``FailStopWatch.ingest``), the hidden-stop watch is judged once at its newest time. What
        the array path leaves to the one-by-one rules (a dead rank's row, a clock jump) goes
        through ``on_heartbeat`` and ``report_seen`` row by row."""
        changes = self.fail_stop.ingest(kind, rank, epoch, iteration, time_s, interval_s)
        if changes is None:
            out: list[Payload] = []
            for k, r, e, i, t, dt in zip(kind.tolist(), rank.tolist(), epoch.tolist(), iteration.tolist(),
                                         time_s.tolist(), interval_s.tolist()):
                if k:
                    out += self.on_heartbeat(Heartbeat.model_construct(rank=r, epoch=e, iteration=i, interval_s=dt), t)
                else:
                    out += self.report_seen(r, e, i, t)
            return out
        hb = kind > 0
        for e in distinct(epoch[hb]):
            ranks = rank[hb & (epoch == e)]
            if self.arrival.tracing:
                for r in ranks.tolist():
                    self.arrival.heard(e, r)
            else:
                self.arrival.learn(e, ranks)
        out = self.book.fail_stop(changes)
        if hb.any():
            out += self.hidden_stop.judge_stall(float(time_s[hb].max()), self.context)
        return out + self._flush_ready(bool(changes) or bool(self.arrival.pending))

    def flush(self) -> list[Payload]:
        """Score every iteration still waiting (end of a trace)."""
        out: list[Payload] = []
        for key in self.arrival.all_keys():
            out += self._process(key)
        return out

    def _on_report(self, p: RankIteration, time_s: float) -> list[Payload]:
        top_before = self.fail_stop.top_iteration(p.epoch)
        dead_before = len(self.fail_stop.dead)
        out = self.book.fail_stop(self.fail_stop.telemetry(p.rank, p.epoch, p.iteration, time_s))
        if not self.arrival.add(p):
            self.stats.late_reports += 1
            return out
        check = (self.fail_stop.top_iteration(p.epoch) != top_before or len(self.fail_stop.dead) != dead_before
                 or not self.arrival.oldest_has(p.rank))
        return out + self._flush_ready(check)

    def _flush_ready(self, check_all: bool) -> list[Payload]:
        out: list[Payload] = []
        while True:
            keys = self.arrival.ready(self.fail_stop, check_all)
            if not keys:
                return out
            dead_before = len(self.fail_stop.dead)
            for key in keys:
                out += self._process(key)
            check_all = len(self.fail_stop.dead) != dead_before

    # ---- one iteration ----------------------------------------------------------------------------

    def _process(self, key: tuple[int, int]) -> list[Payload]:
        reports = self.arrival.take(key)
        return self.process_frame(build_frame(reports, self.layer_lookup(key[0])))

    def layer_lookup(self, epoch: int) -> LayerLookup | None:
        """The layer ranges of ``epoch``'s plan by device (None: the plan is not known)."""
        plan = self.arrival.plans.get(epoch)
        if plan is None:
            return None
        lookup = self._layers.get(epoch)
        if lookup is None:
            lookup = self._layers[epoch] = LayerLookup(plan)
        return lookup

    def process_frame(self, frame: IterationFrame) -> list[Payload]:
        """Score one iteration's frame from its chunks and return the events it causes. Undeclared
        p2p timers that the data show to hold waits are read as such (``P2PWaitInference``), and
        the first frame that shows it says so (``analytics.telemetry_notice``)."""
        frame, told = self.p2p_waits.read(frame)
        out: list[Payload] = []
        if told:
            out.append(TelemetryNotice(
                epoch=frame.epoch, iteration=frame.iteration, finding="fused_p2p", message=P2P_NOTICE,
                detail=f"the median link's slowest p2p message took ×{self.p2p_waits.spread:.0f} its fastest in "
                       f"iteration {frame.iteration}; a wire-only timer stays within ×{WAIT_SPREAD:g}: they are "
                       "read as holding waits (centred on the same stage pair, naming no link on the "
                       "iteration's excess)"))
        return out + judge_iteration(self, frame, ChunkScorer(frame, self))

    def stand_out(self) -> float:
        """The score at which a rank stands out before it is suspected: the alarm threshold h under
        the last iteration's σ (before any σ, the job's first frame, when a rank slow from the start
        teaches its class's first line: the smallest alarm, h at the σ floor)."""
        return self.context.thresholds(self.noise.last_sigma or self.config.sigma_floor)[1]

    def begin_frame(self, frame: IterationFrame) -> list[Payload]:
        """Before an iteration is scored: a new plan's resets, and the ranks it lacks."""
        out: list[Payload] = []
        if self.hidden_stop.progressed(self.fail_stop):
            out += self.book.hidden_cleared(frame.iteration, "the job completed an iteration again: no rank had stopped")
        if frame.epoch != self.epoch:
            out += self._new_epoch(frame)
        planned = self.arrival.expected(frame.epoch)
        if planned is not None and np.array_equal(frame.rank, self._sorted_ranks(planned)):
            return out  # every planned rank reported (frames hold their ranks sorted): none missing
        present = set(frame.rank.tolist())
        expected = planned if planned is not None else self.arrival.learned.get(frame.epoch, present)
        missing = expected - present - self.fail_stop.dead
        return out + self.book.fail_stop(self.fail_stop.missing(missing, frame.iteration))

    def _sorted_ranks(self, ranks: frozenset[int]) -> np.ndarray:
        """``ranks`` as a sorted array, kept while the plan's expected set is the same object: at
        100k ranks comparing the frame with it is 0.1 ms where the set difference takes 6 ms."""
        kept = self._sorted_expected
        if kept is None or kept[0] is not ranks:
            kept = self._sorted_expected = (ranks, np.sort(np.fromiter(ranks, np.int64, len(ranks))))
        return kept[1]

    def suspects(self, frame: IterationFrame) -> set[int]:
        """The ranks whose TP groups may not teach the cost model nor set the job's centre now."""
        return self.context.with_traced_peers(frame, self.book.suspect_ranks())

    def judge(self, frame: IterationFrame, score: FrameScore, facts: IterationFacts,
              suspects: set[int]) -> list[Payload]:
        """The job-level half of an iteration: σ, then each judge in turn, the incident book's own
        step, the prediction and health. It reads the frame's per-rank arrays only; what it needs of
        the chunks comes in ``facts``, so the sharded merge (analytics/sharding/merge.py) runs it on a frame
        without chunks."""
        self.stats.frames += 1
        self.stats.inferred_frames += int(score.inferred)
        job = self.context
        view = FrameView(frame, score, facts, self.noise.measure(frame, score, suspects, self.config),
                         job.hidden_ranks(frame.epoch))
        out: list[Payload] = []
        for judge in (self.ranks, self.links, self.comm, self.sweep):
            out += judge.judge(view, job)
        out += self.book.end_of_iteration(frame.iteration)  # probes due, incidents resolved: after every finding
        for report in (self.prediction, self.health):  # the iteration as judged
            out += report.judge(view, job)
        fitted = self.costs.after_frame(frame, score, suspects, self.model, self.arrival.plans.get(frame.epoch))
        if fitted is not None:
            out.append(fitted)
        self.last_frame, self.last_score = frame, score
        return out

    def _new_epoch(self, frame: IterationFrame) -> list[Payload]:
        """A new plan: the CUSUMs restart; fail-stops on ranks the plan no longer uses are resolved.
        The noise window (σ) is kept with the fits, so a new layout is not judged on one iteration's σ.
        The cost model keeps its fits only when classes are keyed by layer range (the plan is
        known): a stage whose layers and TP degree did not change is the same work as before, and
        a changed one is a new class, fitted afresh from this iteration across replicas. Keyed by
        stage index (no plan), a class may mean other work now, so everything is forgotten."""
        self.epoch = frame.epoch
        if self.arrival.plans.get(frame.epoch) is None:
            self.model.forget()
            self.noise.forget()  # with layer-range classes the noise of z is the same as before: kept
        for judge in (self.ranks, self.links, self.comm, self.sweep, self.prediction, self.health):
            judge.new_epoch(self.context)
        expected = self.arrival.expected(frame.epoch)
        present = set(frame.rank.tolist()) | (expected or set())
        self.fail_stop.new_epoch(present)
        return self.book.reconfigured(present, frame.iteration)


class FrameScorer(Protocol):
    """How an iteration is scored for ``judge_iteration``: from the frame's own chunks
    (``ChunkScorer``, the single process) or from its replicas' summaries (the sharded merge)."""

    def score(self, suspects: set[int], stand_out: float) -> tuple[FrameScore, IterationFacts]:
        """Teach the cost model the unsuspected ranks' work, predict, and score every rank and link."""

    def forget(self) -> list[Payload]:
        """After the judgement: what the next iteration's suspects taught leaves the fits."""


class ChunkScorer:
    """The single process's scoring, from the frame's chunks (``score_frame``)."""

    def __init__(self, frame: IterationFrame, detector: Detector) -> None:
        self.frame, self.detector = frame, detector

    def score(self, suspects: set[int], stand_out: float) -> tuple[FrameScore, IterationFacts]:
        det = self.detector
        score = score_frame(self.frame, det.model, suspects, det.config.chunk_quantile, stand_out)
        return score, ChunkFacts(self.frame, score, det.context.schedule(self.frame))

    def forget(self) -> list[Payload]:
        """Nothing now: ``score_frame`` forgets the suspects' rows before it predicts the next iteration."""
        return []


def judge_iteration(detector: Detector, frame: IterationFrame, scorer: FrameScorer) -> list[Payload]:
    """One iteration, in the one order both the single process and the sharded merge follow:
    begin (a new plan's resets, the ranks missing), the suspects, the score (which teaches the
    cost model the others' work), the judgement, and the suspects' rows forgotten."""
    out = detector.begin_frame(frame)
    suspects = detector.suspects(frame)
    score, facts = scorer.score(suspects, detector.stand_out())
    out += detector.judge(frame, score, facts, suspects)
    return out + scorer.forget()
