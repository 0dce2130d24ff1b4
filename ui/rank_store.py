"""Per-rank telemetry folded into compact arrays: what the heatmap and the sequence-length plot need.

A 1,024-rank job sends 1,024 telemetry events per iteration; keeping them as objects for hours of
history would cost gigabytes. The console only needs, per iteration, each rank's compute time
(the sum of its chunk durations per forward token — not its wall time, which the pipeline's
synchronisation makes equal for everyone), its pipeline stage (so slowdown is measured against its peers, since first
and last stages do different work), and the packed sequence lengths of the micro-batches (read
from the first stage's TP-rank-0 only: every other rank of a replica sees the same batches).
Only the newest ``max_iterations`` iterations are kept; older ones are evicted.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from collector.events import ChunkKind, RankIteration


@dataclass
class _IterationRow:
    compute_s: np.ndarray  # (ranks,) float32 seconds of compute per forward token, NaN where a rank did not report
    stage: np.ndarray  # (ranks,) int16, -1 where unknown
    seq_lens: list[np.ndarray] = field(default_factory=list)


class RankStore:
    """Telemetry of one job, one row per iteration, bounded."""

    def __init__(self, max_iterations: int = 4096) -> None:
        self.max_iterations = max_iterations
        self.num_ranks = 0
        self._rows: OrderedDict[int, _IterationRow] = OrderedDict()

    def add(self, t: RankIteration) -> None:
        """Fold one rank's iteration (idempotent: a repeat overwrites the same cell)."""
        row = self._row(t.iteration, t.rank)
        forward = [c.tokens for c in t.chunks if c.kind == ChunkKind.FORWARD]
        # Unknown token counts (None): per forward chunk instead, the same for every rank of the job.
        tokens = (len(forward) if None in forward else sum(forward)) or 1
        row.compute_s[t.rank] = sum(c.duration_s for c in t.chunks) / tokens
        row.stage[t.rank] = t.coords.pp
        if t.coords.pp == 0 and t.coords.tp == 0:
            lens = [x for c in t.chunks if c.kind == ChunkKind.FORWARD and c.seq_lens for x in c.seq_lens]
            if lens:
                row.seq_lens.append(np.asarray(lens, dtype=np.int32))

    def _row(self, iteration: int, rank: int) -> _IterationRow:
        if rank >= self.num_ranks:
            self.num_ranks = max(rank + 1, 2 * self.num_ranks)
            for r in self._rows.values():
                r.compute_s = np.concatenate([r.compute_s, np.full(self.num_ranks - len(r.compute_s), np.nan, np.float32)])
                r.stage = np.concatenate([r.stage, np.full(self.num_ranks - len(r.stage), -1, np.int16)])
        row = self._rows.get(iteration)
        if row is None:
            row = _IterationRow(np.full(self.num_ranks, np.nan, np.float32), np.full(self.num_ranks, -1, np.int16))
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

        Per token, because replicas run different micro-batches; the mix of sequence lengths (attention
        is quadratic in each) still moves a healthy rank by some ±20%, a slow GPU by its factor.

        Iterations in [first, last] are bucketed to at most ``max_columns`` columns (the bucket
        keeps each rank's worst value, so a short slowdown is not averaged away). NaN = no report.
        """
        its = [i for i in self._rows if first <= i <= last]
        if not its:
            return np.zeros(0, dtype=np.int64), np.zeros((self.num_ranks, 0), dtype=np.float32)
        cols = []
        for i in its:
            row = self._rows[i]
            ratio = np.full(self.num_ranks, np.nan, np.float32)
            comp = row.compute_s[: self.num_ranks]
            stage = row.stage[: self.num_ranks]
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
            lens = np.concatenate(self._rows[i].seq_lens)
            p5, p50, p95 = np.percentile(lens, [5, 50, 95])
            for k, v in (("iteration", i), ("p5", p5), ("p50", p50), ("p95", p95), ("max", lens.max())):
                out[k].append(float(v))
        return {k: np.asarray(v) for k, v in out.items()}
