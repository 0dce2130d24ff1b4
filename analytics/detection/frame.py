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
from typing import cast

import numpy as np

from collector.events import CommTable, RankIteration
from collector.plan import Plan
from collector.rank_columns import COMM_OPS, GROUPS, joined, joined_codes, joined_seq_lens

KIND_CODE = {"F": 0, "B": 1, "W": 2}
_KIND_LUT = np.zeros(256, np.int8)
for _name, _code in KIND_CODE.items():
    _KIND_LUT[ord(_name)] = _code
KIND_NAME = ("F", "B", "W")
OP_CODE = {"tp_allreduce": 0, "pp_send": 1, "pp_recv": 2, "dp_allreduce": 3, "pp_sendrecv": 4, "all_gather": 5,
           "reduce_scatter": 6, "embedding_allreduce": 7, "loss_allreduce": 8}
GROUP_CODE = {"tp": 0, "pp": 1, "dp": 2, "cp": 3, "fsdp": 4}  # k_group; -1 when the source did not say
# The communications a frame keeps: those judging reads (TP waits inside chunks, p2p send timers,
# the DP all-reduce). A pipeline rank's ``pp_recv`` waits, one per chunk that receives its input,
# are most of its records and judged nowhere: converting them cost 20 ms of a 1,024-rank frame's
# 50. The DuckDB tables keep every wait (analytics/projections/tables.py).
FRAME_OPS = frozenset({"tp_allreduce", "pp_send", "pp_sendrecv", "dp_allreduce"})
# A binary report's op and group codes (collector/rank_columns.py) as the frame's: -1 for an op the
# frame drops, and for a group not said (255).
_FRAME_OP_OF_CODE = np.array([OP_CODE[op] if op in FRAME_OPS else -1 for op in COMM_OPS], np.int64)
_GROUP_OF_CODE = np.full(256, -1, np.int64)
_GROUP_OF_CODE[:len(GROUPS)] = [GROUP_CODE[g] for g in GROUPS]


@dataclass
class IterationFrame:
    epoch: int
    iteration: int
    # per rank (R,)
    rank: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray  # context-parallel rank; 0 without context parallelism
    node: np.ndarray  # -1 when unknown
    wall_s: np.ndarray
    first_layer: np.ndarray  # the rank's layer range under the plan; -1 when the plan is unknown
    end_layer: np.ndarray
    # per chunk (C,)
    c_rank: np.ndarray  # index into the per-rank arrays
    c_kind: np.ndarray
    c_mb: np.ndarray
    c_vs: np.ndarray
    c_tokens: np.ndarray  # NaN when the source did not report the chunk's token count
    c_s2: np.ndarray  # Σ lᵢ²; NaN when seq_lens were not reported
    c_start: np.ndarray
    c_dur: np.ndarray
    c_own: np.ndarray  # c_dur minus TP all-reduce waits inside the chunk
    # per comm wait of the kinds judging reads (K,; FRAME_OPS)
    k_rank: np.ndarray
    k_op: np.ndarray
    k_peer: np.ndarray  # -1 when not point-to-point
    k_mb: np.ndarray
    k_bytes: np.ndarray  # NaN when unknown
    k_dur: np.ndarray
    k_wait: np.ndarray  # bool: the timer holds the wait for the peer (fused / blocking), not the wire alone
    k_group: np.ndarray  # GROUP_CODE of the collective's process group; -1 when unknown

    @property
    def has_tokens(self) -> bool:
        return bool(np.isfinite(self.c_tokens).all())

    @property
    def has_seq_lens(self) -> bool:
        return bool(np.isfinite(self.c_s2).all())

    @property
    def num_ranks(self) -> int:
        return len(self.rank)


