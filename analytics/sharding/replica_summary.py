"""A replica's iteration reduced to what judging the job needs: scored on its shard, reassembled at the merge.

Why: at 100k ranks a frame holds ~3M chunks; decoding and scoring them in one process takes
seconds per iteration. Almost all of that is per replica. What is job-wide is small: the cost
model's fit (a few rows per class suffice), the centre the ranks are judged against (one number
per TP group), the links' centres (one per stage pair), and the CUSUMs over per-rank scores.

So the split follows the single process's own order (analytics/detection/scoring.py):

* the shard predicts the replica's chunks with the merge's fits of the job's previous iteration
  (``DetectorFits``) — the single process predicts with the same fits, taught by iterations before
  this one — and sends per rank the uncentred log-ratio of own compute to the prediction, per link
  its uncentred time, per work unit its cost-model row, and the replica's critical paths;
* the merge centres ranks and links across the job, runs the unchanged judgement
  (``Detector.judge``), and teaches its cost model the units of the TP groups it does not suspect —
  the rows the single process would teach — then publishes the fits for the next iteration.

Where the two differ: a class the fits do not hold yet (the job's first iteration, a layout's new
layer range) is fitted by the shard from its own replicas' units of this iteration, not the job's;
without sequence lengths the per-micro-batch correction levels classes over the shard's replicas,
not the job's; the merge's rows are thinned per replica (the window keeps ``MAX_FIT_ROWS`` either
way); the predicted iteration's p2p time is each replica's own lower quartile, not the job's; and
time lost on ranks nobody traces is sized by the iteration's excess until a probe names the rank
(the merge holds no chunks to lay out per stage); and with sequence lengths a rank that stands
out is scored again by the single process with a fit that never learned from its group, not by
the merge (it would need the shard's chunks): a rank slow from a class's first iteration opens
there at the fit's size until its rows leave the window, which both do once it is a suspect.
``resihp bench shards`` measures the difference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from analytics.detection.cost_model import MAX_FIT_ROWS, ClassFit, CostModel
from analytics.detection.frame import IterationFrame, LayerLookup
from analytics.detection.prediction import bounded_stage_rows, predicted_iterations_s, predicted_stage_spans
from analytics.detection.scoring import (
    FrameScore, WorkClass, centre_links, centre_ranks, chunk_classes, link_times, predict_chunks, rank_log_ratios,
    unit_table,
)
from analytics.detection.untraced import traced_pipeline_s
from collector.events import DetectorFits, PackedArrays, ReplicaSummary

RANK_ARRAYS = ("rank", "tp", "pp", "dp", "cp", "node")
LINK_ARRAYS = ("l_src", "l_dst", "l_time", "l_stage_src", "l_stage_dst", "l_waits")
UNIT_ARRAYS = ("u_class", "u_tokens", "u_s2", "u_own", "u_rank")
SCORE_ARRAYS = ("x", "x_f", "x_b", "x_w", "own_s", "pred_s")
INT32 = frozenset({*RANK_ARRAYS, "l_src", "l_dst", "l_stage_src", "l_stage_dst", "u_class", "u_rank", "kind", "epoch",
                   "iteration", "s_stage"})
LIVENESS_ARRAYS = ("kind", "rank", "epoch", "iteration", "time_s", "interval_s")  # LivenessBatch
FLOAT32 = frozenset({"x_f", "x_b", "x_w", "own_s", "pred_s"})  # read only for an incident's evidence and note


Dtype = Literal["<f8", "<f4", "<i4", "<i1"]


def pack(arrays: dict[str, np.ndarray]) -> tuple[list[tuple[str, Dtype, int]], bytes]:
    """(layout, blob) of a PackedArrays payload: device ids and codes as int32, flags as int8, what only an incident's
    evidence reads as float32, the rest (what the CUSUMs and the fit read) float64."""
    layout: list[tuple[str, Dtype, int]] = []
    parts = []
    for name, a in arrays.items():
        dtype: Dtype = ("<i4" if name in INT32 else "<i1" if name == "l_waits" else "<f4" if name in FLOAT32
                 else "<f8")
        parts.append(np.ascontiguousarray(a, dtype=dtype).tobytes())
        layout.append((name, dtype, len(a)))
    return layout, b"".join(parts)


def unpack(layout: Sequence[tuple[str, str, int]], blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of a PackedArrays payload, read-only views of its blob (decode checked the lengths)."""
    out, at = {}, 0
    for name, dtype, n in layout:
        out[name] = np.frombuffer(blob, dtype=dtype, count=n, offset=at)
        at += n * np.dtype(dtype).itemsize
    return out


