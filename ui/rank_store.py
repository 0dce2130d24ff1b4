"""Per-rank telemetry folded into compact arrays: what the heatmap and the sequence-length plot need.

A 1,024-rank job sends 1,024 telemetry events per iteration; keeping them as objects for hours of
history would cost gigabytes. The console only needs, per iteration, each rank's compute time
(the sum of its chunk durations per forward token — not its wall time, which the pipeline's
synchronisation makes equal for everyone), its pipeline stage (so slowdown is measured against its peers, since first
and last stages do different work), and the packed sequence lengths of the micro-batches (read
from the first stage's TP-rank-0 only: every other rank of a replica sees the same batches).
Only the newest ``max_iterations`` iterations are kept; older ones are evicted.

Memory follows the ranks that reported, never a rank's number: each rank gets a column the first
time it reports (a dict from rank to column), so a report from rank 2,147,483,647 costs one column,
not an array that long. Screens get rows in rank order (``rank_ids``): rows 0..max rank (row r is
rank r, NaN for a rank that never reported) while that is at most a few times the ranks heard
from, which holds for every job the platform runs; otherwise one row per rank that reported.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from collector.events import ChunkKind, RankIteration


@dataclass
class _IterationRow:
    compute_s: np.ndarray  # (columns,) float32 seconds of compute per forward token, NaN where a rank did not report
    stage: np.ndarray  # (columns,) int32, -1 where unknown
    seq_lens: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> its micro-batches' lengths


class RankStore:
    """Telemetry of one job, one row per iteration, bounded."""

    def __init__(self, max_iterations: int = 4096) -> None:
        self.max_iterations = max_iterations
        self._column: dict[int, int] = {}  # rank -> its column in every row, in the order ranks first reported
        self._capacity = 0  # columns allocated in every row (grows by doubling)
        self._rows: OrderedDict[int, _IterationRow] = OrderedDict()

    @property
    def num_ranks(self) -> int:
        """The rows of ``slowdown``."""
        return len(self.rank_ids)

    @property
    def rank_ids(self) -> np.ndarray:
        """The rank of each row of ``slowdown``, ascending."""
        if not self._column:
            return np.zeros(0, dtype=np.int64)
        top = max(self._column)
        if top < 4 * len(self._column) + 1024:
            return np.arange(top + 1, dtype=np.int64)
        return np.asarray(sorted(self._column), dtype=np.int64)

    def add(self, t: RankIteration) -> None:
        """Fold one rank's iteration (idempotent: a repeat overwrites the same cell)."""
        col = self._column_of(t.rank)
        row = self._row(t.iteration)
        forward = [c.tokens for c in t.chunks if c.kind == ChunkKind.FORWARD]
        known = [n for n in forward if n is not None]
        # Unknown token counts (None): per forward chunk instead, the same for every rank of the job.
        tokens = (len(forward) if len(known) < len(forward) else sum(known)) or 1
        row.compute_s[col] = sum(c.duration_s for c in t.chunks) / tokens
        row.stage[col] = t.coords.pp
        if t.coords.pp == 0 and t.coords.tp == 0:
            lens = [x for c in t.chunks if c.kind == ChunkKind.FORWARD and c.seq_lens for x in c.seq_lens]
            if lens:
                row.seq_lens[t.rank] = np.asarray(lens, dtype=np.int32)  # a repeat replaces, never adds

    def _column_of(self, rank: int) -> int:
        col = self._column.get(rank)
        if col is None:
            col = self._column[rank] = len(self._column)
            if col >= self._capacity:
                self._capacity = max(col + 1, 2 * self._capacity)
                for r in self._rows.values():
                    r.compute_s = np.concatenate([r.compute_s, np.full(self._capacity - len(r.compute_s), np.nan,
                                                                       np.float32)])
                    r.stage = np.concatenate([r.stage, np.full(self._capacity - len(r.stage), -1, np.int32)])
        return col

    def _row(self, iteration: int) -> _IterationRow:
        row = self._rows.get(iteration)
        if row is None:
            row = _IterationRow(np.full(self._capacity, np.nan, np.float32), np.full(self._capacity, -1, np.int32))
            self._rows[iteration] = row
            if len(self._rows) > 1 and iteration < next(reversed(self._rows)):
                self._rows = OrderedDict(sorted(self._rows.items()))
            while len(self._rows) > self.max_iterations:
                self._rows.popitem(last=False)
        return row

    @property
    def iterations(self) -> list[int]:
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def slowdown(self, first: int, last: int, max_columns: int = 240) -> tuple[np.ndarray, np.ndarray]:
        """(iterations, matrix ranks × iterations): compute time per token over the median of the rank's stage.
        Row i is rank ``rank_ids[i]`` (rank i in a job of ranks 0..n-1).

        Per token, because replicas run different micro-batches; the mix of sequence lengths (attention
        is quadratic in each) still moves a healthy rank by some ±20%, a slow GPU by its factor.

        Iterations in [first, last] are bucketed to at most ``max_columns`` columns (the bucket
        keeps each rank's worst value, so a short slowdown is not averaged away). NaN = no report.
        """
        its = [i for i in self._rows if first <= i <= last]
        if not its:
            return np.zeros(0, dtype=np.int64), np.zeros((self.num_ranks, 0), dtype=np.float32)
        order = np.asarray([self._column.get(int(r), -1) for r in self.rank_ids], dtype=np.int64)  # row -> column
        cols = []
        for i in its:
            row = self._rows[i]
            ratio = np.full(self.num_ranks, np.nan, np.float32)
            comp = np.full(self.num_ranks, np.nan, np.float32)
            stage = np.full(self.num_ranks, -1, np.int32)
            have = (order >= 0) & (order < len(row.compute_s))
            comp[have] = row.compute_s[order[have]]
            stage[have] = row.stage[order[have]]
            for s in np.unique(stage[stage >= 0]):
                sel = stage == s
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    med = np.nanmedian(comp[sel])
                if med > 0:
                    ratio[sel] = comp[sel] / med
            if len(ratio) < self.num_ranks:
                ratio = np.concatenate([ratio, np.full(self.num_ranks - len(ratio), np.nan, np.float32)])
            cols.append(ratio)
        matrix = np.stack(cols, axis=1)
        iterations = np.asarray(its)
        if len(its) > max_columns:
            edges = np.linspace(0, len(its), max_columns + 1).astype(int)
            with warnings.catch_warnings():  # an all-NaN bucket (a rank that never reported) stays NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                matrix = np.stack([np.nanmax(matrix[:, a:b], axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
            iterations = iterations[edges[:-1]]
        return iterations, matrix

    def seq_len_quantiles(self, first: int, last: int, max_points: int = 400) -> dict[str, np.ndarray]:
        """Per iteration in [first, last]: p5, p50, p95 and max of the packed sequence lengths."""
        its = [i for i in self._rows if first <= i <= last and self._rows[i].seq_lens]
        step = max(1, len(its) // max_points)
        its = its[::step]
        out: dict[str, list[float]] = {"iteration": [], "p5": [], "p50": [], "p95": [], "max": []}
        for i in its:
            lens = np.concatenate(list(self._rows[i].seq_lens.values()))
            p5, p50, p95 = np.percentile(lens, [5, 50, 95])
            for k, v in (("iteration", i), ("p5", p5), ("p50", p50), ("p95", p95), ("max", lens.max())):
                out[k].append(float(v))
        return {k: np.asarray(v) for k, v in out.items()}
