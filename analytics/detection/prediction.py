"""The predicted healthy iteration time of one frame, through the shared schedule model.

Per replica, the predicted own time of every (stage, micro-batch) chunk goes into the schedule's
DAG (analytics/detection/schedule.py, the same one the planner and the simulator use); its critical path
plus the DP all-reduce is what a healthy iteration with this iteration's sequences should take.
The schedule is the plan's when the detector knows it, otherwise inferred from the chunks (W
chunks mean zero-bubble, virtual stages mean interleaved).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from analytics.detection.frame import OP_CODE, IterationFrame
from analytics.detection.schedule import PipelineDurations, predict_iteration
from analytics.detection.scoring import group_median


def infer_schedule(frame: IterationFrame) -> tuple[str, int]:
    """(schedule, virtual_stages) the chunks imply."""
    if (frame.c_kind == 2).any():
        return "zero_bubble", 1
    v = int(frame.c_vs.max()) + 1 if len(frame.c_vs) else 1
    return ("interleaved", v) if v > 1 else ("1f1b", 1)


def predicted_iteration_s(frame: IterationFrame, c_pred: np.ndarray, schedule: str | None = None,
                          virtual_stages: int | None = None, include_comm: bool = True) -> float:
    """Critical-path iteration time with predicted chunk times; NaN if the frame cannot be laid out
    (a replica missing a stage's telemetry, say); replicas that sent nothing are left out. ``c_pred`` may also be the observed own times:
    with ``include_comm=False`` that gives the iteration time compute alone explains."""
    return predicted_iterations_s(frame, [(c_pred, include_comm)], schedule, virtual_stages)[0]


def predicted_iterations_s(frame: IterationFrame, predictions: Sequence[tuple[np.ndarray, bool]],
                           schedule: str | None = None, virtual_stages: int | None = None) -> list[float]:
    """``predicted_iteration_s`` of each (chunk times, include_comm) in ``predictions``, their
    pipelines laid out in one sweep of the schedule's DAG: a replica's summary wants the
    prediction's and the observed own times' (analytics/sharding/replica_summary.py), and the
    sweep is per level, whatever the rows."""
    if schedule is None:
        schedule, virtual_stages = infer_schedule(frame)
    V = virtual_stages or 1
    dp_c, pp_c = frame.dp[frame.c_rank], frame.pp[frame.c_rank]
    S = int(frame.pp.max()) + 1
    n_rep = int(frame.dp.max()) + 1
    # a replica's micro-batches in schedule order: the trainer may number them within the global
    # batch (replica 1 runs 4–7) or within the replica (0–3); either way they are contiguous
    first_mb = np.full(n_rep, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first_mb, dp_c, frame.c_mb)
    mb_c = frame.c_mb - first_mb[dp_c]
    M = int(mb_c.max()) + 1
    cell = ((dp_c * S + pp_c) * V + frame.c_vs) * M * 3 + mb_c * 3 + frame.c_kind
    size = n_rep * S * V * M * 3
    sends = frame.k_dur[(frame.k_op == OP_CODE["pp_send"])]
    dp_waits = np.bincount(frame.k_rank[frame.k_op == OP_CODE["dp_allreduce"]],
                           weights=frame.k_dur[frame.k_op == OP_CODE["dp_allreduce"]], minlength=frame.num_ranks)
    mb_count = np.full(n_rep, -1, np.int64)  # per replica: its last micro-batch's position (-1: no chunk at all)
    np.maximum.at(mb_count, dp_c, mb_c)
    out = [float("nan")] * len(predictions)
    if (mb_count < 0).all():
        return out
    # A replica with no report at all is one nobody traces (sampled tracing): the prediction is
    # the traced replicas'; one with a stage missing cannot be laid out (NaN).
    traced = np.flatnonzero(mb_count >= 0).tolist()
    reps: list[PipelineDurations] = []
    owner: list[int] = []  # per entry of reps, its prediction
    dp_s_of: dict[int, float] = {}
    for i, (c_pred, include_comm) in enumerate(predictions):
        med = group_median(cell, np.nan_to_num(c_pred), size).reshape(n_rep, S, V, M, 3)
        p2p_s = float(np.percentile(sends, 25)) if len(sends) and include_comm else 0.0
        mine = []
        for r in traced:
            a = med[r][:, :, : int(mb_count[r]) + 1]  # replicas may run different micro-batch counts
            if np.isnan(a[..., 0]).any() or np.isnan(a[..., 1]).any():
                break
            f, b = a[..., 0], a[..., 1]
            w = a[..., 2] if schedule == "zero_bubble" else None
            if V == 1:
                f, b = f[:, 0], b[:, 0]
                w = None if w is None else w[:, 0]
            mine.append(PipelineDurations(f, b, w, p2p_s))
        else:
            reps += mine
            owner += [i] * len(mine)
            dp_s_of[i] = float(dp_waits.min()) if len(dp_waits) and include_comm else 0.0
    if not reps:
        return out
    try:
        ends = predict_iteration(schedule, reps, virtual_stages=V).replica_end_s
    except (ValueError, KeyError):
        return out
    of = np.array(owner)
    for i, dp_s in dp_s_of.items():
        out[i] = float(ends[of == i].max() + dp_s)
    return out


MAX_STAGE_ROWS = 256  # per iteration and job: what /metrics turns into series, so bounded at any scale


def predicted_stage_spans(frame: IterationFrame, c_pred: np.ndarray) -> list[tuple[int, int, float, float]]:
    """(replica, stage, observed_s, predicted_s) of each pipeline stage's compute in this iteration:
    the sum of its chunks' own times (TP waits excluded) against the same sum of the cost model's
    predictions, the median over the stage's reporting TP ranks. A stage none of whose ranks has a
    prediction for every chunk is left out (the model had not fitted it yet).

    Every (replica, stage) when the layout has at most ``MAX_STAGE_ROWS``; otherwise, per stage, the
    replica whose stage is furthest above its prediction — the one an operator would look at — so a
    100k-rank job still gives one row per stage."""
    n = frame.num_ranks
    if len(frame.c_rank) == 0:
        return []
    observed = np.bincount(frame.c_rank, weights=frame.c_own, minlength=n)
    predicted = np.bincount(frame.c_rank, weights=np.nan_to_num(c_pred, nan=0.0), minlength=n)
    unknown = np.bincount(frame.c_rank, weights=~np.isfinite(c_pred), minlength=n) > 0
    chunks = np.bincount(frame.c_rank, minlength=n)
    ok = (chunks > 0) & ~unknown
    stages = int(frame.pp.max()) + 1
    cell = frame.dp.astype(np.int64) * stages + frame.pp
    size = (int(frame.dp.max()) + 1) * stages
    obs = group_median(cell[ok], observed[ok], size)
    pred = group_median(cell[ok], predicted[ok], size)
    cells = np.flatnonzero(np.isfinite(obs) & np.isfinite(pred) & (pred > 0))
    return bounded_stage_rows(cells // stages, cells % stages, obs[cells], pred[cells])


def bounded_stage_rows(replica: np.ndarray, stage: np.ndarray, observed: np.ndarray, predicted: np.ndarray
                       ) -> list[tuple[int, int, float, float]]:
    """``predicted_stage_spans``'s rows, at most ``MAX_STAGE_ROWS`` of them (see there), sorted by (replica,
    stage). The sharded merge applies it to the rows its shards computed per replica."""
    order = np.lexsort((stage, replica))
    replica, stage, observed, predicted = replica[order], stage[order], observed[order], predicted[order]
    if len(replica) > MAX_STAGE_ROWS:
        ratio = observed / predicted
        by_stage = np.lexsort((-ratio, stage))  # by stage, the largest ratio first
        first = by_stage[np.r_[True, np.diff(stage[by_stage]) != 0]]
        keep = np.sort(first)[:MAX_STAGE_ROWS]
        replica, stage, observed, predicted = replica[keep], stage[keep], observed[keep], predicted[keep]
    return [(int(r), int(s), float(o), float(p)) for r, s, o, p in zip(replica, stage, observed, predicted)]