def unpack_all(parts: Sequence[PackedArrays], names: Iterable[str]) -> dict[str, np.ndarray]:
    """Each named array of every part, concatenated in part order (KeyError when a part lacks one).

    Why not ``unpack`` per part: the merge joins 781 summaries an iteration, 25 arrays each, and
    ~20k small reads and concatenations were most of its judging. Parts that share one layout (a
    uniform plan: every replica sends the same shapes) are joined as one block of bytes, a row per
    part, and each array is cut out of the block at once; the values and their order are the same."""
    names = list(names)
    if not parts:
        return {n: np.zeros(0) for n in names}
    layout = parts[0].layout
    if any(p.layout != layout for p in parts):
        decoded = [unpack(p.layout, p.blob) for p in parts]
        return {n: np.concatenate([d[n] for d in decoded]) for n in names}
    block = np.frombuffer(b"".join(p.blob for p in parts), np.uint8).reshape(len(parts), -1)
    out, at = {}, 0
    for name, dtype, n in layout:
        size = n * np.dtype(dtype).itemsize
        if name in names:
            out[name] = np.ascontiguousarray(block[:, at:at + size]).view(dtype).reshape(-1)
        at += size
    return {n: out[n] for n in names}


STAGE_ARRAYS = ("s_stage", "s_observed", "s_predicted")
SUMMARY_ARRAY_GROUPS = ((*RANK_ARRAYS, *SCORE_ARRAYS), LINK_ARRAYS, UNIT_ARRAYS, STAGE_ARRAYS)


def summary_shape_problem(p: ReplicaSummary) -> str | None:
    """What makes a summary's arrays unusable, or None: every array the merge joins must be there,
    the rank rows ``p.ranks`` long, and each group of per-link, per-unit and per-stage arrays of one
    length. A summary of another build (an array renamed or missing) decodes, since its blob matches
    its own layout, but the merge would raise on it or misalign ranks and links."""
    lengths = {name: n for name, _, n in p.layout}
    for group in SUMMARY_ARRAY_GROUPS:
        missing = [n for n in group if n not in lengths]
        if missing:
            return f"arrays {missing} missing"
        sizes = {lengths[n] for n in group}
        if len(sizes) > 1:
            return f"arrays {list(group)} of different lengths {sorted(sizes)}"
    if lengths["rank"] != p.ranks:
        return f"{lengths['rank']} rank rows but ranks={p.ranks}"
    return None


def array_lengths(parts: Sequence[PackedArrays], name: str) -> np.ndarray:
    """Per part, the length of its array ``name`` (0 when its layout has none); read once when
    every part has the same layout (a uniform plan's replicas), as the merge's 781 summaries do."""
    if not parts:
        return np.zeros(0, np.int64)
    layout = parts[0].layout
    if all(p.layout == layout for p in parts):
        return np.full(len(parts), next((n for a, _, n in layout if a == name), 0), np.int64)
    return np.array([next((n for a, _, n in p.layout if a == name), 0) for p in parts], np.int64)


