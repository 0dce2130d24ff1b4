"""The workload-aware detector: telemetry in, incidents and health out.

It folds the event stream. Rank reports are grouped per (epoch, iteration) into a frame
(analytics/frame.py) once the iteration is complete: every rank of the running plan reported it, or
its own stream moved past it, or it is dead (analytics/arrival.py; judged on each rank's own stream,
never on the order in which streams arrive). Each frame is scored against the cost model (analytics/scoring.py); a CUSUM
per rank and per link (analytics/detector_config.py explains the statistic) raises fail-slow
incidents, which the IncidentBook (analytics/incidents.py) carries through opened → confirmed →
updated → resolved. Heartbeats and telemetry gaps feed the fail-stop watch (analytics/fail_stop.py).

It returns payloads to publish; it never touches a bus or a database, so the same object runs in
the live consumer, in ``resihp detect`` over a trace, and in the benchmark.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, overload

import numpy as np

from analytics.cost_model import CostModel
from analytics.detector_config import DetectorConfig
from analytics.arrival import FrameAssembler
from analytics.cost_publish import CostPublisher
from analytics.fail_stop import FailStopWatch, distinct
from analytics.frame import IterationFrame, LayerLookup, build_frame
from analytics.hidden_stop import HiddenStopWatch
from analytics.incidents import IncidentBook, Suspect
from analytics.prediction import predicted_iteration_s, stage_times
from analytics.scoring import FrameScore, chunk_slowdown, fit_ranks, score_frame, tp_group_max
from analytics.untraced import HiddenExcess, UntracedSweep, stage_factors_for, traced_pipeline_s
from collector.events import (
    Envelope, Heartbeat, IterationPrediction, Payload, PlanCurrent, ProbeResult, RankHealth, RankHealthEntry,
    RankIteration, RankState, ReconfigureCommand, StageTime, TracingDeclared,
)
from collector.plan import id_ranges

_GROW = 1024
LINK_SUSTAIN = 3  # iterations a link whose timers hold waits must read slow before it counts
_MEDIAN_STEP_PER_SIGMA = 0.6745 * math.sqrt(2)  # median |z_t − z_{t−1}| for independent normal z of σ 1


def _state_index(rank: np.ndarray) -> np.ndarray | slice:
    """Where a frame's ranks sit in the detector's per-rank arrays (indexed by rank): a slice when
    they are one run of consecutive ranks, as a job's usually are (a frame holds its ranks sorted,
    each once), so that reading and writing 100k ranks' state is a view, not a gather and a scatter."""
    n = len(rank)
    if n and int(rank[-1]) - int(rank[0]) == n - 1 and bool((np.diff(rank) == 1).all()):
        return slice(int(rank[0]), int(rank[0]) + n)
    return rank


@dataclass
class _FrameRecord:
    iteration: int
    rank: np.ndarray
    own_s: np.ndarray
    pred_s: np.ndarray
    z: np.ndarray


def job_tokens(frame: IterationFrame) -> int:
    """Tokens the job trained in this iteration: each micro-batch once, from the forward chunks of
    the first stage's TP rank 0 (first model chunk) in every replica. Every other rank reruns the
    same micro-batches, so summing all ranks would count each one TP·PP·v times. Chunks whose
    count the source did not report (NaN) add nothing: 0 when none is known."""
    first = (frame.c_kind == 0) & (frame.c_vs == 0) & (frame.pp[frame.c_rank] == 0) & (frame.tp[frame.c_rank] == 0)
    return int(np.nansum(frame.c_tokens[first]))


def fast_side_sigma(pooled: np.ndarray, *, levelled: bool = False) -> float:
    """The noise σ of scores ``pooled`` (centred log-ratios), read from their fast side only: the
    deviations below the median, 1.4826·their median, or with ``levelled`` the larger of that and
    their 90th percentile over 1.6449 (both are σ for normal noise: the deviations are half-normal). 0 when nothing lies below.

    Why the fast side: slowdowns (unsuspected yet, any number of them) and preemption only add
    time, so the half below the median is what healthy noise looks like.

    Why the tail for levelled scores: without sequence lengths each micro-batch's prediction is
    levelled on the median over its replica's stages (analytics/scoring.py), which pulls the middle
    stages' scores to 0 and leaves the outer ones — those that can alarm — as spread as the raw
    per-stage noise. The median deviation then describes the middle ones: in the Megatron dialect
    it read σ 0.009 where a healthy stage under the simulator's 2 % per-stage jitter swung by
    +0.06 twice in a row and opened a ×1.06 incident. Scores centred on the whole job (sequence
    lengths known) keep the median: their tail is what it implies, and a larger σ there only
    delays the smallest slowdowns (×1.05)."""
    centre = float(np.median(pooled))
    below = centre - pooled[pooled < centre]
    if not len(below):
        return 0.0
    sigma = 1.4826 * float(np.median(below))
    return max(sigma, float(np.quantile(below, 0.9)) / 1.6449) if levelled else sigma


class IterationFacts(Protocol):
    """What judging an iteration reads of its chunks (``Detector.judge``). Read-only: the single
    process computes each from the frame when first read (``ChunkFacts``), the sharded merge
    carries them in from the replicas' summaries (analytics/replica_summary.py ``SummaryFacts``)."""

    @property
    def own_s(self) -> np.ndarray:
        """(R,) each rank's own compute, summed over its chunks."""

    @property
    def pred_s(self) -> np.ndarray:
        """(R,) each rank's predicted own compute, summed."""

    @property
    def explained_s(self) -> float:
        """The critical path of the observed own times, no communication (NaN: cannot lay out)."""

    @property
    def pipeline_s(self) -> float:
        """The critical path of the predicted times, with communication."""

    @property
    def tokens(self) -> int:
        """The tokens the job trained in the iteration (``job_tokens``)."""

    @property
    def stages(self) -> list[tuple[int, int, float, float]]:
        """Per stage (analytics/prediction.py ``stage_times``)."""

    @property
    def span_s(self) -> float:
        """When the last traced chunk ended (analytics/untraced.py ``traced_pipeline_s``; NaN: none)."""


