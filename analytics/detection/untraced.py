"""Time no traced rank explains: a fault on a rank nobody traces, found and sized from the rest.

A job that traces a subset of its ranks (the ``sampled`` dialect: every second replica, say)
still runs in step: every replica's gradients are all-reduced together, so the traced ranks wait
in that all-reduce for a slower replica nobody traces, and the job's iteration is longer than the
traced replicas' own pipelines explain. That excess is the only trace such a fault leaves.

The detector (``Detector._comm_excess``) tells it from a slow link or NIC in a traced replica by
where the time went: a traced pipeline that is on time (its ranks' last chunks end when their
compute says they should) with an iteration that is late means the time was lost outside what is
traced. It then names the untraced ranks (a probe, when enabled, tells which one is slow) and sizes
the fault as the slowdown of one pipeline stage that would make a replica as late as the job was:
the same schedule model that predicts a healthy iteration, run backwards, once per stage. The
median over stages is the size until a probe names the rank; from then on its stage's answer is.

``HiddenExcess`` decides when that excess counts, and how unlikely one traced iteration's is
(an unlikely one brings ``UntracedSweep``, the probe of the untraced ranks, forward). The
untraced replicas' own mix (their sequence lengths nobody records) makes single iterations late
by chance, so one late step is never enough; how many are is a matter of how late (see its
docstring).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from analytics.detection.frame import IterationFrame
from analytics.detection.prediction import predicted_iteration_s
from collector.events import ProbeRequest, ProbeResult

_SIZE_STEPS = 12  # bisection steps on log(factor) over [0, log 32]: 0.08 % resolution
# Traced iterations the job must run late before time lost outside the traced ranks counts at any
# size. Frames, not iterations: each traced frame is one sample of the untraced replicas' swing, and
# a skipped step is none (held for 2 frames of every 2nd step, healthy sampled runs opened 5
# incidents in 480 iterations). Shorter runs count only when too late for chance (``HiddenExcess``).
UNTRACED_SUSTAIN = 4
_MIN_TAIL_HISTORY = 8  # healthy excesses before a tail is fitted to them


class HiddenExcess:
    """The job's excess over what its traced compute explains (log wall / explained), one value
    per traced iteration, for a job some of whose replicas nobody traces.

    Healthy, the excess is near its centre most iterations and jumps now and then, when an untraced
    replica happens to draw a heavier mix than the traced ones (up to +0.25 in log in the suite's
    long-context run). A fault on an untraced rank lifts it on every iteration. Two rules say when
    it counts, each on the last few traced iterations:

    * ``persistent``: their least, which the detector's CUSUM judges like any excess: slow but
      sure, it finds a replica late by a few per cent once that holds for ``UNTRACED_SUSTAIN``
      traced iterations.
    * ``unlikely_run``: a run of n ≥ 2 late iterations, each later than the healthy ones would be
      n times in a row with probability ``rate`` (per traced iteration). The chance is read from
      the job's own healthy excesses above their median: m of them, overshooting by λ on average,
      q the share that overshoots. An exponential tail fitted to m values is uncertain in λ, and a
      real swing need not be exponential, so the chance is the exponential's predictive tail
      over that uncertainty, a Lomax: P(e ≥ c + x) ≈ q·(1 + x/(m·λ))^(−m), heavier far out (fitted
      as a plain exponential, healthy swings passed runs 15× as often as the rate said, and a
      Pareto-tailed one 40×). So a GPU nobody traces that makes the job far later than it ever
      runs healthy (a ×5 one) is named after two whole traced iterations instead of four or more,
      while a run within the reach of the job's own swing (the suite's ×2 and ×3, +0.25 to +0.6
      against healthy spikes to +0.25) waits for ``persistent``. The fit is the job's, learned
      while healthy; nothing is tuned to one trace.
    """

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque(maxlen=UNTRACED_SUSTAIN)  # the last traced excesses
        self.healthy: deque[float] = deque(maxlen=4 * window)  # excesses of iterations that did not alarm
        self.latest = (-1, 0.0, 1.0)  # the newest excess: (iteration, over the healthy median, its chance)

    def add(self, excess: float, iteration: int, scale_floor: float) -> tuple[float, float]:
        """Take a traced iteration's excess; (the least of the recent ones, the median of the last
        three: what the incident is sized on, a single lucky or unlucky one left out). Its chance
        under the healthy tail (``chance``) is kept, read before it joins the healthy ones."""
        self.recent.append(excess)
        fit = self._tail(scale_floor)
        self.latest = (iteration, excess - fit[0], fit[1](excess)) if fit is not None else (iteration, 0.0, 1.0)
        return min(self.recent), self.size_of(3)

    def chance(self, iteration: int, least_alarm: float) -> float:
        """How often a healthy traced iteration is as late as ``iteration`` was; 1.0 when that
        iteration brought no excess, too little healthy history to say, or an excess under
        ``least_alarm`` above the healthy median (the smallest that ever opens an incident: in a
        job that barely swings, a lasting ×1.03 would otherwise be unlikely on every step)."""
        at, over, p = self.latest
        return p if at == iteration and over >= least_alarm else 1.0

    def size_of(self, n: int) -> float:
        """The median of the last ``n`` excesses: a run of n that opened an incident is sized on
        itself, not on an iteration from before the fault."""
        return float(np.median(list(self.recent)[-n:]))

    def learn(self, excess: float) -> None:
        """An iteration that raised no alarm: part of the job's healthy swing."""
        self.healthy.append(excess)

    def clear(self) -> None:
        self.recent.clear()
        self.healthy.clear()

    def _tail(self, scale_floor: float) -> tuple[float, Callable[[float], float]] | None:
        """(the healthy median, P(a healthy excess ≥ e) as a function of e, 1.0 at or below it): the
        exponential's predictive tail over the overshoots above the median, a Lomax (see the class
        docstring); λ is at least ``scale_floor`` (the detector's σ floor): a handful of tiny
        overshoots is no evidence that the job never swings. None with too little history."""
        if len(self.healthy) < _MIN_TAIL_HISTORY:
            return None
        h = np.asarray(self.healthy)
        centre = float(np.median(h))
        over = h[h > centre] - centre
        m = max(len(over), 1)
        scale = max(float(over.mean()) if len(over) else 0.0, scale_floor)
        share = (len(over) + 1) / (len(h) + 1)

        def tail(e: float) -> float:
            x = e - centre
            return 1.0 if x <= 0 else share * (1.0 + x / (m * scale)) ** -m

        return centre, tail

    def unlikely_run(self, least_alarm: float, rate: float, scale_floor: float) -> int | None:
        """The length n of the shortest run of recent excesses (n ≥ 2), each at least ``least_alarm``
        above the healthy median (the smallest excess that ever opens an incident), whose chance
        under the fitted tail, P(e ≥ least of the run)^n, is at most ``rate``; None when there is
        none or too little healthy history to fit a tail to."""
        fit = self._tail(scale_floor)
        if fit is None:
            return None
        centre, tail = fit
        recent = list(self.recent)
        for n in range(2, len(recent) + 1):
            least = min(recent[-n:])
            if least - centre < least_alarm:
                return None  # a shorter run's least is no smaller: no longer one passes either
            if tail(least) ** n <= rate:
                return n
        return None