def fits_model(fits: DetectorFits | None, window_iterations: int) -> CostModel:
    """A scratch cost model holding the merge's fits (the shard teaches it nothing it keeps)."""
    model = CostModel(window_iterations)
    for key, alpha, beta, gamma, uses_s2 in (fits.classes if fits is not None else []):
        model.fits[tuple(key)] = ClassFit(alpha=alpha, beta=beta, gamma=gamma, has_seq_lens=uses_s2)
    return model


def fits_event(model: CostModel, epoch: int, iteration: int, planned: Iterable[int], dead: Iterable[int]
               ) -> DetectorFits:
    return DetectorFits(epoch=epoch, iteration=iteration, planned_epochs=sorted(planned), dead=sorted(dead), classes=[
        (list(k), f.alpha, f.beta, f.gamma, f.has_seq_lens) for k, f in model.fits.items() if isinstance(k, tuple)])


def _thin(u_class: np.ndarray, live: np.ndarray, per_class: int | None) -> np.ndarray:
    """Indices of the unit rows to send: every live one, or per class at most ``per_class`` of
    them evenly spread (as the cost model thins its window). Every class at once: a numpy pass per
    class (a replica has some 30) cost four times this."""
    idx = np.flatnonzero(live)
    if per_class is None or not len(idx):
        return idx
    grouped = idx[np.argsort(u_class[idx], kind="stable")]  # class by class, each in row order
    cls = u_class[grouped]
    starts = np.flatnonzero(np.concatenate(([True], cls[1:] != cls[:-1])))
    lengths = np.diff(np.append(starts, len(cls)))
    big = lengths > per_class
    keep = np.repeat(~big, lengths)  # a class of per_class rows or fewer sends every one
    # per larger class, the rows np.linspace(0, rows - 1, per_class) picks (one column per class)
    keep[(starts[big] + np.linspace(0, lengths[big] - 1, per_class).astype(np.int64)).ravel()] = True
    return np.sort(grouped[keep])


def summarize_replica(frame: IterationFrame, fits: DetectorFits | None, *, window_iterations: int,
                      chunk_quantile: float | None, schedule: tuple[str | None, int | None] = (None, None),
                      replicas: int | None = None, replica: int | None = None, shard: str = "") -> ReplicaSummary:
    """Score one replica's frame (its layer ranges set from the plan when known) with the merge's
    fits. ``replicas``: the job's replica count under the plan, which sizes the unit rows sent."""
    model = fits_model(fits, window_iterations)
    c_class, keys = chunk_classes(frame)
    t = unit_table(frame, c_class)
    pred, inferred, _ = predict_chunks(frame, model, c_class, keys, t.units, t.u_class, t.u_tokens, t.u_s2, t.u_own)
    x, xk = rank_log_ratios(frame, pred, chunk_quantile)
    per_class = None if not replicas else max(1, math.ceil(MAX_FIT_ROWS / window_iterations / replicas))
    rows = _thin(t.u_class, np.isfinite(t.u_own), per_class)
    arrays = {name: getattr(frame, name) for name in RANK_ARRAYS}
    arrays.update(x=x, x_f=xk[:, 0], x_b=xk[:, 1], x_w=xk[:, 2],
                  own_s=np.bincount(frame.c_rank, weights=frame.c_own, minlength=frame.num_ranks),
                  pred_s=np.bincount(frame.c_rank, weights=np.nan_to_num(pred), minlength=frame.num_ranks),
                  u_class=t.u_class[rows], u_tokens=t.u_tokens[rows], u_s2=t.u_s2[rows], u_own=t.u_own[rows],
                  u_rank=frame.rank[t.u_rank[rows]])
    arrays.update(zip(LINK_ARRAYS, link_times(frame)))
    stage_rows = predicted_stage_spans(frame, pred)  # at most the replica's stages: under the bound, every one
    arrays.update(s_stage=np.array([r[1] for r in stage_rows]), s_observed=np.array([r[2] for r in stage_rows]),
                  s_predicted=np.array([r[3] for r in stage_rows]))
    layout, blob = pack(arrays)
    dp_sel = frame.k_op == 3  # OP_CODE["dp_allreduce"]
    dp_waits = np.bincount(frame.k_rank[dp_sel], weights=frame.k_dur[dp_sel], minlength=frame.num_ranks)
    explained, pipeline = predicted_iterations_s(frame, [(frame.c_own, False), (pred, True)], *schedule)
    first = (frame.c_kind == 0) & (frame.c_vs == 0) & (frame.pp[frame.c_rank] == 0) & (frame.tp[frame.c_rank] == 0)
    span = traced_pipeline_s(frame)
    return ReplicaSummary(
        epoch=frame.epoch, iteration=frame.iteration, replica=int(frame.dp[0]) if replica is None else replica,
        ranks=frame.num_ranks, shard=shard, fits_from=(fits.epoch, fits.iteration) if fits is not None else None,
        inferred=inferred, explained_s=explained if math.isfinite(explained) else None,
        pipeline_s=pipeline if math.isfinite(pipeline) else None,
        dp_wait_s=float(dp_waits.min()) if len(dp_waits) else 0.0, tokens=int(np.nansum(frame.c_tokens[first])),
        wall_s=float(frame.wall_s.max()), span_s=span if math.isfinite(span) else None,
        class_keys=json.dumps([list(k) for k in keys]),
        layout=layout, blob=blob)