class ChunkFacts:
    """IterationFacts from the frame's own chunks, each computed when first read (a detector
    without link judgement never lays out the observed times)."""

    def __init__(self, frame: IterationFrame, score: FrameScore, schedule: tuple[str | None, int | None]) -> None:
        self.frame, self.score, self.schedule = frame, score, schedule

    @cached_property
    def own_s(self) -> np.ndarray:
        return np.bincount(self.frame.c_rank, weights=self.frame.c_own, minlength=self.frame.num_ranks)

    @cached_property
    def pred_s(self) -> np.ndarray:
        return np.bincount(self.frame.c_rank, weights=np.nan_to_num(self.score.c_pred), minlength=self.frame.num_ranks)

    @cached_property
    def explained_s(self) -> float:
        return predicted_iteration_s(self.frame, self.frame.c_own, *self.schedule, include_comm=False)

    @cached_property
    def pipeline_s(self) -> float:
        return predicted_iteration_s(self.frame, self.score.c_pred, *self.schedule)

    @cached_property
    def tokens(self) -> int:
        return job_tokens(self.frame)

    @cached_property
    def stages(self) -> list[tuple[int, int, float, float]]:
        return stage_times(self.frame, self.score.c_pred)

    @cached_property
    def span_s(self) -> float:
        return traced_pipeline_s(self.frame)


@dataclass
class DetectorStats:
    frames: int = 0
    late_reports: int = 0
    inferred_frames: int = 0


# The layout of a pickled Detector (its state moves with the consumer's offsets, see
# analytics/detector_projection.py). Bump it when a change to these classes makes an old pickle
# unreadable or wrong; a consumer then refuses the old state and names the way out (--rebuild).
STATE_VERSION = 4


