"""Per-rank and per-link scores of one iteration: observed against the cost model's prediction.

For every rank, x = the median over its chunks of log(own compute / predicted), per chunk kind and
weighted by the kinds' predicted shares (``rank_log_ratios``), then centred on the job
(``z = x − centre``, the centre being the median over clean TP groups of each group's slowest
member, ``tp_group_max``), so a slowdown shared by the whole job (a model that
drifted, a slower data mix) is not blamed on anyone, while one rank slower than the work it was
given stands out — from the first iteration on, because the prediction comes from its peers
(other replicas and TP ranks of the same work class), not from its own history.

Links are scored on the point-to-point sends a rank reports: the time of one message (per byte
when sizes are known) over the link, taken at its lower quartile over the iteration's messages so
that the part of a send spent waiting for the peer to be ready does not count, centred on the
median link.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import numpy as np

from analytics.detection.cost_model import CostModel
from analytics.detection.frame import OP_CODE, IterationFrame

# A work class (``chunk_classes`` says why): the stage named by its layer range when the plan is
# known, else by its index; then the virtual stage, the chunk kind and the TP degree.
LayerClass = tuple[Literal["layers"], int, int, int, int, int]  # ("layers", first, end, vs, kind, TP degree)
StageClass = tuple[Literal["stage"], int, int, int, int]  # ("stage", stage index, vs, kind, TP degree)
WorkClass = LayerClass | StageClass


@dataclass
class FrameScore:
    z: np.ndarray  # (R,) centred log-ratio per rank; NaN for a rank with no predicted chunk (not judged)
    x: np.ndarray  # (R,) raw log-ratio per rank
    z_by_kind: np.ndarray  # (R, 3) centred log-ratio per rank and chunk kind (NaN if none)
    c_pred: np.ndarray  # (C,) predicted own time per chunk
    c_class: np.ndarray  # (C,) index into class_keys
    class_keys: list[WorkClass]
    link_src: np.ndarray  # (L,) device ids
    link_dst: np.ndarray
    link_z: np.ndarray  # (L,) centred log time per message; NaN: not judged this iteration
    link_class: np.ndarray  # (L,) the link's stage pair, as a code: links that do the same work share it
    link_waits: np.ndarray  # (L,) bool: the link's timers hold the wait for the peer (fused / blocking)
    inferred: bool  # True when seq_lens were missing and per-micro-batch inference filled in


def chunk_classes(frame: IterationFrame) -> tuple[np.ndarray, list[WorkClass]]:
    """Work class per chunk: what makes two chunks comparable apart from their sequences.

    With the plan known, a class is ("layers", first_layer, end_layer, virtual stage, kind, TP
    degree): the layer range says which layers (and whether the embedding or the head) a chunk
    runs, so after a reshape that moves layers or changes a TP degree, new-layout chunks never meet
    an old-layout fit, and replicas whose same-numbered stages hold different layers never share
    one. Without the plan: ("stage", stage index, virtual stage, kind, TP degree).
    """
    S = int(frame.pp.max()) + 1
    tp_degree = np.bincount(frame.dp * S + frame.pp)[frame.dp * S + frame.pp]
    known = frame.first_layer >= 0
    L = int(frame.end_layer.max()) + 2 if known.any() else 1
    # per rank: a layer-range code when known, else the stage index offset past every range code
    where = np.where(known, frame.first_layer * L + frame.end_layer, L * L + frame.pp)
    V = int(frame.c_vs.max()) + 1 if len(frame.c_vs) else 1
    T = int(tp_degree.max()) + 1
    key = ((where[frame.c_rank] * V + frame.c_vs) * 3 + frame.c_kind) * T + tp_degree[frame.c_rank]
    uniq, c_class = np.unique(key, return_inverse=True)
    keys: list[WorkClass] = []
    for k in uniq.tolist():
        rest, tpd = divmod(int(k), T)
        rest, kind = divmod(rest, 3)
        code, vs = divmod(rest, V)
        if code >= L * L:
            keys.append(("stage", code - L * L, vs, kind, tpd))
        else:
            first, end = divmod(code, L)
            keys.append(("layers", first, end, vs, kind, tpd))
    return c_class.reshape(-1), keys


def unit_ids(frame: IterationFrame) -> np.ndarray:
    """Work unit per chunk: the TP ranks of one (replica, stage) running one micro-batch chunk.
    Dense mixed-radix ids (some may be unused), so no sort is needed."""
    S = int(frame.pp.max()) + 1
    V = int(frame.c_vs.max()) + 1 if len(frame.c_vs) else 1
    M = int(frame.c_mb.max()) + 1 if len(frame.c_mb) else 1
    return (((frame.dp[frame.c_rank] * S + frame.pp[frame.c_rank]) * V + frame.c_vs) * 3 + frame.c_kind) * M + frame.c_mb


def _sort_groups(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Finite values sorted by (group id, value), with each group's [start, end) — one float argsort.

    A value that is not finite (NaN: not judged, no prediction, a partner with nothing measured)
    is left out, so it is never read as the slowest of its group: a group of one finite value and
    one NaN has that value as its median, and a group of NaNs has no entry at all (its statistic
    stays NaN, "not judged").

    The sort key is ``id + (value - min) / span`` scaled into [id, id + 1): one argsort of a float
    array instead of a two-key lexsort (about 3x faster at 30k chunks). Values closer than about
    1e-9 of the span may swap places, which no median or quantile here can notice."""
    v = np.asarray(values, float)
    finite = np.isfinite(v)
    if not finite.all():
        ids, v = np.asarray(ids)[finite], v[finite]
    if len(v) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, np.zeros(0), empty, empty
    lo = float(v.min())
    span = float(v.max()) - lo
    frac = (v - lo) / (span * (1 + 1e-9) if span > 0 else 1.0)
    order = np.argsort(ids + np.clip(frac, 0.0, 0.999999), kind="stable")
    ids_s, v_s = ids[order], v[order]
    starts = np.flatnonzero(np.r_[True, ids_s[1:] != ids_s[:-1]])
    ends = np.r_[starts[1:], len(ids_s)]
    return ids_s, v_s, starts, ends


