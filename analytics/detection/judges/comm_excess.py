"""The communication excess: wall time that the observed compute cannot explain.

It is communication — or, in a job that traces only some ranks, a fault outside what is traced
(analytics/detection/untraced.py). The schedule model replays the observed own chunk times (no transfers, no
all-reduce); the log of observed over that is steady while links are healthy. A CUSUM on its
deviation from the recent healthy median flags the excess; probes say where.

Which of the two: with untraced ranks in the plan, the traced pipelines' own span (their last
chunk's end) is followed the same way. A late iteration whose traced pipelines are on time lost its
time while they waited in the DP all-reduce: for a replica nobody traces.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from analytics.detection.calibration import COMM_EXCESS, UNTRACED_EXCESS
from analytics.detection.judges.base import FrameView, JobContext
from analytics.detection.frame import IterationFrame
from analytics.detection.incident_keys import COMM_KEY, UNTRACED_KEY
from analytics.detection.open_incident import Suspect
from analytics.detection.scoring import FrameScore
from analytics.detection.untraced import HiddenExcess, stage_factors_for
from collector.events import Payload



class CommExcess:
    """The excess's healthy history, its CUSUM, and the hidden replicas' runs of excess."""

    def __init__(self, window_iterations: int) -> None:
        self.hist: deque[float] = deque(maxlen=4 * window_iterations)
        self.pipe_hist: deque[float] = deque(maxlen=4 * window_iterations)  # traced pipelines' span
        self.hidden = HiddenExcess(window_iterations)  # with hidden ranks: their excess's runs
        self.cusum = 0.0
        self.unjudged = False  # the open communication incident has no healthy reference in this layout

    def new_epoch(self, job: JobContext) -> None:
        self.hist.clear()
        self.pipe_hist.clear()
        self.hidden.clear()
        self.cusum = 0.0
        # A communication incident open across a new plan can no longer be judged from the excess
        # over this layout's history (it would be learned with the fault in it, and resolve it).
        # It stays open, as a fail-slow on a rank left out does: nothing measured the link healthy.
        self.unjudged = COMM_KEY in job.book.open or UNTRACED_KEY in job.book.open

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        if not job.config.links:
            return []
        frame, untraced, config = view.frame, view.hidden, job.config
        sched = job.schedule(frame)
        explained = view.facts.explained_s
        if not np.isfinite(explained) or explained <= 0:
            return []
        wall = float(frame.wall_s.max())
        r = float(np.log(wall / explained))
        hidden = self.hidden if untraced else None
        raw, r_size = r, r
        if hidden is not None:  # the untraced replicas' own mix moves the job's time: only a lasting
            r, r_size = hidden.add(r, frame.iteration, config.sigma_floor)  # excess counts, sized on the last few
        span = view.facts.span_s if untraced else float("nan")
        r_pipe = float(np.log(span / explained)) if np.isfinite(span) and span > 0 else float("nan")
        hist = np.array(self.hist)
        if len(hist) < 4:
            self._learn(r, r_pipe, raw, hidden)
            return []
        centre = float(np.median(hist))
        sig = max(1.4826 * float(np.median(np.abs(hist - centre))), config.sigma_floor)
        k, h, cap = job.thresholds(sig)
        z = r - centre
        book = job.book
        for key in (COMM_KEY, UNTRACED_KEY):
            if key in book.open:
                if self.unjudged:
                    return []  # this layout's history was learned with the fault in it: no healthy reference
                size = (untraced_size(frame, sched, explained, wall, r_size - centre, book.open[key].suspect.rank,
                                      job)[0] if key == UNTRACED_KEY else float(np.exp(z)))
                return book.observe(key, z, k, frame.iteration, size, sample=size)
        if book.open_compute_ranks():
            return []  # a slow rank explains a slow iteration; wait until it is handled
        self.cusum = max(0.0, self.cusum + min(z - k, cap))
        run = None
        if self.cusum <= h and hidden is not None:
            run = hidden.unlikely_run(h, config.untraced_run_rate, config.sigma_floor)
            if run is not None:
                r_size = hidden.size_of(run)
        if self.cusum <= h and run is None:
            self._learn(r, r_pipe, raw, hidden)
            return []
        self.cusum = 0.0
        pipe_hist = np.array([v for v in self.pipe_hist if np.isfinite(v)])
        if untraced and np.isfinite(r_pipe) and len(pipe_hist) >= 4 and r_pipe - float(np.median(pipe_hist)) < k:
            return _open_untraced(frame, sched, explained, wall, r_size - centre, k, h, sig, untraced, run, job)
        return book.open_fail_slow(_comm_suspect(frame, view.score, wall, explained, centre, z, k, h,
                                                 job.config.probes), frame.iteration)

    def _learn(self, r: float, r_pipe: float, raw: float, hidden: HiddenExcess | None) -> None:
        """An iteration whose excess raised no alarm: the healthy reference of every excess rule."""
        self.hist.append(r)
        self.pipe_hist.append(r_pipe)
        if hidden is not None:
            hidden.learn(raw)


def _comm_suspect(frame: IterationFrame, score: FrameScore, wall: float, explained: float, centre: float, z: float,
                  k: float, h: float, probes: bool) -> Suspect:
    """A communication incident on the iteration's excess.

    Only a wire-only timer may name the link at the opening: one that holds the wait for the peer
    reads ×10–×10⁵ on healthy links in single iterations, so its largest score names a link at
    random, and the opening's size (the iteration's excess) is no link's size. The probe names and
    sizes it; a timer that holds waits and stays slow opens its own incident."""
    judged = np.isfinite(score.link_z) & ~score.link_waits
    best = int(np.flatnonzero(judged)[np.argmax(score.link_z[judged])]) if judged.any() else None
    link = (int(score.link_src[best]), int(score.link_dst[best])) if best is not None else None
    if link is not None and score.link_z[best] < k:
        link = None
    candidates = tuple(int(r_) for r_ in frame.rank[: 4096])
    return Suspect(
        key=COMM_KEY, target="link", rank=None, link=link, node=None, replica=None, stage=None, tp_group=None,
        factor=float(np.exp(z)), place_confidence=1.0 if link is not None else 0.0, iterations=[frame.iteration],
        basis=COMM_EXCESS, margin=float((z - k) / k) if k > 0 else 0.0,
        observed_s=[wall], predicted_s=[float(explained * np.exp(centre))], rank_factors={},
        statistic=f"CUSUM on log(wall / iteration explained by observed compute); k={k:.4f} h={h:.4f}",
        note="iteration slower than its compute explains: communication" + (
            "; probing every rank's links" if probes else ""),
        ranks=candidates)


def untraced_size(frame: IterationFrame, sched: tuple[str | None, int | None], explained: float, wall: float,
                  z: float, named: int | None, job: JobContext) -> tuple[float, dict[int, float]]:
    """(size, per stage its own size): the slowdown of one stage of a replica that would make it
    as late as the job was, the replica's compute-only path being the traced one's plus the
    iteration's excess over healthy (``stage_factors_for``). The size is the ``named`` rank's
    stage's (a probe named it), else the median over stages."""
    per_stage = stage_factors_for(frame, frame.c_own, sched, explained + wall * (1.0 - math.exp(-z)))
    if not per_stage:
        return float(np.exp(z)), {}
    plan = job.plan(frame.epoch)
    role = plan.roles.get(named) if plan is not None and named is not None else None
    if role is not None and role.stage in per_stage:
        return per_stage[role.stage], per_stage
    return float(np.median(list(per_stage.values()))), per_stage