def build_frame(reports: Sequence[RankIteration], layers: LayerLookup | None = None) -> IterationFrame:
    """Flatten one iteration's rank reports (all of one epoch and iteration) into a frame.

    Works on the reports' column form (``RankIteration.chunk_table``): per report a handful of
    list concatenations, never a Python object per chunk. ``layers`` gives each rank's layer range
    under the running plan (for cost-model classes); without it the ranges are -1 (unknown).
    """
    if not reports:
        raise ValueError("build_frame needs at least one RankIteration")
    reports = sorted(reports, key=lambda r: r.rank)
    R = len(reports)
    epoch, iteration = reports[0].epoch, reports[0].iteration
    rank = np.fromiter((r.rank for r in reports), np.int64, R)
    coords = np.array([(r.coords.tp, r.coords.pp, r.coords.dp, r.coords.cp) for r in reports],
                      dtype=np.int64).reshape(R, 4)
    node = np.fromiter((-1 if r.node is None else r.node for r in reports), np.int64, R)
    wall = np.fromiter((r.wall_s for r in reports), float, R)
    tables = [r.chunk_table for r in reports]
    counts = np.fromiter((len(t.kind) for t in tables), np.int64, R)
    C = int(counts.sum())
    chain = itertools.chain.from_iterable
    kind_bytes = np.frombuffer("".join(t.kind for t in tables).encode("ascii"), np.uint8)
    c_kind = _KIND_LUT[kind_bytes].astype(np.int64)
    # Reports read from the wire hold their columns as arrays: joined, never a Python value each.
    c_mb = joined([t.microbatch for t in tables], np.int64, C)
    c_vs = joined([t.virtual_stage for t in tables], np.int64, C)
    c_tokens = joined([t.tokens for t in tables], float, C, unknown=np.nan)
    c_start = joined([t.start_s for t in tables], float, C)
    c_dur = joined([t.duration_s for t in tables], float, C)
    lens = joined_seq_lens([t.seq_lens for t in tables])
    c_s2 = sum_sq_lens(list(chain(t.seq_lens for t in tables))) if lens is None else sum_sq_of(*lens)
    c_rank = np.repeat(np.arange(R, dtype=np.int64), counts)
    k = _comm_rows(reports)
    own = c_dur - _tp_wait_inside(c_rank, c_start, c_dur, k)
    first_layer = np.full(R, -1, np.int64)
    end_layer = np.full(R, -1, np.int64)
    if layers is not None:
        first_layer, end_layer = layers.ranges(rank)
    return IterationFrame(
        epoch=epoch, iteration=iteration, rank=rank, tp=coords[:, 0], pp=coords[:, 1], dp=coords[:, 2],
        cp=coords[:, 3], node=node,
        wall_s=wall, first_layer=first_layer, end_layer=end_layer,
        c_rank=c_rank, c_kind=c_kind, c_mb=c_mb, c_vs=c_vs, c_tokens=c_tokens, c_s2=c_s2, c_start=c_start,
        c_dur=c_dur, c_own=np.maximum(own, 0.0),
        k_rank=k[:, 0].astype(np.int64), k_op=k[:, 1].astype(np.int64), k_peer=k[:, 2].astype(np.int64),
        k_mb=k[:, 3].astype(np.int64), k_bytes=k[:, 4], k_dur=k[:, 6], k_wait=k[:, 7] > 0,
        k_group=k[:, 8].astype(np.int64),
    )


def _comm_rows(reports: Sequence[RankIteration]) -> np.ndarray:
    """(K, 9) rank index, op, peer, micro-batch, bytes (NaN unknown), start, duration, includes_wait,
    group code (-1 unknown), for each report's communications of the kinds in ``FRAME_OPS``."""
    tables = [r.waits() for r in reports]
    joined_rows = _joined_comm_rows(tables)
    if joined_rows is not None:
        return joined_rows
    rows = []
    keep, oc, gc = FRAME_OPS, OP_CODE, GROUP_CODE
    for i, t in enumerate(tables):
        ops = t.op
        for j in [j for j, op in enumerate(ops) if op in keep]:
            peer, mb, group = t.peer[j], t.microbatch[j], t.group[j] if t.group else None
            rows.append((i, oc[ops[j]], -1 if peer is None else peer, -1 if mb is None else mb, t.bytes[j],
                         t.start_s[j], t.duration_s[j], bool(t.includes_wait and t.includes_wait[j]),
                         -1 if group is None else gc[group]))
    return np.array(rows, dtype=float).reshape(-1, 9)  # an unknown byte count (None) becomes NaN