def group_median(ids: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` per group id (NaN for empty groups)."""
    return group_quantile(ids, values, n_groups, 0.5)


def group_quantile_low(ids: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Lower quartile of ``values`` per group id (the lower of the two middle order statistics)."""
    out = np.full(n_groups, np.nan)
    if len(ids) == 0:
        return out
    ids_s, v_s, starts, ends = _sort_groups(ids, values)
    out[ids_s[starts]] = v_s[starts + (ends - starts - 1) // 4]
    return out


def group_quantile(ids: np.ndarray, values: np.ndarray, n_groups: int, q: float) -> np.ndarray:
    """The ``q`` quantile (linear interpolation) of ``values`` per group id (NaN for empty groups)."""
    out = np.full(n_groups, np.nan)
    if len(ids) == 0:
        return out
    ids_s, v_s, starts, ends = _sort_groups(ids, values)
    pos = starts + q * (ends - starts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, ends - 1)
    frac = pos - lo
    out[ids_s[starts]] = v_s[lo] * (1 - frac) + v_s[hi] * frac
    return out


def unit_own_time(units: np.ndarray, own_s: np.ndarray, n_units: int) -> np.ndarray:
    """A work unit's own time for the fit: the *largest* own time among its TP ranks (NaN if none).

    Why not the median: a TP rank's own time can only be under-measured, never over-measured by its
    peers. Own time is the chunk's duration minus the TP all-reduce waits inside it; when a peer
    starts late (its input came from a slow rank) or runs slow, the waiting rank's wait also
    swallows time that was really its compute (on the torch trainer with device pacing, its whole
    padding: own ≈ 2 ms against ≈ 30 ms healthy). At TP 2 the median is the mean of the two, so one
    such rank halves the row, and a class whose replicas disagree by 2-15× has no majority for the
    robust fit to side with. The group finishes when its slowest member does, so the maximum is the
    group's work; a member slow by its own fault is kept out by the caller (suspects' whole TP
    groups are left out of the fit, ``fit_ranks``). Preemption biases the maximum up a little,
    alike for every unit of a class (the TP degree is part of the class), so ranks are still
    judged fairly against it."""
    return group_quantile(units, own_s, n_units, 1.0)


def fit_ranks(frame: IterationFrame, suspects: set[int]) -> np.ndarray:
    """Ranks whose chunks may teach the cost model: not suspected, and no suspect in their TP group.

    A suspect's TP peers wait for it inside their chunks, so their own times are entangled with the
    suspect's (see ``unit_own_time``); their rows would drag the class's line towards a few
    milliseconds, and every healthy replica sharing the class would then look ×5-×20 slow (the
    torch demo's false TP-group incident after a reshape), and the stale fit would carry into later
    epochs (classes keyed by layer range survive reshapes)."""
    if not suspects:
        return np.ones(frame.num_ranks, dtype=bool)
    S = int(frame.pp.max()) + 1
    group = frame.dp * S + frame.pp
    bad = np.isin(frame.rank, np.fromiter(suspects, np.int64, len(suspects)))
    tainted = np.zeros(int(group.max()) + 1, dtype=bool)
    tainted[group[bad]] = True
    return ~tainted[group]


def group_tags(frame: IterationFrame) -> np.ndarray:
    """Per rank row, its TP group's lowest rank: the group a work unit is filed under in the cost
    model's window (``CostModel.forget_groups``), the same group across iterations of a layout."""
    if not frame.num_ranks:
        return np.zeros(0, np.int64)
    S = int(frame.pp.max()) + 1
    group = frame.dp * S + frame.pp
    lowest = np.full(int(group.max()) + 1, np.iinfo(np.int64).max)
    np.minimum.at(lowest, group, frame.rank)
    return lowest[group]


def forget_suspects(model: CostModel, tags: np.ndarray, rank: np.ndarray, suspects: set[int]) -> None:
    """Take the suspects' TP groups' rows out of the model's window once, when they become
    suspects: they taught it while nobody suspected them (``fit_ranks`` keeps them out from then
    on). ``tags``: the group of each rank in ``rank``."""
    now = set(tags[np.isin(rank, np.fromiter(suspects, np.int64, len(suspects)))].tolist()) if suspects else set()
    model.forget_groups(now - model.forgotten)
    model.forgotten = now


def tp_group_max(frame: IterationFrame, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per TP group (replica, stage), the largest finite value among its ranks in ``mask``; one
    entry per group that has any.

    Why groups, not ranks, for the job's centre and for σ: a TP rank's own time is only ever
    under-measured by its peers (``unit_own_time``), so its z has a heavy *fast* tail that is not
    noise — on the paced torch trainer the rank that waited reads ×0.05-×0.5. Ranks pooled one by
    one, those tails pulled the centre down as suspects left the pool (everyone else then looked
    slow: a cascade of incidents) and blew σ up (a slow rank's incident resolved). The group's
    slowest member is its real time, the same quantity the fit is anchored to. At TP 1 a group is
    a rank; with identical TP timings (the simulator) nothing changes."""
    ok = mask & np.isfinite(values)
    if not ok.any():
        return np.zeros(0)
    S = int(frame.pp.max()) + 1
    group = (frame.dp * S + frame.pp)[ok]
    out = np.full(int(group.max()) + 1, -np.inf)
    np.maximum.at(out, group, values[ok])
    return out[np.isfinite(out)]


@dataclass
class UnitTable:
    """One row per work unit of a frame (``unit_ids``): its class, token count, Σ lᵢ², own time
    (``unit_own_time`` over all its TP ranks; NaN for an id no chunk uses) and TP group."""

    units: np.ndarray  # (C,) unit id per chunk
    u_class: np.ndarray  # (U,) index into the frame's class keys
    u_tokens: np.ndarray
    u_s2: np.ndarray
    u_own: np.ndarray
    u_rank: np.ndarray  # (U,) a rank row of the unit (its TP group decides whether it may teach)


def unit_table(frame: IterationFrame, c_class: np.ndarray) -> UnitTable:
    units = unit_ids(frame)
    n_units = int(units.max()) + 1 if len(units) else 0
    u_own = unit_own_time(units, frame.c_own, n_units)
    first = np.zeros(n_units, dtype=np.int64)
    first[units[::-1]] = np.arange(len(units))[::-1]  # a representative chunk per unit
    used = np.zeros(n_units, dtype=bool)
    used[units] = True
    u_own[~used] = np.nan
    return UnitTable(units, c_class[first], frame.c_tokens[first], frame.c_s2[first], u_own, frame.c_rank[first])


def predict_chunks(frame: IterationFrame, model: CostModel, c_class: np.ndarray, keys: list[WorkClass],
                   units: np.ndarray, u_class: np.ndarray, u_tokens: np.ndarray, u_s2: np.ndarray,
                   u_own: np.ndarray, u_group: np.ndarray | None = None) -> tuple[np.ndarray, bool, list[int]]:
    """Every chunk's predicted own time under ``model``'s fits, classes it never saw fitted first
    from this iteration's units (``u_own`` NaN: a unit that may not teach). Returns the
    predictions, whether sequence lengths were inferred, and the unseen classes (already taught).

    Classes the model has never seen are fitted from this very iteration (robustly, across
    replicas), which is what catches a rank slow from its first iteration."""
    unseen = [i for i, k in enumerate(keys) if k not in model.fits]
    for i in unseen:
        sel = (u_class == i) & np.isfinite(u_own)
        model.observe(keys[i], frame.iteration, u_tokens[sel], u_s2[sel], u_own[sel],
                      None if u_group is None else u_group[sel])
    if unseen:
        model.refit()
    return predict_fitted(frame, model, c_class, keys, units, u_own), not frame.has_seq_lens, unseen


def predict_fitted(frame: IterationFrame, model: CostModel, c_class: np.ndarray, keys: list[WorkClass],
                   units: np.ndarray, u_own: np.ndarray) -> np.ndarray:
    """``predict_chunks`` once every class has a fit: the lines, and without sequence lengths each
    class levelled and each micro-batch's mix taken from the units that may teach (``u_own``)."""
    pred = model.predict_classes(keys, c_class, frame.c_tokens, frame.c_s2)
    pred = _layer_scaled_prior(model, keys, c_class, frame, pred)
    if not frame.has_seq_lens:
        pred = _per_microbatch_correction(frame, units, u_own, _class_levels(frame, units, u_own, pred, c_class))
    return pred


def teaching_own(t: UnitTable, clean: np.ndarray) -> np.ndarray:
    """Each unit's own time where its TP group may teach (``fit_ranks``), NaN elsewhere: a group is
    in or out whole, so the unit's own time is the same over its healthy ranks or all of them."""
    return np.where(clean[t.u_rank], t.u_own, np.nan) if len(t.u_rank) else t.u_own


def learn_units(model: CostModel, iteration: int, keys: list[WorkClass], u_class: np.ndarray, u_tokens: np.ndarray,
                u_s2: np.ndarray, u_own: np.ndarray, skip: Collection[int] = (), u_group: np.ndarray | None = None
                ) -> None:
    """Teach ``model`` one iteration's work units of every class but ``skip`` (NaN own time: a
    unit that may not teach), in unit order, each filed under its TP group (``u_group``), then
    refit."""
    live = np.isfinite(u_own)
    order = np.argsort(u_class[live], kind="stable")
    cls_sorted = u_class[live][order]
    bounds = np.searchsorted(cls_sorted, np.arange(len(keys) + 1))
    t_s, s2_s, own_s = u_tokens[live][order], u_s2[live][order], u_own[live][order]
    g_s = u_group[live][order] if u_group is not None else None
    for i, key in enumerate(keys):
        if i not in skip:
            a, b = bounds[i], bounds[i + 1]
            model.observe(key, iteration, t_s[a:b], s2_s[a:b], own_s[a:b], None if g_s is None else g_s[a:b])
    model.refit()


def _layer_scaled_prior(model: CostModel, keys: list[WorkClass], c_class: np.ndarray, frame: IterationFrame,
                        pred: np.ndarray) -> np.ndarray:
    """Predictions for classes still without a fit, from a fitted class of the same virtual stage,
    kind and TP degree, scaled by layer count (nearest layer count wins).

    When does a class stay unfitted: a reshape gave a suspect's TP group a layer range nobody else
    runs (the torch demo's planner moved a layer off the slow rank's stage and kept the rank), and
    suspects' groups teach nothing (``fit_ranks``). Without this the slow rank had no prediction,
    scored as healthy, and its incident resolved after 3 iterations while it was still ×3 slow.
    Approximate (embeddings and the head are not per-layer work), but a slow rank is ×1.5 or more
    off its peers' line, and the class gets its own fit as soon as a clean group runs it."""
    missing = [(i, k) for i, k in enumerate(keys) if k[0] == "layers" and k not in model.fits]
    if not missing:
        return pred
    fitted = [k for k in model.fits if isinstance(k, tuple) and k and k[0] == "layers"]
    for i, (_, first, end, vs, kind, tpd) in missing:
        siblings = [k for k in fitted if k[3:] == (vs, kind, tpd) and k[2] > k[1]]
        if not siblings or end <= first:
            continue
        ref = min(siblings, key=lambda k: (abs((k[2] - k[1]) - (end - first)), abs(k[1] - first)))
        sel = c_class == i
        scale = (end - first) / (ref[2] - ref[1])
        pred[sel] = scale * model.predict(ref, frame.c_tokens[sel], frame.c_s2[sel])
    return pred


def _class_levels(frame: IterationFrame, units: np.ndarray, u_own: np.ndarray, pred: np.ndarray,
                  c_class: np.ndarray) -> np.ndarray:
    """Without sequence lengths: each work class's predictions moved to the class's level in this
    iteration (the median over its clean work units of log(own / predicted)), where at least
    ``MIN_CLASS_PEERS`` TP groups run the class.

    Why: without token counts a class's line is the robust centre of its window, and the classes'
    lines sit off their chunks by different and moving amounts (one class ×1.3 under, another ×2 for
    the eight iterations a few short chunks are in its window). The per-micro-batch correction
    below takes a median over a replica's stages, so with one stage left out (a suspect's TP group)
    that median moved with the other classes' offsets and every healthy stage of the suspect's
    replica read a few per cent to ×1.2 slow (the profiler's interleaved run opened an incident on
    each). Levelled first, the classes agree and the correction keeps only the micro-batch's mix.
    A class run by fewer groups (a DP 1 job) keeps its line: its level would absorb a slow stage."""
    ratio = np.log(np.maximum(u_own[units], 1e-12) / np.maximum(pred, 1e-12))  # NaN where the unit is not fitted
    n_cls = int(c_class.max()) + 1 if len(c_class) else 0
    level = group_median(c_class, ratio, n_cls)
    S = int(frame.pp.max()) + 1
    group = (frame.dp * S + frame.pp)[frame.c_rank]
    fitted = np.isfinite(ratio)
    pairs = np.unique(c_class[fitted] * (int(group.max()) + 1) + group[fitted])
    groups_per_class = np.bincount(pairs // (int(group.max()) + 1), minlength=n_cls)
    level = np.where(np.isfinite(level) & (groups_per_class >= MIN_CLASS_PEERS), level, 0.0)
    return pred * np.exp(level[c_class])


def _per_microbatch_correction(frame: IterationFrame, units: np.ndarray, u_own: np.ndarray,
                               pred: np.ndarray) -> np.ndarray:
    """Without seq_lens the model knows only token counts (or nothing, when those are unknown too).
    One micro-batch runs through every stage of its replica with the same sequences, so its
    attention share shows in all of them alike. Per (replica, micro-batch, kind) the correction is
    the median over stages of the observed/predicted log-ratio, split in two parts:

    - the micro-batch's deviation from its replica's typical micro-batch (the correction minus its
      median over the replica's micro-batches): workload that moves within an iteration, taken out
      of every stage's chunks alike;
    - the replica's level (that median): the replica's whole mix, heavier or lighter than the job's.

    Why the split: the median over stages cannot outvote a slow stage at pipeline depth 2 (it is
    the mean of the two), so a ×f stage would lend half its log to the level and be sized √f. At
    depth 2 or less the level is therefore taken from the job (the median level over replicas),
    whose micro-batch mixes average out, so a slow stage keeps its whole factor; the replica's own
    level differs from the job's only by its mix's sampling noise (σ/√M), which the thresholds'
    noise estimate absorbs. At depth 3 and more the median over stages is robust to one slow stage,
    and the replica keeps its own level (less noise). A DP 1 job at depth 2 has no other replica:
    there the split is not identified from one iteration, and a slow stage reads low (√f) until
    the cost model has learned the stage's line from its own healthy history."""
    M = int(frame.c_mb.max()) + 1
    mb_group = (frame.dp[frame.c_rank] * M + frame.c_mb) * 3 + frame.c_kind
    n_groups = int(mb_group.max()) + 1
    ratio = np.log(np.maximum(u_own[units], 1e-12) / np.maximum(pred, 1e-12))  # NaN where the unit is not fitted
    corr = group_median(mb_group, ratio, n_groups)
    if int(frame.pp.max()) + 1 <= 2:
        groups = np.arange(n_groups)
        rep_kind = groups // (3 * M) * 3 + groups % 3  # the (replica, kind) of each micro-batch group
        level = group_median(rep_kind, corr, int(rep_kind.max()) + 1)
        job_level = group_median(np.arange(len(level)) % 3, level, 3)[rep_kind % 3]
        corr = corr - level[rep_kind] + np.where(np.isfinite(job_level), job_level, level[rep_kind])
    if not np.isfinite(corr).all():
        # A micro-batch none of whose stages taught the fit (every TP group of its replica is under
        # suspicion) takes the job's typical correction for its kind, never none: the bare line can
        # sit far off the chunks (without token counts it is the class's centre over a window), and
        # uncorrected, every healthy stage of that replica read as slow as the line was off (a ×2
        # GPU's replica opened an incident on each of its stages, the profiler's interleaved run).
        kind_of = np.arange(n_groups) % 3
        job_kind = group_median(kind_of, corr, 3)
        corr = np.where(np.isfinite(corr), corr, job_kind[kind_of])
    return pred * np.exp(np.nan_to_num(corr[mb_group]))


def rank_log_ratios(frame: IterationFrame, pred: np.ndarray, chunk_quantile: float | None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, log(own / predicted) overall (R,) and per chunk kind (R, 3), uncentred.

    ``chunk_quantile=None``: the log of summed own time over summed prediction (efficient when noise
    is small and symmetric, as on accelerators). A number q (default 0.5, the median): the q-quantile
    of the chunks' own log-ratios per kind, combined with the kinds' predicted time shares. Why: on
    shared CPUs (the torch trainer, 8 ranks on 2 cores) the OS preempts chunks at random, adding up
    to 30x to a 1 ms chunk; a sum is then decided by whichever chunk was preempted worst, while a
    slow device shifts *every* chunk. The median ignores up to half the chunks being hit and, unlike
    a lower quantile, has no bias that depends on how many chunks a rank ran (replicas may run
    different micro-batch counts after a reshape). Per kind, so that a straggler in one kind (a slow
    backward) is weighed by its share instead of being outvoted by the healthy kinds.
    """
    R = frame.num_ranks
    p = np.nan_to_num(pred)
    if chunk_quantile is None:
        own_sum = np.bincount(frame.c_rank, weights=frame.c_own, minlength=R)
        pred_sum = np.bincount(frame.c_rank, weights=p, minlength=R)
        x = np.where(pred_sum > 0, np.log(np.maximum(own_sum, 1e-12) / np.maximum(pred_sum, 1e-12)), np.nan)
        g = frame.c_rank * 3 + frame.c_kind
        o = np.bincount(g, weights=frame.c_own, minlength=3 * R).reshape(R, 3)
        pk = np.bincount(g, weights=p, minlength=3 * R).reshape(R, 3)
        xk = np.full((R, 3), np.nan)
        has = pk > 0
        xk[has] = np.log(np.maximum(o[has], 1e-12) / pk[has])
        return x, xk
    lr = np.clip(np.log(np.maximum(frame.c_own, 1e-12) / np.maximum(p, 1e-12)), -5.0, 5.0)
    g = frame.c_rank * 3 + frame.c_kind
    ok = p > 0
    xk = group_quantile(g[ok], lr[ok], 3 * R, chunk_quantile).reshape(R, 3)
    share = np.bincount(g, weights=p, minlength=3 * R).reshape(R, 3)
    share = np.where(np.isfinite(xk), share, 0.0)
    total = share.sum(axis=1)
    # a rank none of whose chunks has a prediction is not judged (NaN), rather than judged healthy
    x = np.where(total > 0, np.nansum(np.nan_to_num(xk) * share, axis=1) / np.maximum(total, 1e-300), np.nan)
    return x, xk


def score_frame(frame: IterationFrame, model: CostModel, suspects: set[int],
                chunk_quantile: float | None = None, stand_out: float | None = None) -> FrameScore:
    """Predict, learn from the healthy part, and score every rank and link of one iteration.

    ``stand_out``: a rank whose centred score reaches it (the detector passes its alarm threshold
    h) is scored again as it will be once suspected: without sequence lengths with its TP group
    left out of the medians that predict and centre it (nor does it teach the fit); with them, by
    a fit that never learned from its group."""
    tags = group_tags(frame)
    forget_suspects(model, tags, frame.rank, suspects)
    clean = fit_ranks(frame, suspects)
    c_class, keys = chunk_classes(frame)
    t = unit_table(frame, c_class)
    u_group = tags[t.u_rank] if len(t.u_rank) else np.zeros(0, np.int64)
    u_own = teaching_own(t, clean)
    pred, inferred, unseen = predict_chunks(frame, model, c_class, keys, t.units, t.u_class, t.u_tokens, t.u_s2,
                                            u_own, u_group)
    x, xk = rank_log_ratios(frame, pred, chunk_quantile)
    z, z_by_kind = centre_ranks(frame, x, xk, clean, inferred)
    standing = clean & (np.nan_to_num(z, nan=-np.inf) >= stand_out) if stand_out is not None else None
    if standing is not None and standing.any():
        # only where its class keeps other groups to learn from without it: without lengths
        # enough to level and centre on (a DP 2 job has two: left out, the one remaining would set
        # them alone); with lengths one, whose own rows fit the class's line
        standing &= other_class_groups(frame, clean) >= (MIN_CLASS_PEERS if inferred else 1)
    if standing is not None and standing.any():
        # Without sequence lengths a rank's prediction and centre are medians over its peers'
        # units: its replica's stages (the micro-batch's mix) and its class's TP groups. A rank
        # far slower than its work lifts both medians while it is still among them, and reads
        # low by up to half the healthy stages' spread (a ×2 GPU at the last of 4 stages opened
        # at ×1.80 and read ×1.90 once it was a suspect). With lengths its class's line learned
        # from it until now (from its first iteration, if it was slow from the start): with two
        # groups running the class the line sat between them (a ×1.72 GPU opened at ×1.42).
        # Scored again without it, as it will be once suspected. Without lengths nor does it teach
        # the fit; with them it does, as any rank not yet suspected: if it becomes one, its rows
        # are taken back out (``forget_suspects``), and a rank that stood out by chance keeps
        # teaching its class.
        clean = fit_ranks(frame, suspects | set(frame.rank[standing].tolist()))
        own = teaching_own(t, clean)
        if inferred:
            u_own = own
        fitted = model if inferred else model.without_groups(set(tags[standing].tolist()))
        pred = predict_fitted(frame, fitted, c_class, keys, t.units, own)
        x, xk = rank_log_ratios(frame, pred, chunk_quantile)
        z, z_by_kind = centre_ranks(frame, x, xk, clean, inferred)
    learn_units(model, frame.iteration, keys, t.u_class, t.u_tokens, t.u_s2, u_own, skip=set(unseen), u_group=u_group)
    src, dst, lz, lcls, lwait = centre_links(frame, *link_times(frame))
    return FrameScore(z=z, x=x, z_by_kind=z_by_kind, c_pred=pred, c_class=c_class, class_keys=keys,
                      link_src=src, link_dst=dst, link_z=lz, link_class=lcls, link_waits=lwait, inferred=inferred)


def centre_ranks(frame: IterationFrame, x: np.ndarray, xk: np.ndarray, clean: np.ndarray,
                 inferred: bool) -> tuple[np.ndarray, np.ndarray]:
    """(z, z by kind): the ranks' log-ratios centred on the job — the median over clean TP groups
    of each group's slowest member, per work class when sequence lengths were inferred. Needs only
    the per-rank arrays, so the sharded merge (analytics/sharding/merge.py) runs it on its shards' ``x``."""
    pool = tp_group_max(frame, x, clean)
    if not len(pool):
        pool = x[np.isfinite(x)]
    centre: float | np.ndarray = float(np.median(pool)) if len(pool) else 0.0
    if inferred:
        centre = work_class_centres(frame, x, clean, float(centre))
    c2 = centre[:, None] if isinstance(centre, np.ndarray) else centre
    return x - centre, xk - c2


def _work_codes(frame: IterationFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per rank row, (its TP group id, its work: layer range, or stage without a plan, and TP degree)."""
    S = int(frame.pp.max()) + 1
    group = frame.dp * S + frame.pp
    tp_degree = np.bincount(group)[group]
    L = int(frame.end_layer.max()) + 2
    work = np.where(frame.first_layer >= 0, frame.first_layer * L + frame.end_layer, L * L + frame.pp)
    return group, work * (int(tp_degree.max()) + 1) + tp_degree


def other_class_groups(frame: IterationFrame, clean: np.ndarray) -> np.ndarray:
    """Per rank row, how many clean TP groups other than its own run its work."""
    group, work = _work_codes(frame)
    g_clean = np.zeros(int(group.max()) + 1, dtype=bool)
    g_clean[group[clean]] = True
    g_work = np.full(len(g_clean), -1, np.int64)
    g_work[group] = work
    per_work = {code: n for code, n in zip(*np.unique(g_work[g_clean], return_counts=True))}
    return np.array([per_work.get(w, 0) for w in work.tolist()], np.int64) - g_clean[group]


def chunk_slowdown(frame: IterationFrame, c_pred: np.ndarray, row: int, own_factor: float) -> float:
    """A slowdown of rank row ``row``'s own compute as the slowdown of its chunks, TP communication
    included: the size every dialect reports and the planner reads (it splits a chunk into compute
    and TP communication itself, ``remediation.costs.compute_factor_from_chunks``).

    Why: a source that records the TP all-reduces apart (torch.profiler's ``tp_allreduce``) has
    them taken out of the chunks' own time (``frame.c_own``), so its score is of compute alone; a
    ×3 GPU read ×2.93 there against ×2.77 in chunk time, and the planner, adding TP time back,
    took it for ×3.17. The slow rank's own TP time holds no wait (its peers wait for it).
    Unchanged where nothing was taken out (or the frame holds no chunks: the sharded merge)."""
    if not len(frame.c_rank) or not np.isfinite(own_factor):
        return own_factor
    sel = frame.c_rank == row
    tp_s = float((frame.c_dur[sel] - frame.c_own[sel]).sum())
    own_s = float(np.nansum(c_pred[sel]))
    if tp_s <= 0 or own_s <= 0:
        return own_factor
    return 1.0 + (own_factor - 1.0) * own_s / (own_s + tp_s)


def replica_shared_slowdown(frame: IterationFrame, z: np.ndarray) -> np.ndarray:
    """Per replica (indexed by ``frame.dp``), the part of its slowness that every stage of it
    shares: the least, over its TP groups, of each group's slowest member's ``z`` (NaN for a
    replica with fewer than two stages judged).

    Why: without sequence lengths a micro-batch's mix is read from its other stages, and at
    pipeline depth 2 the level of a whole replica comes from the job (``_per_microbatch_correction``),
    so a replica whose loader packed long documents for a few iterations reads slow on every stage
    at once (×1.3–×1.6 in the long-document bursts of ``resihp bench detect``). A slow GPU slows
    one stage's own compute, never every stage's: what all stages share is the replica's mix."""
    if not len(z):
        return np.zeros(0)
    S = int(frame.pp.max()) + 1
    group = frame.dp * S + frame.pp
    ok = np.isfinite(z)
    gmax = np.full(int(group.max()) + 1, -np.inf)
    np.maximum.at(gmax, group[ok], z[ok])
    D = int(frame.dp.max()) + 1
    least = np.full(D, np.inf)
    stages = np.zeros(D, np.int64)
    live = np.flatnonzero(np.isfinite(gmax))
    np.minimum.at(least, live // S, gmax[live])
    np.add.at(stages, live // S, 1)
    return np.where(stages >= 2, least, np.nan)


MIN_CLASS_PEERS = 3  # TP groups of one work class needed to centre a rank on its own class


def work_class_centres(frame: IterationFrame, x: np.ndarray, clean: np.ndarray, job_centre: float) -> np.ndarray:
    """Per rank, the centre it is judged against: the median, over the clean TP groups that run
    the same work (the same layer range, or stage without a plan, and TP degree), of each group's
    slowest member; the job's centre where fewer than ``MIN_CLASS_PEERS`` groups run it.

    Why, when sequence lengths are not reported: the per-micro-batch correction scales every
    stage of a replica by the same mix, but stages are not equally sensitive to it (the last stage's
    LM head costs per token, the others' attention per Σlᵢ²), so a whole class of stages reads a
    few per cent off the job in every iteration — slow enough, held long enough, to open ×1.04
    incidents on every replica's last stage. The same stage in the other replicas carries the same
    bias; a rank slower than the ranks doing its own work still stands out."""
    group, work = _work_codes(frame)
    ok = clean & np.isfinite(x)
    gmax = np.full(int(group.max()) + 1, -np.inf)
    np.maximum.at(gmax, group[ok], x[ok])
    gwork = np.full(len(gmax), -1, np.int64)
    gwork[group] = work
    live = np.isfinite(gmax)
    out = np.full(len(x), job_centre)
    if not live.any():
        return out
    classes, inv = np.unique(gwork[live], return_inverse=True)
    centres = group_median(inv.reshape(-1), gmax[live], len(classes))
    sizes = np.bincount(inv.reshape(-1), minlength=len(classes))
    pos = np.searchsorted(classes, work)
    found = (pos < len(classes)) & (classes[np.minimum(pos, len(classes) - 1)] == work)
    pos = np.minimum(pos, len(classes) - 1)
    use = found & (sizes[pos] >= MIN_CLASS_PEERS)
    out[use] = centres[pos[use]]
    return out


P2P_OPS = (OP_CODE["pp_send"], OP_CODE["pp_sendrecv"])
MIN_LINK_PEERS = 3  # links of one stage pair needed to centre them on each other


def message_times(frame: IterationFrame, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The p2p records ``sel`` picks (at least one) by link: (link codes ``src · span + dst``, each
    record's link index into them, each record's time per message — per byte when its size is
    known — and ``span``)."""
    src = frame.rank[frame.k_rank[sel]]
    dst = frame.k_peer[sel]
    per = frame.k_dur[sel]
    nbytes = frame.k_bytes[sel]
    per = np.where(np.isfinite(nbytes) & (nbytes > 0), per / np.maximum(nbytes, 1.0), per)
    span = int(max(src.max(), dst.max())) + 1
    pairs, inv = np.unique(src * span + dst, return_inverse=True)
    return pairs, inv.reshape(-1), per, span


def link_times(frame: IterationFrame) -> tuple[np.ndarray, ...]:
    """Per link with p2p send records (``pp_send``, or a fused ``pp_sendrecv``): (src device, dst
    device, log time per message, source stage, destination stage, timers hold waits), uncentred.

    A link's time is the lower quartile over its messages of the time per message (per byte when
    sizes are known), so that messages that waited for the peer count less; for timers that hold
    the wait (``includes_wait``) it is the fastest message, the one closest to the wire alone. It
    needs only the sending rank's own records and its pipeline's stages, so a shard holding the
    replica computes it; ``centre_links`` compares links across the job."""
    sel = np.isin(frame.k_op, P2P_OPS) & (frame.k_peer >= 0)
    if not sel.any():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0), empty, empty, np.zeros(0, dtype=bool)
    pairs, inv, per, span = message_times(frame, sel)
    waits = np.zeros(len(pairs), dtype=bool)
    np.logical_or.at(waits, inv, frame.k_wait[sel])
    # a timer that holds the wait: the fastest message is the one that waited least (the wire's
    # time, or closest to it); otherwise the lower quartile, robust to one slow message
    q = np.where(waits, group_quantile(inv, per, len(pairs), 0.0), group_quantile_low(inv, per, len(pairs)))
    lq = np.log(np.maximum(q, 1e-15))
    p_src, p_dst = pairs // span, pairs % span
    # stage pair of each link: the destination's stage from its own report, else "the next one"
    stage_of = np.full(span, -1, np.int64)
    known = frame.rank < span
    stage_of[frame.rank[known]] = frame.pp[known]
    s_src = stage_of[p_src]
    s_dst = np.where(stage_of[p_dst] >= 0, stage_of[p_dst], s_src + 1)
    return p_src, p_dst, lq, s_src, s_dst, waits


def centre_links(frame: IterationFrame, p_src: np.ndarray, p_dst: np.ndarray, lq: np.ndarray, s_src: np.ndarray,
                 s_dst: np.ndarray, waits: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src device, dst device, centred log per-message time, stage-pair code, timers hold waits)
    for every link with p2p send records (``pp_send``, or a fused ``pp_sendrecv``); a link that
    cannot be judged this iteration has NaN.

    Each link's time (``link_times``) is centred on the links that do the same work in the
    schedule: the same stage pair (source stage, destination stage) in the other replicas and TP
    ranks. Why not on the median link: a send timer holds some
    of the wait for the peer, and a fused send+recv timer (Megatron's) holds all of it — the
    pipeline bubble lands in it — so the links out of a stage that waits are slower than the
    median link in every healthy iteration, and centred on it they all looked slow. The same stage
    pair in another replica waits the same way, so only a slower wire (or a slower peer, which the
    detector conditions on separately) stands out.

    With fewer than ``MIN_LINK_PEERS`` links of a stage pair (DP 1 and one traced rank per TP
    group), a link whose timers hold waits cannot be told apart from its wait in one iteration and
    is not judged (NaN); timers of the wire alone (``includes_wait`` false) are centred on the
    median link, whose wait they do not carry."""
    if len(lq) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0), empty, np.zeros(0, dtype=bool)
    S = int(frame.pp.max()) + 2
    cls = (s_src + 1) * (S + 1) + (s_dst + 1)
    uniq, c_inv = np.unique(cls, return_inverse=True)
    c_inv = c_inv.reshape(-1)
    size = np.bincount(c_inv, minlength=len(uniq))
    centre = group_median(c_inv, lq, len(uniq))[c_inv]
    peers = size[c_inv] >= MIN_LINK_PEERS
    z = np.where(peers, lq - centre, np.where(waits, np.nan, lq - np.median(lq)))
    return p_src, p_dst, z, cls, waits