def _open_untraced(frame: IterationFrame, sched: tuple[str | None, int | None], explained: float, wall: float,
                   z: float, k: float, h: float, sigma: float, untraced: list[int], run: int | None,
                   job: JobContext) -> list[Payload]:
    """A compute incident on the ranks nobody traces (see analytics/detection/untraced.py). It opens
    without a place, as a communication incident opened on the iteration's excess does: one
    of sixteen ranks over several replicas and stages is no TP group, and a planner handed
    them as one would plan around every one of them as slow by a stage's guess. The ranks are
    the probe's (``ranks``) and the evidence's (``rank_factors``, each one's size if it is the
    slow one); the probe that names the rank places and sizes it, and a planner waits for that."""
    size, per_stage = untraced_size(frame, sched, explained, wall, z, None, job)
    ranks = tuple(untraced)
    roles = job.arrival.plans[frame.epoch].roles
    # each rank's size if it is the slow one (its stage's answer): the probe's naming takes it
    by_rank = {r: round(per_stage[roles[r].stage], 4) for r in ranks if r in roles and roles[r].stage in per_stage}
    return job.book.open_fail_slow(Suspect(
        key=UNTRACED_KEY, target="compute", rank=None, link=None, node=None, replica=None, stage=None,
        tp_group=None, factor=size, place_confidence=round(1.0 / max(len(ranks), 1), 4), basis=UNTRACED_EXCESS,
        margin=float((z - k) / max(sigma, 1e-6)),
        iterations=[frame.iteration], observed_s=[wall], predicted_s=[wall * math.exp(-z)], rank_factors=by_rank,
        statistic=(f"{run} traced iterations in a row later than the job's healthy swing allows "
                   f"(tail fitted to its own excesses); " if run else
                   f"CUSUM on log(wall / iteration explained by the traced compute); k={k:.4f} h={h:.4f}; ")
                  + "traced pipelines on time",
        note=f"the job is ×{math.exp(z):.2f} slower than its traced ranks explain while their own pipelines "
             f"are on time: the time is lost outside what is traced, on one of the {len(ranks)} untraced ranks "
             f"(sized as one pipeline stage ×{size:.2f})"
             + ("; a probe will tell which (and, if none computes slow, a probe of every rank's links)"
                if job.config.probes else ""),
        ranks=ranks, link_probe_ranks=job.plan_ranks(frame)), frame.iteration)
