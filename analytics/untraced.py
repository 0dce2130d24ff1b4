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
"""

from __future__ import annotations

import math

import numpy as np

from analytics.frame import IterationFrame
from analytics.prediction import predicted_iteration_s

_SIZE_STEPS = 12  # bisection steps on log(factor) over [0, log 32]: 0.08 % resolution


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