def _joined_comm_rows(tables: Sequence[CommTable]) -> np.ndarray | None:
    """``_comm_rows`` when every report was read from the wire: its columns' codes and numbers
    joined, the rows kept chosen by op code, no Python value per wait (a pipeline rank's
    ``pp_recv`` waits, which the frame drops, were most of a 128-rank replica's frame). None when
    some report holds Python values."""
    counts = [len(t) for t in tables]
    ops = joined_codes([t.op for t in tables], counts, 0)
    waits = joined_codes([t.includes_wait for t in tables], counts, 0)
    groups = joined_codes([t.group for t in tables], counts, 255)
    if ops is None or waits is None or groups is None:
        return None
    op = _FRAME_OP_OF_CODE[ops]
    keep = op >= 0
    said = [t for t in tables if len(t)]  # a report without communications holds lists, empty

    def column(name: str, dtype: type, unknown: float | None = None) -> np.ndarray:
        return joined([getattr(t, name) for t in said], dtype, len(ops), unknown)[keep]

    out = np.empty((int(keep.sum()), 9))
    out[:, 0] = np.repeat(np.arange(len(tables)), counts)[keep]
    out[:, 1] = op[keep]
    out[:, 2] = column("peer", np.int64)  # -1: not point-to-point
    out[:, 3] = column("microbatch", np.int64)
    out[:, 4] = column("bytes", float, np.nan)
    out[:, 5] = column("start_s", float)
    out[:, 6] = column("duration_s", float)
    out[:, 7] = waits[keep]
    out[:, 8] = _GROUP_OF_CODE[groups[keep]]
    return out


class LayerLookup:
    """Device id -> (first_layer, end_layer) under one plan, as arrays for vectorised lookup."""

    def __init__(self, plan: Plan) -> None:
        # stage by stage (a shard builds one per plan; device by device took 16 ms at 100k devices)
        stages = [stage for pipe in plan.pipelines for stage in pipe.stages]
        counts = np.fromiter((len(st.devices) for st in stages), np.int64, len(stages))
        devices = np.fromiter(itertools.chain.from_iterable(st.devices for st in stages), np.int64, int(counts.sum()))
        top = int(devices.max()) + 1 if len(devices) else 0
        self.first = np.full(top + 1, -1, np.int64)
        self.end = np.full(top + 1, -1, np.int64)
        self.first[devices] = np.repeat(np.fromiter((st.first_layer for st in stages), np.int64, len(stages)), counts)
        self.end[devices] = np.repeat(np.fromiter((st.end_layer for st in stages), np.int64, len(stages)), counts)

    def ranges(self, devices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.where((devices >= 0) & (devices < len(self.first) - 1), devices, len(self.first) - 1)
        return self.first[idx], self.end[idx]


def sum_sq_lens(seq_lens: list[list[int] | None]) -> np.ndarray:
    """Σ lᵢ² per chunk, vectorised over all chunks; NaN where seq_lens is None."""
    n = len(seq_lens)
    missing = None in seq_lens
    # Copy only when some are missing (the common case has every list).
    lists: Sequence[Sequence[int]] = [x or () for x in seq_lens] if missing else cast("list[list[int]]", seq_lens)
    counts = np.fromiter(map(len, lists), np.int64, n)
    # as integers, then floats: reading Python ints as int64 is a third faster than as float64
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(counts.sum()))
    if missing:
        counts[np.fromiter((x is None for x in seq_lens), bool, n)] = -1
    return sum_sq_of(flat, counts)


def sum_sq_of(flat: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Σ lᵢ² per chunk from all chunks' lengths in order and each chunk's count (-1: not
    reported, NaN)."""
    n = len(counts)
    flat = flat.astype(np.float64)
    out = np.zeros(n)
    if len(flat):
        starts = np.zeros(n, np.int64)
        np.cumsum(np.maximum(counts[:-1], 0), out=starts[1:])
        has = counts > 0
        out[has] = np.add.reduceat(flat * flat, starts[has])
    out[counts < 0] = np.nan
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