@dataclass
class SummaryFacts:
    """IterationFacts (analytics/detection/facts.py) from the replicas' summaries."""

    own_s: np.ndarray
    pred_s: np.ndarray
    explained_s: float
    pipeline_s: float
    tokens: int
    stages: list[tuple[int, int, float, float]]
    span_s: float


@dataclass
class ReplicaJobView:
    """The job's iteration as the merge sees it, assembled from its replicas' summaries (not the
    console's ``JobView``): a frame of rank rows only, the ranks' uncentred
    scores, the links' uncentred times, the unit rows, and the facts judging needs."""

    frame: IterationFrame
    x: np.ndarray
    xk: np.ndarray
    links: tuple[np.ndarray, ...]
    u_keys: list[WorkClass]
    u_class: np.ndarray
    u_tokens: np.ndarray
    u_s2: np.ndarray
    u_own: np.ndarray
    u_rank: np.ndarray
    facts: SummaryFacts
    inferred: bool

    def score(self, clean: np.ndarray) -> FrameScore:
        """Centred across the job; ``clean``: the rank rows whose TP groups may set the centre."""
        z, zk = centre_ranks(self.frame, self.x, self.xk, clean, self.inferred)
        src, dst, lz, cls, waits = centre_links(self.frame, *self.links)
        empty = np.zeros(0, np.int64)
        return FrameScore(z=z, x=self.x, z_by_kind=zk, c_pred=np.zeros(0), c_class=empty, class_keys=[],
                          link_src=src, link_dst=dst, link_z=lz, link_class=cls, link_waits=waits,
                          inferred=self.inferred)


_INT = np.int64