def traced_pipeline_s(frame: IterationFrame) -> float:
    """When the last traced chunk of the iteration ended (local offsets from each rank's iteration
    start): the traced pipelines' own span, before the DP all-reduce and whatever waits in it."""
    if not len(frame.c_start):
        return float("nan")
    return float(np.max(frame.c_start + frame.c_dur))


def stage_factors_for(frame: IterationFrame, own_s: np.ndarray, schedule: tuple[str | None, int | None],
                      target_s: float) -> dict[int, float]:
    """Per pipeline stage s, the slowdown f of stage s alone that makes the schedule's critical path
    over ``own_s`` (the traced chunks' own times) last ``target_s`` (bisection on log f). Empty
    when the frame cannot be laid out; 1.0 everywhere when the target is not above the healthy
    path.

    Why per stage: the stages are not equally heavy (the last runs the LM head), so the same
    lateness is a smaller slowdown of the heaviest stage, which bounds the pipeline, than of a
    light one (×1.9 against ×2.4 for one ×2 GPU's lateness in the suite). Which stage of an
    untraced replica is slow is not in the telemetry: the median over stages stands in until a
    probe names the rank, and then its own stage's answer is its size."""
    if not len(frame.c_rank):
        return {}  # no chunks to lay out: the sharded merge's frame holds rank rows only
    base = predicted_iteration_s(frame, own_s, *schedule, include_comm=False)
    if not (np.isfinite(base) and base > 0 and np.isfinite(target_s)):
        return {}
    stage_of_chunk = frame.pp[frame.c_rank]
    stages = np.unique(stage_of_chunk).tolist()
    if target_s <= base:
        return dict.fromkeys(stages, 1.0)
    answers = {}
    for s in stages:
        sel = stage_of_chunk == s
        lo, hi = 0.0, math.log(32.0)
        for _ in range(_SIZE_STEPS):
            mid = 0.5 * (lo + hi)
            stretched = own_s.copy()
            stretched[sel] *= math.exp(mid)
            t = predicted_iteration_s(frame, stretched, *schedule, include_comm=False)
            if not np.isfinite(t):
                return {}
            lo, hi = (mid, hi) if t < target_s else (lo, mid)
        answers[int(s)] = math.exp(0.5 * (lo + hi))
    return answers


