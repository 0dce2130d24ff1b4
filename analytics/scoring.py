"""Per-rank and per-link scores of one iteration: observed against the cost model's prediction.

For every rank, ``x = log(Σ own compute / Σ predicted)`` over its chunks, then centred on the
job's median rank (``z = x − median x``), so a slowdown shared by the whole job (a model that
drifted, a slower data mix) is not blamed on anyone, while one rank slower than the work it was
given stands out — from the first iteration on, because the prediction comes from its peers
(other replicas and TP ranks of the same work class), not from its own history.

Links are scored on the point-to-point sends a rank reports: the time of one message (per byte
when sizes are known) over the link, taken at its lower quartile over the iteration's messages so
that the part of a send spent waiting for the peer to be ready does not count, centred on the
median link.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from analytics.cost_model import CostModel
from analytics.frame import OP_CODE, IterationFrame


@dataclass
class FrameScore:
    z: np.ndarray  # (R,) centred log-ratio per rank
    x: np.ndarray  # (R,) raw log-ratio per rank
    z_by_kind: np.ndarray  # (R, 3) centred log-ratio per rank and chunk kind (NaN if none)
    c_pred: np.ndarray  # (C,) predicted own time per chunk
    c_class: np.ndarray  # (C,) index into class_keys
    class_keys: list[Hashable]
    link_src: np.ndarray  # (L,) device ids
    link_dst: np.ndarray
    link_z: np.ndarray  # (L,) centred log time per message
    inferred: bool  # True when seq_lens were missing and per-micro-batch inference filled in


def chunk_classes(frame: IterationFrame) -> tuple[np.ndarray, list[Hashable]]:
    """Work class per chunk: (stage, virtual stage, kind, TP degree of the rank's stage)."""
    S = int(frame.pp.max()) + 1
    tp_degree = np.bincount(frame.dp * S + frame.pp)[frame.dp * S + frame.pp]
    V = int(frame.c_vs.max()) + 1 if len(frame.c_vs) else 1
    T = int(tp_degree.max()) + 1
    key = ((frame.pp[frame.c_rank] * V + frame.c_vs) * 3 + frame.c_kind) * T + tp_degree[frame.c_rank]
    uniq, c_class = np.unique(key, return_inverse=True)
    keys: list[Hashable] = []
    for k in uniq.tolist():
        rest, tpd = divmod(k, T)
        rest, kind = divmod(rest, 3)
        stage, vs = divmod(rest, V)
        keys.append((stage, vs, kind, tpd))
    return c_class.reshape(-1), keys


def unit_ids(frame: IterationFrame) -> np.ndarray:
    """Work unit per chunk: the TP ranks of one (replica, stage) running one micro-batch chunk.
    Dense mixed-radix ids (some may be unused), so no sort is needed."""
    S = int(frame.pp.max()) + 1
    V = int(frame.c_vs.max()) + 1 if len(frame.c_vs) else 1
    M = int(frame.c_mb.max()) + 1 if len(frame.c_mb) else 1
    return (((frame.dp[frame.c_rank] * S + frame.pp[frame.c_rank]) * V + frame.c_vs) * 3 + frame.c_kind) * M + frame.c_mb


def group_median(ids: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` per group id (NaN for empty groups), with one lexsort."""
    out = np.full(n_groups, np.nan)
    if len(ids) == 0:
        return out
    order = np.lexsort((values, ids))
    ids_s, v_s = ids[order], values[order]
    starts = np.flatnonzero(np.r_[True, ids_s[1:] != ids_s[:-1]])
    ends = np.r_[starts[1:], len(ids_s)]
    lo = v_s[starts + (ends - starts - 1) // 2]
    hi = v_s[starts + (ends - starts) // 2]
    out[ids_s[starts]] = 0.5 * (lo + hi)
    return out


def group_quantile_low(ids: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Lower quartile of ``values`` per group id."""
    out = np.full(n_groups, np.nan)
    if len(ids) == 0:
        return out
    order = np.lexsort((values, ids))
    ids_s, v_s = ids[order], values[order]
    starts = np.flatnonzero(np.r_[True, ids_s[1:] != ids_s[:-1]])
    ends = np.r_[starts[1:], len(ids_s)]
    out[ids_s[starts]] = v_s[starts + (ends - starts - 1) // 4]
    return out


def fit_and_predict(frame: IterationFrame, model: CostModel, healthy_rank: np.ndarray,
                    c_class: np.ndarray, keys: list[Hashable]) -> tuple[np.ndarray, bool]:
    """Predict every chunk's own time, then teach the model this iteration's healthy work units.

    Classes the model has never seen are fitted from this very iteration first (robustly, across
    replicas), which is what catches a rank slow from its first iteration. Returns the predictions
    and whether per-micro-batch inference stood in for missing seq_lens.
    """
    units = unit_ids(frame)
    n_units = int(units.max()) + 1 if len(units) else 0
    ok = healthy_rank[frame.c_rank]
    u_own = group_median(units[ok], frame.c_own[ok], n_units)
    first = np.zeros(n_units, dtype=np.int64)
    first[units[::-1]] = np.arange(len(units))[::-1]  # a representative chunk per unit
    used = np.zeros(n_units, dtype=bool)
    used[units] = True
    u_own[~used] = np.nan
    u_class, u_tokens, u_s2 = c_class[first], frame.c_tokens[first], frame.c_s2[first]
    unseen = [i for i, k in enumerate(keys) if k not in model.fits]
    for i in unseen:
        sel = (u_class == i) & np.isfinite(u_own)
        model.observe(keys[i], frame.iteration, u_tokens[sel], u_s2[sel], u_own[sel])
    if unseen:
        model.refit()
    pred = np.empty(len(frame.c_kind))
    for i, key in enumerate(keys):
        sel = c_class == i
        pred[sel] = model.predict(key, frame.c_tokens[sel], frame.c_s2[sel])
    inferred = not frame.has_seq_lens
    if inferred:
        pred = _per_microbatch_correction(frame, units, u_own, pred)
    unseen_set = set(unseen)
    for i, key in enumerate(keys):
        if i not in unseen_set:
            sel = (u_class == i) & np.isfinite(u_own)
            model.observe(key, frame.iteration, u_tokens[sel], u_s2[sel], u_own[sel])
    model.refit()
    return pred, inferred


def _per_microbatch_correction(frame: IterationFrame, units: np.ndarray, u_own: np.ndarray,
                               pred: np.ndarray) -> np.ndarray:
    """Without seq_lens the model knows only token counts. One micro-batch runs through every stage
    of its replica with the same sequences, so its attention share shows in all of them alike:
    scale each prediction by the median (over stages) observed/predicted ratio of its micro-batch."""
    mb_group = (frame.dp[frame.c_rank] * (frame.c_mb.max() + 1) + frame.c_mb) * 3 + frame.c_kind
    ratio = np.log(np.maximum(u_own[units], 1e-12) / np.maximum(pred, 1e-12))
    corr = group_median(mb_group, ratio, int(mb_group.max()) + 1)
    return pred * np.exp(np.nan_to_num(corr[mb_group]))


def score_frame(frame: IterationFrame, model: CostModel, suspects: set[int]) -> FrameScore:
    """Predict, learn from the healthy part, and score every rank and link of one iteration."""
    healthy_rank = ~np.isin(frame.rank, np.fromiter(suspects, np.int64, len(suspects)))
    c_class, keys = chunk_classes(frame)
    pred, inferred = fit_and_predict(frame, model, healthy_rank, c_class, keys)
    R = frame.num_ranks
    own_sum = np.bincount(frame.c_rank, weights=frame.c_own, minlength=R)
    pred_sum = np.bincount(frame.c_rank, weights=np.nan_to_num(pred), minlength=R)
    x = np.log(np.maximum(own_sum, 1e-12) / np.maximum(pred_sum, 1e-12))
    centre = float(np.median(x[healthy_rank])) if healthy_rank.any() else float(np.median(x))
    z = x - centre
    z_kind = np.full((R, 3), np.nan)
    for k in range(3):
        sel = frame.c_kind == k
        if sel.any():
            o = np.bincount(frame.c_rank[sel], weights=frame.c_own[sel], minlength=R)
            p = np.bincount(frame.c_rank[sel], weights=np.nan_to_num(pred[sel]), minlength=R)
            has = p > 0
            z_kind[has, k] = np.log(np.maximum(o[has], 1e-12) / p[has]) - centre
    src, dst, lz = score_links(frame)
    return FrameScore(z=z, x=x, z_by_kind=z_kind, c_pred=pred, c_class=c_class, class_keys=keys,
                      link_src=src, link_dst=dst, link_z=lz, inferred=inferred)


def score_links(frame: IterationFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src device, dst device, centred log per-message time) for every link with pp_send records."""
    sel = (frame.k_op == OP_CODE["pp_send"]) & (frame.k_peer >= 0)
    if not sel.any():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    src = frame.rank[frame.k_rank[sel]]
    dst = frame.k_peer[sel]
    per = frame.k_dur[sel]
    nbytes = frame.k_bytes[sel]
    per = np.where(np.isfinite(nbytes) & (nbytes > 0), per / np.maximum(nbytes, 1.0), per)
    span = int(max(src.max(), dst.max())) + 1
    pairs, inv = np.unique(src * span + dst, return_inverse=True)
    inv = inv.reshape(-1)
    q = group_quantile_low(inv, per, len(pairs))
    lq = np.log(np.maximum(q, 1e-15))
    return pairs // span, pairs % span, lq - np.median(lq)
