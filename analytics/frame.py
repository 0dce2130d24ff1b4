"""One iteration of a job as flat numpy arrays: the detector's input.

The detector never loops over chunks in Python after this point. A frame holds every rank's
chunks and communication waits for one (epoch, iteration), plus each chunk's *own* compute time:
its duration minus the TP all-reduce waits that ran inside it. That subtraction is what lets the
detector see a straggler that TP synchronisation hides — every TP peer's chunk lasts as long as the
slowest peer's, but only the slow one does not wait.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collector.events import RankIteration

KIND_CODE = {"F": 0, "B": 1, "W": 2}
KIND_NAME = ("F", "B", "W")
OP_CODE = {"tp_allreduce": 0, "pp_send": 1, "pp_recv": 2, "dp_allreduce": 3}


@dataclass
class IterationFrame:
    epoch: int
    iteration: int
    # per rank (R,)
    rank: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    node: np.ndarray  # -1 when unknown
    wall_s: np.ndarray
    # per chunk (C,)
    c_rank: np.ndarray  # index into the per-rank arrays
    c_kind: np.ndarray
    c_mb: np.ndarray
    c_vs: np.ndarray
    c_tokens: np.ndarray
    c_s2: np.ndarray  # Σ lᵢ²; NaN when seq_lens were not reported
    c_start: np.ndarray
    c_dur: np.ndarray
    c_own: np.ndarray  # c_dur minus TP all-reduce waits inside the chunk
    # per comm wait (K,)
    k_rank: np.ndarray
    k_op: np.ndarray
    k_peer: np.ndarray  # -1 when not point-to-point
    k_mb: np.ndarray
    k_bytes: np.ndarray  # NaN when unknown
    k_dur: np.ndarray

    @property
    def has_seq_lens(self) -> bool:
        return bool(np.isfinite(self.c_s2).all())

    @property
    def num_ranks(self) -> int:
        return len(self.rank)


def build_frame(reports: Sequence[RankIteration]) -> IterationFrame:
    """Flatten one iteration's rank reports (all of one epoch and iteration) into a frame."""
    if not reports:
        raise ValueError("build_frame needs at least one RankIteration")
    reports = sorted(reports, key=lambda r: r.rank)
    epoch, iteration = reports[0].epoch, reports[0].iteration
    rank = np.fromiter((r.rank for r in reports), np.int64, len(reports))
    tp = np.fromiter((r.coords.tp for r in reports), np.int64, len(reports))
    pp = np.fromiter((r.coords.pp for r in reports), np.int64, len(reports))
    dp = np.fromiter((r.coords.dp for r in reports), np.int64, len(reports))
    node = np.fromiter((-1 if r.node is None else r.node for r in reports), np.int64, len(reports))
    wall = np.fromiter((r.wall_s for r in reports), float, len(reports))
    chunk_rows: list[tuple] = []
    comm_rows: list[tuple] = []
    kc, oc = KIND_CODE, OP_CODE
    for i, r in enumerate(reports):
        chunk_rows.extend((i, kc[c.kind], c.microbatch, c.virtual_stage, c.tokens, c.start_s, c.duration_s)
                          for c in r.chunks)
        comm_rows.extend(
            (i, oc[w.op], -1 if w.peer is None else w.peer, -1 if w.microbatch is None else w.microbatch,
             np.nan if w.bytes is None else w.bytes, w.start_s, w.duration_s)
            for w in r.comm
        )
    c = np.array(chunk_rows, dtype=float).reshape(-1, 7)
    c = np.insert(c, 5, sum_sq_lens([ch.seq_lens for r in reports for ch in r.chunks]), axis=1)
    k = np.array(comm_rows, dtype=float).reshape(-1, 7)
    c_rank = c[:, 0].astype(np.int64)
    c_start, c_dur = c[:, 6], c[:, 7]
    own = c_dur - _tp_wait_inside(c_rank, c_start, c_dur, k)
    return IterationFrame(
        epoch=epoch, iteration=iteration, rank=rank, tp=tp, pp=pp, dp=dp, node=node, wall_s=wall,
        c_rank=c_rank, c_kind=c[:, 1].astype(np.int64), c_mb=c[:, 2].astype(np.int64), c_vs=c[:, 3].astype(np.int64),
        c_tokens=c[:, 4], c_s2=c[:, 5], c_start=c_start, c_dur=c_dur, c_own=np.maximum(own, 0.0),
        k_rank=k[:, 0].astype(np.int64), k_op=k[:, 1].astype(np.int64), k_peer=k[:, 2].astype(np.int64),
        k_mb=k[:, 3].astype(np.int64), k_bytes=k[:, 4], k_dur=k[:, 6],
    )


def sum_sq_lens(seq_lens: list[list[int] | None]) -> np.ndarray:
    """Σ lᵢ² per chunk, vectorised over all chunks; NaN where seq_lens is None."""
    counts = np.fromiter((0 if x is None else len(x) for x in seq_lens), np.int64, len(seq_lens))
    flat = np.fromiter(itertools.chain.from_iterable(x for x in seq_lens if x is not None), np.float64,
                       int(counts.sum()))
    out = np.bincount(np.repeat(np.arange(len(seq_lens)), counts), weights=flat * flat,
                      minlength=len(seq_lens)).astype(np.float64)
    out[np.fromiter((x is None for x in seq_lens), bool, len(seq_lens))] = np.nan
    return out


def _tp_wait_inside(c_rank: np.ndarray, c_start: np.ndarray, c_dur: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per chunk, the TP all-reduce wait time whose start lies inside the chunk's window.

    Vectorised with one sort: chunks and waits are keyed by (rank, start); each wait is assigned to
    the last chunk of its rank that started at or before it, if the wait starts before that chunk ends.
    Sources that report TP waits outside their chunks get nothing subtracted, which is right for them.
    """
    out = np.zeros(len(c_rank))
    tpw = k[k[:, 1] == OP_CODE["tp_allreduce"]] if len(k) else k
    if len(tpw) == 0 or len(c_rank) == 0:
        return out
    span = float(max(c_start.max() + c_dur.max(), tpw[:, 5].max())) + 1.0
    c_key = c_rank * span + c_start
    order = np.argsort(c_key, kind="stable")
    w_key = tpw[:, 0] * span + tpw[:, 5]
    pos = np.searchsorted(c_key[order], w_key, side="right") - 1
    valid = pos >= 0
    idx = order[np.clip(pos, 0, None)]
    valid &= (c_rank[idx] == tpw[:, 0].astype(np.int64)) & (tpw[:, 5] < c_start[idx] + c_dur[idx])
    np.add.at(out, idx[valid], tpw[valid, 6])
    return out