class UntracedSweep:
    """A compute probe of the ranks nobody traces, every ``untraced_sweep_steps`` traced iterations
    and at once on a traced iteration the job's healthy swing makes unlikely.

    Why: the job's lateness is all that shows a fault on an untraced rank, and a slowdown smaller
    than the untraced replicas' own swing never shows there (a ×1.1 GPU passes unseen, however
    long). A probe runs each rank alone against a healthy reference and measures it to a few per
    cent. It pauses training while it runs, so it is periodic, not every step; the default (every
    16 traced steps, every 32 iterations at every-2nd-step tracing) costs one probe per 32
    iterations. A late iteration (``HiddenExcess.chance`` at most ``untraced_suspicion_rate``)
    brings it forward: the probe names a GPU that makes the job late at its first late step, and
    sizes it, where the lateness alone would have to hold for several (and sizes it only through
    the schedule, a few per cent off). One sweep is pending at a time; it ends when every asked
    rank still alive has answered (answers travel on the control topic, telemetry on its own: no
    count of iterations gives up on them), and a new plan drops it."""

    def __init__(self) -> None:
        self.frames = 0  # traced iterations since the last sweep was asked
        self.probe_id: str | None = None  # the pending sweep
        self.asked: tuple[int, ...] = ()
        self.ratios: dict[int, float] = {}
        self.iteration = -1  # when the pending (or last) sweep was asked
        self.epoch = -1  # the plan it asked under: the plan its answers are placed in
        self.late = False  # it was asked because its iteration was late, not because one was due

    def step(self, job: str, epoch: int, iteration: int, ranks: list[int], every: int,
             suspicious: bool = False) -> ProbeRequest | None:
        """One traced iteration with ``ranks`` untraced: the sweep to ask now, if one is due or the
        iteration is ``suspicious`` (later than the job's healthy swing makes likely: the sweep is
        brought forward, and the next periodic one counts from it)."""
        self.frames += 1
        due = every > 0 and self.frames >= every
        if self.probe_id is not None or not (due or suspicious) or not ranks:
            return None
        self.frames = 0
        self.probe_id, self.asked, self.ratios = f"sweep-{job}-{epoch}-{iteration}", tuple(ranks), {}
        self.iteration, self.epoch, self.late = iteration, epoch, suspicious and not due
        return ProbeRequest(probe_id=self.probe_id, incident_id=None, ranks=list(ranks), target="compute")

    def claims(self, p: ProbeResult) -> bool:
        """Whether ``p`` answers the pending sweep (then it is recorded)."""
        if self.probe_id is None or p.probe_id != self.probe_id:
            return False
        self.ratios[int(p.rank)] = p.duration_s / p.reference_s
        return True

    def done(self, dead: set[int]) -> dict[int, float] | None:
        """The answers, once every asked rank not dead has given one (the sweep is then over)."""
        if self.probe_id is None or set(self.asked) - set(self.ratios) - dead:
            return None
        self.probe_id = None
        return self.ratios

    def drop(self) -> None:
        """A new plan: the asked ranks may no longer be the untraced ones."""
        self.probe_id, self.frames = None, 0