@dataclass
class Detector:
    """Streaming detector for one job (``job`` names the job its events are about)."""

    job: str
    config: DetectorConfig = field(default_factory=DetectorConfig)

    def __post_init__(self) -> None:
        self.model = CostModel(self.config.window_iterations)
        self.book = IncidentBook(self.job, self.config)
        self.fail_stop = FailStopWatch(self.config)
        self.hidden_stop = HiddenStopWatch()
        self.arrival = FrameAssembler(self.config)
        self.costs = CostPublisher(self.config)
        self.stats = DetectorStats()
        self.epoch = -1
        self._layers: dict[int, LayerLookup] = {}
        self._cusum = np.zeros(_GROW)
        self._z_last = np.full(_GROW, np.nan)  # each rank's z in its last judged iteration of this epoch
        self._z_noise = np.full(_GROW, np.nan)  # each rank's running median step (rank_noise_iterations)
        self._z_steps = np.zeros(_GROW)  # how many steps that median has seen
        self._zhist: deque[np.ndarray] = deque(maxlen=self.config.window_iterations)
        self._link_cusum: dict[tuple[int, int], float] = {}
        self._link_zhist: dict[int, deque[np.ndarray]] = {}  # per stage pair, its links' recent scores
        self._link_recent: dict[tuple[int, int], deque[float]] = {}  # per link whose timers hold waits
        self._comm_hist: deque[float] = deque(maxlen=4 * self.config.window_iterations)
        self._pipe_hist: deque[float] = deque(maxlen=4 * self.config.window_iterations)  # traced pipelines' span
        self._hidden = HiddenExcess(self.config.window_iterations)  # with hidden ranks: their excess's runs
        self._sweep = UntracedSweep()  # with hidden ranks and probes: their compute, probed now and then
        self._comm_cusum = 0.0
        self._comm_unjudged = False  # the open communication incident has no healthy reference in this layout
        self._history: deque[_FrameRecord] = deque(maxlen=8)
        self._outside_s: deque[float] = deque(maxlen=self.config.window_iterations)  # time outside the pipeline
        self._last_sigma: float | None = None  # the job's σ at the last judged iteration
        self._published_view: tuple[np.ndarray, dict[int, tuple[str, float]]] | None = None  # the last RankHealth
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
        if isinstance(p, ProbeResult):
            if self.hidden_stop.answer(p.probe_id, p.rank):
                return []
            if self._untraced_sweep().claims(p):
                return self._sweep_result()
            return self.book.probe_result(p)
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

    def _hidden_stop(self, time_s: float) -> list[Payload]:
        """A hung job whose watched ranks all heartbeat: a rank nobody traces stopped
        (analytics/hidden_stop.py). Judged on heartbeats, the only events a hung job sends."""
        watch, stops = self.hidden_stop, self.fail_stop
        silent = watch.silent(time_s, stops.interval_s())
        if silent:
            stops.dead.update(silent)
            return self.book.hidden_named(silent, f"ranks {list(silent)} did not answer a liveness probe that the "
                                                  f"other {len(watch.suspects) - len(silent)} suspects answered")
        ranks = watch.suspect(stops, time_s)
        if not ranks:
            return []
        iteration = watch.top + 1
        probe_id = f"liveness-{watch.epoch}-{iteration}" if self.config.probes else None
        if probe_id is not None:
            watch.ask(probe_id, time_s)
        reason = (f"the job completed nothing for {stops.stalled_now():.0f} s while every traced rank "
                  f"heartbeats: one of the {len(ranks)} ranks that are not traced (and send no heartbeats) stopped"
                  + ("; a liveness probe will tell which" if probe_id is not None else ""))
        return self.book.hidden_fail_stop(ranks, iteration, reason, probe_id)

    def on_heartbeat(self, p: Heartbeat, time_s: float) -> list[Payload]:
        dead_before = len(self.fail_stop.dead)
        self.arrival.heard(p.epoch, p.rank)
        out = self.book.fail_stop(self.fail_stop.heartbeat(p, time_s))
        out += self._hidden_stop(time_s)
        check = len(self.fail_stop.dead) != dead_before or not self.arrival.oldest_has(p.rank)
        return out + self._flush_ready(check)

    def report_seen(self, rank: int, epoch: int, iteration: int, time_s: float) -> list[Payload]:
        """A rank report's liveness alone (the sharded merge: a shard holds the report itself)."""
        return self.book.fail_stop(self.fail_stop.telemetry(rank, epoch, iteration, time_s))

    def on_liveness(self, kind: np.ndarray, rank: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
                    time_s: np.ndarray, interval_s: np.ndarray) -> list[Payload]:
        """A shard's heartbeats (``kind`` 1) and report progress (0), in the order it read them (the
        sharded merge, analytics/merge.py): the fail-stop watch takes the batch as arrays
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
            out += self._hidden_stop(float(time_s[hb].max()))
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
        frame = build_frame(reports, self._layer_lookup(key[0]))
        return self.process_frame(frame)

    def _layer_lookup(self, epoch: int) -> LayerLookup | None:
        plan = self.arrival.plans.get(epoch)
        if plan is None:
            return None
        lookup = self._layers.get(epoch)
        if lookup is None:
            lookup = self._layers[epoch] = LayerLookup(plan)
        return lookup

    def process_frame(self, frame: IterationFrame) -> list[Payload]:
        """Score one iteration's frame and return the events it causes."""
        out = self.begin_frame(frame)
        suspects = self.suspects(frame)
        # a rank past the alarm threshold under the last iteration's σ stands out: scored without it;
        # before any σ (the job's first frame, when a rank slow from the start teaches its class's
        # first line) at the smallest alarm, h at the σ floor
        last_sigma: float | None = getattr(self, "_last_sigma", None)
        stand_out = self._thresholds(last_sigma or self.config.sigma_floor)[1]
        score = score_frame(frame, self.model, suspects, self.config.chunk_quantile, stand_out)
        return out + self.judge(frame, score, ChunkFacts(frame, score, self._schedule(frame)), suspects)

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
        kept = getattr(self, "_sorted_expected", None)  # absent in a detector pickled before it existed
        if kept is None or kept[0] is not ranks:
            kept = self._sorted_expected = (ranks, np.sort(np.fromiter(ranks, np.int64, len(ranks))))
        return kept[1]

    def suspects(self, frame: IterationFrame) -> set[int]:
        """The ranks whose TP groups may not teach the cost model nor set the job's centre now."""
        return self._with_traced_peers(frame, self.book.suspect_ranks())

    def judge(self, frame: IterationFrame, score: FrameScore, facts: IterationFacts,
              suspects: set[int]) -> list[Payload]:
        """The job-level half of an iteration: σ, the CUSUMs, the incident book, the prediction,
        health. It reads the frame's per-rank arrays only; what it needs of the chunks comes in
        ``facts``, so the sharded merge (analytics/merge.py) runs it on a frame without chunks."""
        out: list[Payload] = []
        self.stats.frames += 1
        self.stats.inferred_frames += int(score.inferred)
        self._history.append(_FrameRecord(frame.iteration, frame.rank, facts.own_s, facts.pred_s, score.z))
        sigma = self._sigma(frame, score, suspects)
        out += self._rank_cusum(frame, score, sigma)
        if self.config.links and len(score.link_z):
            out += self._link_cusum_step(frame, score, sigma)
        hidden = self._hidden_ranks(frame.epoch)
        if self.config.links:
            out += self._comm_excess(frame, score, facts, hidden)
        out += self._sweep_step(frame, hidden)
        out += self.book.end_of_iteration(frame.iteration)
        out.append(self._prediction(frame, facts))
        health = self._health(frame)
        if health is not None:
            out.append(health)
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
            self._zhist.clear()  # with layer-range classes the noise of z is the same as before: kept
        self._cusum[:] = 0.0
        self._z_last[:] = np.nan  # z moves with the layout: no step is measured across a reshape
        self._link_cusum.clear()
        self._link_recent.clear()
        self._comm_hist.clear()
        self._pipe_hist.clear()
        self._hidden_excess().clear()
        self._untraced_sweep().drop()
        self._comm_cusum = 0.0
        # A communication incident open across a new plan can no longer be judged from the excess
        # over this layout's history (it would be learned with the fault in it, and resolve it).
        # It stays open, as a fail-slow on a rank left out does: nothing measured the link healthy.
        self._comm_unjudged = ("comm",) in self.book.open or ("untraced",) in self.book.open
        expected = self.arrival.expected(frame.epoch)
        present = set(frame.rank.tolist()) | (expected or set())
        self.fail_stop.new_epoch(present)
        return self.book.reconfigured(present, frame.iteration)

    def _sigma(self, frame: IterationFrame, score: FrameScore, suspects: set[int]) -> float:
        # One value per clean TP group, its slowest member: suspects' groups are out (their peers wait
        # for the suspect, fit_ranks), and members that waited for a peer read fast, which is not
        # noise (tp_group_max); on the paced torch trainer a peer of a ×3 rank scores ×0.05, which
        # alone made σ ≈ 1.6 and resolved the slow rank's incident while it was still slow.
        self._zhist.append(tp_group_max(frame, score.z, fit_ranks(frame, suspects)))
        pooled = np.concatenate(list(self._zhist))
        sigma = max(fast_side_sigma(pooled, levelled=score.inferred), self.config.sigma_floor) if len(pooled) else \
            self.config.sigma_floor
        self._last_sigma = sigma
        return sigma

    @overload
    def _thresholds(self, sigma: float) -> tuple[float, float, float]: ...
    @overload
    def _thresholds(self, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def _thresholds(self, sigma: float | np.ndarray) -> tuple[float | np.ndarray, float | np.ndarray,
                                                             float | np.ndarray]:
        """(k, h, cap) for a σ, or element-wise for an array of them."""
        c = self.config
        k = np.maximum(c.k_sigma * sigma, c.log_min_slowdown)
        h = np.maximum(c.h_sigma * sigma, c.log_min_alarm)
        return k, h, c.step_cap * h

    def _rank_sigma(self, frame: IterationFrame, score: FrameScore, sigma: float) -> np.ndarray:
        """Per row of the frame, the σ its CUSUM is judged with: the job's ``sigma``, or the rank's
        own noise when that is larger.

        The rank's own noise is the running median of |z_t − z_{t−1}| (steps, not deviations: a
        slowdown is one large step, not a lasting spread), tracked by a sign rule in log space —
        up by 2/``span`` when a step exceeds it, down when not (by more over its first steps) — so
        rare spikes (a preempted chunk on a shared CPU) count as one vote, not by their size. For
        independent normal z the median step is 0.954 σ. It starts at the job's σ and counts only
        after ``span``/2 steps: an estimate from a handful of noisy iterations (the torch trainer's
        first ones) is itself noisy, and taking the larger of two σs would only ever raise the bar.

        Why per rank: σ pooled over the job describes the typical rank. A TP group that alone runs
        its layer range is predicted from its own recent iterations and is ~2.5× noisier; judged
        with the job's σ it raised ×1.04 incidents that resolved within a second. Larger only: a
        quiet rank keeps the job's thresholds."""
        span = self.config.rank_noise_iterations
        if span <= 0:
            return np.full(len(frame.rank), sigma)
        r, z = _state_index(frame.rank), score.z
        med = self._z_noise[r]
        med = np.where(np.isfinite(med), med, _MEDIAN_STEP_PER_SIGMA * sigma)  # a new rank starts at the job's
        step = np.abs(z - self._z_last[r])
        ok = np.isfinite(step)
        vote = np.where(step > med, 1.0, -1.0)
        seen = self._z_steps[r]
        rate = 2.0 / np.minimum(seen + 4.0, span)  # larger moves while young
        self._z_noise[r] = np.where(ok, med * np.exp(vote * rate), self._z_noise[r])
        self._z_steps[r] = seen + ok
        self._z_last[r] = np.where(np.isfinite(z), z, self._z_last[r])
        own = np.where(self._z_steps[r] >= span / 2, self._z_noise[r] / _MEDIAN_STEP_PER_SIGMA, sigma)
        return np.maximum(sigma, np.nan_to_num(own, nan=sigma))

    def _rank_cusum(self, frame: IterationFrame, score: FrameScore, sigma: float) -> list[Payload]:
        k = self._thresholds(sigma)[0]  # the job's drift allowance: TP-peer merging, open incidents
        top = int(frame.rank.max()) + 1
        if top > len(self._cusum):
            grow = top - len(self._cusum) + _GROW
            self._cusum = np.concatenate([self._cusum, np.zeros(grow)])
            self._z_last = np.concatenate([self._z_last, np.full(grow, np.nan)])
            self._z_noise = np.concatenate([self._z_noise, np.full(grow, np.nan)])
            self._z_steps = np.concatenate([self._z_steps, np.zeros(grow)])
        sig_r = self._rank_sigma(frame, score, sigma)
        k_r, h_r, cap_r = self._thresholds(sig_r)
        judged = np.isfinite(score.z)  # a rank without predictions keeps its CUSUM as it was
        at = _state_index(frame.rank)
        prev = self._cusum[at]
        s = np.where(judged, np.maximum(0.0, prev + np.minimum(np.nan_to_num(score.z) - k_r, cap_r)), prev)
        self._cusum[at] = s
        out: list[Payload] = []
        # Not alarmed on: a suspect (its incident is open) and its TP peers in this layout — in
        # lock-step their own times are entangled with the suspect's (identical, without TP waits).
        clean = fit_ranks(frame, self._with_traced_peers(frame, self.book.open_compute_ranks()))
        alarmed = [int(i) for i in np.flatnonzero(s > h_r)
                   if clean[i] and int(frame.rank[i]) not in self.fail_stop.dead]
        self._cusum[frame.rank[s > h_r]] = 0.0
        for members in self._merge_tp_peers(frame, score, alarmed, k):
            i = max(members, key=lambda j: score.z[j])
            out += self.book.open_fail_slow(
                self._compute_suspect(frame, score, members, float(sig_r[i]), float(k_r[i]), float(h_r[i])),
                frame.iteration)
        for key in self.book.open_rank_keys():
            watched = tuple(sorted(self._with_traced_peers(frame, set(key[1]))))  # an untraced suspect: its peer
            idx = np.flatnonzero(np.isin(frame.rank, watched) & judged)
            if len(idx):  # no judged member this iteration: no evidence either way (not a healthy one)
                z_now = float(score.z[idx].max())
                # while the 3-iteration window still reaches back to the opening, size it as the
                # opening did (its slow iterations only), or the probe's naming carries a pre-onset one
                young = frame.iteration - self.book.open[key].opened_iteration < 3
                slowest = int(idx[np.argmax(score.z[idx])])
                out += self.book.observe(key, z_now, k, frame.iteration, chunk_slowdown(
                    frame, score.c_pred, slowest, self._factor(watched, z_now, k if young else None)),
                    sample=chunk_slowdown(frame, score.c_pred, slowest, math.exp(z_now)))
        return out

    def _merge_tp_peers(self, frame: IterationFrame, score: FrameScore, alarmed: list[int], k: float) -> list[list[int]]:
        """Alarmed ranks grouped per TP group. TP ranks run in lock-step, and a source that does not
        report TP waits gives them identical telemetry: then the group is one suspect (a probe, if
        enabled, tells which member), not one incident per member."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i in alarmed:
            groups.setdefault((int(frame.dp[i]), int(frame.pp[i])), []).append(int(i))
        out = []
        for members in groups.values():
            zs = score.z[members]
            if len(members) > 1 and float(zs.max() - zs.min()) < k:
                out.append(members)
            else:
                out.extend([i] for i in members)
        return out

    def _factor(self, ranks: tuple[int, ...], z_now: float, k: float | None = None) -> float:
        """exp(median z) over the last 3 iterations of these ranks (the slowest rank per iteration);
        with ``k`` (an opening), over those of them that read slow (z ≥ k) when any did.

        Why at an opening: the CUSUM alarms on the second slow iteration, so one of the three is
        often from before the onset, and the median of {healthy, slow, slow} is the lower slow one
        (a ×2 GPU first reported ×1.89 against its ×1.94 chunks; the first report is what a planner
        acting at once reads)."""
        zs = []
        for rec in list(self._history)[-3:]:
            idx = np.flatnonzero(np.isin(rec.rank, ranks) & np.isfinite(rec.z))
            if len(idx):
                zs.append(float(rec.z[idx].max()))
        if k is not None and any(z >= k for z in zs):
            zs = [z for z in zs if z >= k]
        return float(np.exp(np.median(zs))) if zs else float(np.exp(z_now))

    def _untraced_tp_peers(self, frame: IterationFrame, rank: int) -> list[int]:
        """The members of ``rank``'s TP group under the running plan that the producer declared
        untraced (one traced rank per TP group, as Megatron-style tracing records). In lock-step
        their slowness shows in the traced member's chunks, so none of them can be cleared. A
        traced peer whose report is merely late (a lagging Kafka partition) is not one of them."""
        untraced = self.arrival.untraced(frame.epoch)
        if not untraced:
            return []
        return [d for d in self._tp_group_of(frame.epoch, rank) if d in untraced and d not in self.fail_stop.dead]

    def _tp_group_of(self, epoch: int, rank: int) -> tuple[int, ...]:
        """The devices of ``rank``'s TP group under the plan of ``epoch`` (empty when unknown)."""
        plan = self.arrival.plans.get(epoch)
        role = plan.roles.get(rank) if plan is not None else None
        if plan is None or role is None:
            return ()
        return tuple(int(d) for d in plan.pipelines[role.replica].stages[role.stage].devices)

    def _with_traced_peers(self, frame: IterationFrame, ranks: set[int]) -> set[int]:
        """``ranks`` plus the reporting members of the TP group of each one that sent no report:
        a suspect nobody traces taints its traced peer's chunks, which wait for it in lock-step."""
        if not ranks:
            return set()  # the common case, every frame: no set of the job's ranks is built
        wanted = np.fromiter(ranks, np.int64, len(ranks))
        out = set(ranks)
        for r in wanted[~np.isin(wanted, frame.rank)].tolist():
            group = np.array(self._tp_group_of(frame.epoch, r), dtype=np.int64)
            out.update(group[np.isin(group, frame.rank)].tolist())
        return out

    def _compute_suspect(self, frame: IterationFrame, score: FrameScore, members: list[int], sigma: float,
                         k: float, h: float) -> Suspect:
        i = max(members, key=lambda j: score.z[j])
        ranks = tuple(sorted(int(frame.rank[j]) for j in members))
        group = np.flatnonzero((frame.dp == frame.dp[i]) & (frame.pp == frame.pp[i]))
        tp_group = tuple(int(r) for r in frame.rank[group])
        untraced = self._untraced_tp_peers(frame, int(frame.rank[i]))
        if untraced:  # a member nobody traces may be the slow one: the group is the suspect
            ranks = tuple(sorted(set(ranks) | set(untraced)))
            tp_group = tuple(sorted(set(tp_group) | set(untraced)))
        hist = [(r.iteration, float(r.own_s[j]), float(r.pred_s[j]))
                for r in self._history for j in np.flatnonzero(r.rank == frame.rank[i])]
        factor = chunk_slowdown(frame, score.c_pred, i, self._factor(ranks, score.z[i], k))
        kinds = {name: float(np.exp(v)) for name, v in zip("FBW", score.z_by_kind[i]) if np.isfinite(v)}
        worst = max(kinds, key=kinds.__getitem__) if kinds else "F"
        note = f"own compute per chunk kind ×{', '.join(f'{n}:{v:.2f}' for n, v in kinds.items())}"
        if worst == "B" and kinds.get("F", 1.0) < 1.0 + 0.5 * (kinds["B"] - 1.0):
            note += "; backward-pass straggler (hidden in wall time by collective synchronisation)"
        if untraced:
            note += (f"; TP ranks {list(untraced)} are not traced and run in lock-step with the traced one: the "
                     "group is the suspect" + ("; a probe will tell which member" if self.config.probes else ""))
        elif len(ranks) > 1:
            note += (f"; TP ranks {list(ranks)} report identical timings (lock-step, no TP waits): the group is "
                     "the suspect" + ("; a probe will tell which member" if self.config.probes else ""))
        if score.inferred:
            note += "; seq_lens not reported: predictions inferred from the same micro-batch on other stages"
        conf = float(min(0.99, 1.0 - np.exp(-max(score.z[i] - k, 0.0) / max(sigma, 1e-6) / 2))) / len(ranks)
        return Suspect(
            key=("ranks", ranks), target="compute", rank=ranks[0] if len(ranks) == 1 else None, link=None,
            node=int(frame.node[i]) if frame.node[i] >= 0 else None, replica=int(frame.dp[i]),
            stage=int(frame.pp[i]), tp_group=tp_group, factor=factor,
            confidence=conf, iterations=[h_[0] for h_ in hist], observed_s=[h_[1] for h_ in hist],
            predicted_s=[h_[2] for h_ in hist],
            rank_factors={int(frame.rank[j]): round(float(np.exp(score.z[j])), 4) for j in group
                          if np.isfinite(score.z[j])},
            statistic=f"CUSUM on log(own compute / predicted), centred on the job median; k={k:.4f} h={h:.4f} "
                      f"sigma={sigma:.4f}",
            note=note, ranks=ranks,
        )

    def _link_sigma(self, score: FrameScore) -> np.ndarray:
        """Per link, its noise: from the window of recent iterations of the links of its stage pair
        (fast side only, as for ranks), never less than ``sigma_floor``.

        Why a window: one iteration's spread of a few links is itself noise, and near zero it made
        any wobble cross the threshold (a ×0.98 link opened, confidence 0). Why per stage pair: a
        timer that holds the wait for the peer is as noisy as that wait, and the links out of the
        first stage wait longest; pooled with quiet links their σ was too small. A slowdown only
        adds time, so the half below the median is what healthy noise looks like."""
        lz, cls = score.link_z, score.link_class
        out = np.full(len(lz), self.config.sigma_floor)
        for c in np.unique(cls).tolist():
            sel = cls == c
            judged = lz[sel & np.isfinite(lz)]
            hist = self._link_zhist.setdefault(c, deque(maxlen=self.config.window_iterations))
            if len(judged):
                hist.append(judged)
            if not hist:
                continue
            out[sel] = max(fast_side_sigma(np.concatenate(list(hist))), self.config.sigma_floor)
        return out

    def _sustained_link_z(self, key: tuple[int, int], z: float) -> float:
        """For a link whose timers hold waits: the smallest of its last ``LINK_SUSTAIN`` scores.

        Why: such a timer reads the wire plus however long the peer kept it waiting, and whether the
        peer was late flips from one iteration to the next with the stages' jitter (a stall, a
        slower mix downstream), so one link reads ×10-×40 for a single iteration now and then in a
        healthy job. A slower wire slows every message of every iteration: it raises the minimum of
        a few iterations, a late peer does not."""
        recent = self._link_recent.setdefault(key, deque(maxlen=LINK_SUSTAIN))
        recent.append(z)
        return min(recent) if len(recent) == LINK_SUSTAIN else min(min(recent), 0.0)

    def _tp_group_pair(self, frame: IterationFrame, a: int, b: int) -> frozenset[tuple[int, ...]]:
        """The two TP groups a link joins, whichever way it runs and whichever TP ranks report it:
        in lock-step every TP rank of a stage sends to its peer of the next, so one slow transfer
        between two stages reads on each TP rank's link, and in both directions of a fused timer."""
        return frozenset((self._tp_group_of(frame.epoch, a) or (a,), self._tp_group_of(frame.epoch, b) or (b,)))

    def _links_explained_by_compute(self, frame: IterationFrame, score: FrameScore, k: float) -> set[int]:
        """Replicas whose links cannot be judged this iteration: one of their ranks computes slower
        than predicted (z above the drift allowance, alarmed or not yet), has an open compute
        incident, or is dead. In a pipeline every send waits, directly or through the stages after
        it, on the compute of the ranks downstream, so their slowness lengthens the timers of the
        links upstream; only a pipeline whose compute is on time can blame a wire."""
        busy = (np.nan_to_num(score.z, nan=0.0) >= k)
        suspects = self.book.open_compute_ranks() | set(self.fail_stop.dead)
        if suspects:
            busy |= np.isin(frame.rank, np.fromiter(suspects, np.int64, len(suspects)))
        return set(frame.dp[busy].tolist())

    def _link_cusum_step(self, frame: IterationFrame, score: FrameScore, sigma_rank: float) -> list[Payload]:
        lz = score.link_z
        sigmas = self._link_sigma(score)
        ks, hs, caps = self._thresholds(sigmas)
        out: list[Payload] = []
        open_links = self.book.open_links()
        coord = {int(r): i for i, r in enumerate(frame.rank)}
        explained = self._links_explained_by_compute(frame, score, float(self._thresholds(sigma_rank)[0]))
        named = {self._tp_group_pair(frame, *inc.suspect.link) for inc in self.book.open.values()
                 if inc.suspect.target == "link" and inc.suspect.link is not None}
        for a, b, z, waits, sigma, k, h, cap in zip(
                score.link_src.tolist(), score.link_dst.tolist(), lz.tolist(), score.link_waits.tolist(),
                sigmas.tolist(), ks.tolist(), hs.tolist(), caps.tolist()):
            if not math.isfinite(z):
                continue  # not judged this iteration (a fused timer without peers to compare with)
            key = (a, b)
            if waits:
                z = self._sustained_link_z(key, z)
            i = coord.get(a)
            if ("link", a, b) in open_links:
                out += self.book.observe(("link", a, b), z, k, frame.iteration, float(np.exp(z)))
                continue
            if i is not None and int(frame.dp[i]) in explained:
                continue  # a slow rank in this pipeline explains slow transfers better than the wire does
            s = max(0.0, self._link_cusum.get(key, 0.0) + min(z - k, cap))
            if s <= h:
                self._link_cusum[key] = s
                continue
            self._link_cusum[key] = 0.0
            pair = self._tp_group_pair(frame, a, b)
            if pair in named:
                continue  # the same two TP groups' link is already named (another TP rank, or the other way)
            named.add(pair)
            placed = self.book.place_communication((a, b), float(np.exp(z)), frame.iteration)
            if placed:
                out += placed
                continue
            out += self.book.open_fail_slow(Suspect(
                key=("link", a, b), target="link", rank=None, link=(a, b), node=None,
                replica=int(frame.dp[i]) if i is not None else None, stage=int(frame.pp[i]) if i is not None else None,
                tp_group=None, factor=float(np.exp(z)),
                confidence=float(min(0.99, 1.0 - np.exp(-max(z - k, 0.0) / max(sigma, 1e-6) / 2))),
                iterations=[frame.iteration], observed_s=[], predicted_s=[], rank_factors={},
                statistic=f"CUSUM on log(lower-quartile p2p send time), centred on the same stage pair's links; "
                          f"k={k:.4f} h={h:.4f} sigma={sigma:.4f} (links' own window)",
                note=f"link {a}->{b} (stage {int(frame.pp[i]) if i is not None else '?'} to the next)",
            ), frame.iteration)
        return out

    def _comm_excess(self, frame: IterationFrame, score: FrameScore, facts: IterationFacts,
                     untraced: list[int]) -> list[Payload]:
        """Wall time that the observed compute cannot explain is communication — or, in a job that
        traces only some ranks, a fault outside what is traced (analytics/untraced.py). The
        schedule model replays the observed own chunk times (no transfers, no all-reduce); the
        log of observed over that is steady while links are healthy. A CUSUM on its deviation from
        the recent healthy median flags the excess; probes say where.

        Which of the two: with untraced ranks in the plan, the traced pipelines' own span (their
        last chunk's end) is followed the same way. A late iteration whose traced pipelines are on
        time lost its time while they waited in the DP all-reduce: for a replica nobody traces."""
        sched = self._schedule(frame)
        explained = facts.explained_s
        if not np.isfinite(explained) or explained <= 0:
            return []
        wall = float(frame.wall_s.max())
        r = float(np.log(wall / explained))
        hidden = self._hidden_excess() if untraced else None
        raw, r_size = r, r
        if hidden is not None:  # the untraced replicas' own mix moves the job's time: only a lasting
            r, r_size = hidden.add(r, frame.iteration, self.config.sigma_floor)  # excess counts, sized on the last few
        span = facts.span_s if untraced else float("nan")
        r_pipe = float(np.log(span / explained)) if np.isfinite(span) and span > 0 else float("nan")
        hist = np.array(self._comm_hist)
        if len(hist) < 4:
            self._learn_excess(r, r_pipe, raw, hidden)
            return []
        centre = float(np.median(hist))
        sig = max(1.4826 * float(np.median(np.abs(hist - centre))), self.config.sigma_floor)
        k, h, cap = self._thresholds(sig)
        z = r - centre
        for key in (("comm",), ("untraced",)):
            if key in self.book.open:
                if self._comm_unjudged:
                    return []  # this layout's history was learned with the fault in it: no healthy reference
                size = (self._untraced_size(frame, sched, explained, wall, r_size - centre,
                                            self.book.open[key].suspect.rank)[0] if key == ("untraced",)
                        else float(np.exp(z)))
                return self.book.observe(key, z, k, frame.iteration, size, sample=size)
        if self.book.open_compute_ranks():
            return []  # a slow rank explains a slow iteration; wait until it is handled
        self._comm_cusum = max(0.0, self._comm_cusum + min(z - k, cap))
        run = None
        if self._comm_cusum <= h and hidden is not None:
            run = hidden.unlikely_run(h, self.config.untraced_run_rate, self.config.sigma_floor)
            if run is not None:
                r_size = hidden.size_of(run)
        if self._comm_cusum <= h and run is None:
            self._learn_excess(r, r_pipe, raw, hidden)
            return []
        self._comm_cusum = 0.0
        pipe_hist = np.array([v for v in self._pipe_hist if np.isfinite(v)])
        if untraced and np.isfinite(r_pipe) and len(pipe_hist) >= 4 and r_pipe - float(np.median(pipe_hist)) < k:
            return self._open_untraced(frame, sched, explained, wall, r_size - centre, k, h, sig, untraced, run)
        # Only a wire-only timer may name the link at the opening: one that holds the wait for the
        # peer reads ×10–×10⁵ on healthy links in single iterations, so its largest score names a
        # link at random, and the opening's size (the iteration's excess) is no link's size. The
        # probe names and sizes it; a timer that holds waits and stays slow opens its own incident.
        judged = np.isfinite(score.link_z) & ~score.link_waits
        best = int(np.flatnonzero(judged)[np.argmax(score.link_z[judged])]) if judged.any() else None
        link = (int(score.link_src[best]), int(score.link_dst[best])) if best is not None else None
        if link is not None and score.link_z[best] < k:
            link = None
        candidates = tuple(int(r_) for r_ in frame.rank[: 4096])
        return self.book.open_fail_slow(Suspect(
            key=("comm",), target="link", rank=None, link=link, node=None, replica=None, stage=None, tp_group=None,
            factor=float(np.exp(z)), confidence=0.5, iterations=[frame.iteration],
            observed_s=[wall], predicted_s=[float(explained * np.exp(centre))], rank_factors={},
            statistic=f"CUSUM on log(wall / iteration explained by observed compute); k={k:.4f} h={h:.4f}",
            note="iteration slower than its compute explains: communication" + (
                "; probing every rank's links" if self.config.probes else ""),
            ranks=candidates), frame.iteration)

    def _learn_excess(self, r: float, r_pipe: float, raw: float, hidden: HiddenExcess | None) -> None:
        """An iteration whose excess raised no alarm: the healthy reference of every excess rule."""
        self._comm_hist.append(r)
        self._pipe_hist.append(r_pipe)
        if hidden is not None:
            hidden.learn(raw)

    def _hidden_excess(self) -> HiddenExcess:
        """The hidden replicas' excess; a detector pickled before it existed starts it afresh."""
        hidden = getattr(self, "_hidden", None)
        if hidden is None:
            hidden = self._hidden = HiddenExcess(self.config.window_iterations)
        return hidden

    def _untraced_sweep(self) -> UntracedSweep:
        """The untraced ranks' sweep; a detector pickled before it existed starts it afresh."""
        sweep = getattr(self, "_sweep", None)
        if sweep is None:
            sweep = self._sweep = UntracedSweep()
        return sweep

    def _sweep_step(self, frame: IterationFrame, hidden: list[int]) -> list[Payload]:
        """A traced iteration of a job with ranks nobody traces (``hidden``): probe their compute if
        a sweep is due (analytics/untraced.py ``UntracedSweep``), or judge one whose last answers
        can no longer come (their ranks died)."""
        if not self.config.probes:
            return []
        sweep = self._untraced_sweep()
        if sweep.probe_id is not None:
            return self._sweep_result()
        # A late iteration brings the sweep forward: a GPU nobody traces that makes the job later than
        # it runs healthy is named (and sized by its probe) at once, not after the runs that would
        # prove it from the lateness alone. Not while an open incident explains the lateness (a slow
        # rank) or probes for it anyway (the lateness's own).
        rate = self.config.untraced_suspicion_rate
        accounted = self.book.open_compute_ranks() or ("untraced",) in self.book.open or ("comm",) in self.book.open
        least = math.log(self.config.min_alarm_factor)
        suspicious = rate > 0 and not accounted and self._hidden_excess().chance(frame.iteration, least) <= rate
        request = sweep.step(self.job, frame.epoch, frame.iteration, hidden[:4096], self.config.untraced_sweep_steps,
                             suspicious)
        return [request] if request is not None else []

    def _sweep_result(self) -> list[Payload]:
        """A sweep's answers, once complete: the slowest rank, if it stands out as a probe's naming
        must (``IncidentBook.probe_bar``), opens a compute incident on itself, sized by the probe.

        Why the probe's size: the job's lateness, the only other measure of an untraced rank, is
        within the untraced replicas' swing for the slowdowns only a sweep finds, and sized through
        the schedule it is a few per cent off even far beyond that swing. The probe times compute
        alone, which is what the incident says it measured (``Location.measure``): the planner
        takes it as the GPU's compute slowdown as it stands. Telemetry never sees the rank, so the
        incident is health-probed until the rank measures healthy (``IncidentBook.open_unseen``)."""
        sweep = self._untraced_sweep()
        ratios = sweep.done(self.fail_stop.dead)
        if not ratios:
            return []
        worst = max(ratios, key=lambda r: ratios[r])
        ratio, bar = ratios[worst], self.book.probe_bar(ratios)
        epoch = sweep.epoch
        plan = self.arrival.plans.get(epoch)
        role = plan.roles.get(worst) if plan is not None else None
        if ratio < bar or self.book.names(worst) or role is None:
            return []
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        return self.book.open_unseen(Suspect(
            key=("ranks", (worst,)), target="compute", rank=worst, link=None, node=None, replica=role.replica,
            stage=role.stage, tp_group=self._tp_group_of(epoch, worst) or None, factor=ratio, confidence=0.9,
            iterations=[sweep.iteration], observed_s=[], predicted_s=[], rank_factors={worst: round(ratio, 4)},
            statistic=f"sweep probe of the {len(ratios)} ranks nobody traces: rank {worst} took ×{ratio:.2f} of "
                      f"the healthy reference, above the bar ×{bar:.3f} ({table})",
            note=f"rank {worst} is not traced; " + (
                f"iteration {sweep.iteration} was later than the job runs healthy, and a probe of the untraced ranks "
                f"asked then measured it" if sweep.late else
                "its slowdown is within what the job's lateness can show, and the periodic probe of the untraced "
                "ranks measured it"),
            ranks=(worst,), measure="compute"), sweep.iteration)

    def _hidden_ranks(self, epoch: int) -> list[int]:
        """The live ranks of TP groups none of whose members is traced (sampled tracing leaves whole
        replicas out). An untraced member of a traced group is not hidden: in lock-step its
        slowness shows in its traced peer's chunks (Megatron-style tracing)."""
        untraced = self.arrival.untraced(epoch) - self.fail_stop.dead
        plan = self.arrival.plans.get(epoch)
        if not untraced or plan is None:
            return []
        return sorted(d for pipe in plan.pipelines for st in pipe.stages if set(st.devices) <= untraced | self.fail_stop.dead
                      for d in st.devices if d in untraced)

    def _untraced_size(self, frame: IterationFrame, sched: tuple[str | None, int | None], explained: float,
                       wall: float, z: float, named: int | None = None) -> tuple[float, dict[int, float]]:
        """(size, per stage its own size): the slowdown of one stage of a replica that would make it
        as late as the job was, the replica's compute-only path being the traced one's plus the
        iteration's excess over healthy (``stage_factors_for``). The size is the ``named`` rank's
        stage's (a probe named it), else the median over stages."""
        per_stage = stage_factors_for(frame, frame.c_own, sched, explained + wall * (1.0 - math.exp(-z)))
        if not per_stage:
            return float(np.exp(z)), {}
        plan = self.arrival.plans.get(frame.epoch)
        role = plan.roles.get(named) if plan is not None and named is not None else None
        if role is not None and role.stage in per_stage:
            return per_stage[role.stage], per_stage
        return float(np.median(list(per_stage.values()))), per_stage

    def _open_untraced(self, frame: IterationFrame, sched: tuple[str | None, int | None], explained: float,
                       wall: float, z: float, k: float, h: float, sigma: float, untraced: list[int],
                       run: int | None = None) -> list[Payload]:
        """A compute incident on the ranks nobody traces (see analytics/untraced.py). It opens
        without a place, as a communication incident opened on the iteration's excess does: one
        of sixteen ranks over several replicas and stages is no TP group, and a planner handed
        them as one would plan around every one of them as slow by a stage's guess. The ranks are
        the probe's (``ranks``) and the evidence's (``rank_factors``, each one's size if it is the
        slow one); the probe that names the rank places and sizes it, and a planner waits for that."""
        size, per_stage = self._untraced_size(frame, sched, explained, wall, z)
        ranks = tuple(untraced)
        roles = self.arrival.plans[frame.epoch].roles
        # each rank's size if it is the slow one (its stage's answer): the probe's naming takes it
        by_rank = {r: round(per_stage[roles[r].stage], 4) for r in ranks if r in roles and roles[r].stage in per_stage}
        return self.book.open_fail_slow(Suspect(
            key=("untraced",), target="compute", rank=None, link=None, node=None, replica=None, stage=None,
            tp_group=None, factor=size, confidence=float(min(0.99, 1.0 - np.exp(-max(z - k, 0.0) / sigma / 2))),
            iterations=[frame.iteration], observed_s=[wall], predicted_s=[wall * math.exp(-z)], rank_factors=by_rank,
            statistic=(f"{run} traced iterations in a row later than the job's healthy swing allows "
                       f"(tail fitted to its own excesses); " if run else
                       f"CUSUM on log(wall / iteration explained by the traced compute); k={k:.4f} h={h:.4f}; ")
                      + "traced pipelines on time",
            note=f"the job is ×{math.exp(z):.2f} slower than its traced ranks explain while their own pipelines "
                 f"are on time: the time is lost outside what is traced, on one of the {len(ranks)} untraced ranks "
                 f"(sized as one pipeline stage ×{size:.2f})"
                 + ("; a probe will tell which (and, if none computes slow, a probe of every rank's links)"
                    if self.config.probes else ""),
            ranks=ranks, link_probe_ranks=self._plan_ranks(frame)), frame.iteration)

    def _plan_ranks(self, frame: IterationFrame) -> tuple[int, ...]:
        """Every live rank of the running plan (the ranks heard from when the plan is unknown)."""
        plan = self.arrival.plans.get(frame.epoch)
        ranks = set(plan.roles) if plan is not None else set(frame.rank.tolist())
        return tuple(sorted(ranks - self.fail_stop.dead))[:4096]

    def _schedule(self, frame: IterationFrame) -> tuple[str | None, int | None]:
        """The plan's schedule when the plan of this epoch is known, else None (inferred from chunks)."""
        plan = self.arrival.plans.get(frame.epoch)
        return (plan.schedule, plan.virtual_stages) if plan is not None else (None, None)

    def _prediction(self, frame: IterationFrame, facts: IterationFacts) -> IterationPrediction:
        """Observed against predicted iteration time: the pipeline's critical path with predicted
        chunks, plus the job's time outside the pipeline.

        Outside the pipeline a step also spends time the chunks and the schedule do not hold: the
        optimizer step, data loading, logging, a checkpoint's bookkeeping. It is the job's own
        (model size, optimizer, loader), so it is learned per job: the median, over the last
        ``window_iterations`` iterations with no incident open, of observed minus the pipeline's
        prediction, never below zero. Without it a healthy job read +28 % against its prediction."""
        pipeline = facts.pipeline_s
        observed = float(frame.wall_s.max())
        if np.isfinite(pipeline) and pipeline > 0 and not self.book.open:
            self._outside_s.append(observed - pipeline)
        outside = max(float(np.median(self._outside_s)), 0.0) if self._outside_s else 0.0
        err = self.model.error()
        return IterationPrediction(
            epoch=frame.epoch, iteration=frame.iteration, observed_s=observed,
            predicted_s=float(pipeline + outside) if np.isfinite(pipeline) else 0.0,
            tokens=facts.tokens,
            model_error=float(err) if np.isfinite(err) else None,
            stages=[StageTime(replica=r, stage=st, observed_s=min(max(o, 0.0), 1e6), predicted_s=min(p, 1e6))
                    for r, st, o, p in facts.stages],
        )

    def _health(self, frame: IterationFrame) -> RankHealth | None:
        """The full rank view, only when some rank's state or factor (to 5%) changed.

        Compared as the frame's ranks (healthy unless named) plus the few ranks in another state:
        at 100k ranks a dict of every rank per iteration cost more than judging the iteration."""
        special: dict[int, tuple[str, float]] = {}
        for r in self.arrival.untraced(frame.epoch):
            special[r] = ("not_traced", 1.0)  # declared untraced: neither healthy nor dead from silence
        for r in self.fail_stop.dead:
            special[r] = ("dead", 1e6)
        for r, f in self.book.slow_factors().items():
            if special.get(r, ("", 0))[0] != "dead":
                special[r] = ("slow", f)
        last = getattr(self, "_published_view", None)  # absent in a detector pickled before it existed
        changed = last is None or not np.array_equal(last[0], frame.rank) or special.keys() != last[1].keys() or any(
            st != last[1][r][0] or abs(f / last[1][r][1] - 1) > 0.05 for r, (st, f) in special.items())
        if not changed:
            return None
        self._published_view = (frame.rank.copy(), special)
        named = np.fromiter(special, np.int64, len(special))
        return RankHealth(
            epoch=frame.epoch, iteration=frame.iteration,
            ranks=[RankHealthEntry(rank=r, state=RankState(st), factor=max(f, 1e-6))
                   for r, (st, f) in sorted(special.items()) if st != "not_traced"],
            healthy=id_ranges(np.setdiff1d(frame.rank, named).tolist()),
            not_traced=id_ranges(sorted(r for r, (st, _) in special.items() if st == "not_traced")))