def replica_job_view(epoch: int, iteration: int, parts: Sequence[ReplicaSummary],
                     layers: LayerLookup | None) -> ReplicaJobView:
    """The replicas' summaries as one job, rank rows sorted by rank (as ``build_frame`` sorts them)."""
    cols = unpack_all(parts, [n for group in SUMMARY_ARRAY_GROUPS for n in group])
    replica, ranks, wall, dp_waits, explained_s, pipeline_s, tokens, inferred = zip(*(
        (p.replica, p.ranks, p.wall_s, p.dp_wait_s, p.explained_s, p.pipeline_s, p.tokens, p.inferred)
        for p in parts)) if parts else ((),) * 8
    # a replica's wall time is its slowest rank's: judging reads only the job's slowest
    cols["wall_s"] = np.repeat(np.array(wall, float), ranks)
    keys: dict[WorkClass, int] = {}
    local_of: dict[str, np.ndarray] = {}  # replicas mostly share their class list: map each list once
    for p in parts:  # each replica's class indices into one job-wide key list
        if p.class_keys not in local_of:
            local_of[p.class_keys] = np.array([keys.setdefault(tuple(k), len(keys)) for k in json.loads(p.class_keys)],
                                              _INT)
    u_class = cols["u_class"].astype(_INT)
    if len(local_of) > 1:
        cuts = np.cumsum(array_lengths(parts, "u_class"))[:-1]
        u_class = np.concatenate([local_of[p.class_keys][c] if len(local_of[p.class_keys]) else c
                                  for p, c in zip(parts, np.split(u_class, cuts))])
    elif local_of and len(shared := next(iter(local_of.values()))):
        u_class = shared[u_class]
    rank = cols["rank"].astype(_INT)
    # Rank rows sorted by rank. Replicas arrive in replica order and a uniform plan numbers ranks
    # replica by replica, so they usually are already: then no row is moved (a stable sort would
    # leave every one where it is).
    order = None if bool(np.all(rank[1:] >= rank[:-1])) else np.argsort(rank, kind="stable")

    def rows(a: np.ndarray) -> np.ndarray:
        return a if order is None else a[order]

    rank = rows(rank)
    n = len(rank)
    first, end = (np.full(n, -1, _INT), np.full(n, -1, _INT)) if layers is None else layers.ranges(rank)
    e_i, e_f = np.zeros(0, _INT), np.zeros(0)
    frame = IterationFrame(
        epoch=epoch, iteration=iteration, rank=rank, tp=rows(cols["tp"].astype(_INT)),
        pp=rows(cols["pp"].astype(_INT)), dp=rows(cols["dp"].astype(_INT)), cp=rows(cols["cp"].astype(_INT)),
        node=rows(cols["node"].astype(_INT)), wall_s=rows(cols["wall_s"]), first_layer=first, end_layer=end,
        c_rank=e_i, c_kind=e_i, c_mb=e_i, c_vs=e_i, c_tokens=e_f, c_s2=e_f, c_start=e_f, c_dur=e_f, c_own=e_f,
        k_rank=e_i, k_op=e_i, k_peer=e_i, k_mb=e_i, k_bytes=e_f, k_dur=e_f, k_wait=np.zeros(0, bool), k_group=e_i)
    xk = rows(np.stack([cols["x_f"], cols["x_b"], cols["x_w"]], axis=1))
    dp_wait = min(dp_waits, default=0.0)
    nan = float("nan")
    explained = nan if None in explained_s else max(explained_s, default=nan)
    pipeline = nan if None in pipeline_s else max((s - w for s, w in zip(pipeline_s, dp_waits)), default=nan)
    stage_replica = np.repeat(np.array(replica, _INT), array_lengths(parts, "s_stage"))
    stage_cols = [cols[n] for n in STAGE_ARRAYS]
    facts = SummaryFacts(own_s=rows(cols["own_s"]), pred_s=rows(cols["pred_s"]), explained_s=explained,
                         pipeline_s=pipeline + dp_wait, tokens=sum(tokens),
                         span_s=max((p.span_s for p in parts if p.span_s is not None), default=nan),
                         stages=bounded_stage_rows(stage_replica, stage_cols[0].astype(_INT),
                                                   stage_cols[1], stage_cols[2]))
    links = (cols["l_src"].astype(_INT), cols["l_dst"].astype(_INT), cols["l_time"],
             cols["l_stage_src"].astype(_INT), cols["l_stage_dst"].astype(_INT), cols["l_waits"] > 0)
    return ReplicaJobView(frame=frame, x=rows(cols["x"]), xk=xk, links=links, u_keys=list(keys),
                   u_class=u_class, u_tokens=cols["u_tokens"],
                   u_s2=cols["u_s2"], u_own=cols["u_own"], u_rank=cols["u_rank"].astype(_INT), facts=facts,
                   inferred=any(inferred))
