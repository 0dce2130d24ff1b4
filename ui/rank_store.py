"""Per-rank telemetry folded into compact arrays: what the sequence-length plot needs.

A 1,024-rank job sends 1,024 telemetry events per iteration; keeping them as objects for hours of
history would cost gigabytes. The console only needs, per iteration, the packed sequence lengths of
the micro-batches (read from the first stage's TP-rank-0 only: every other rank of a replica sees
the same batches), and which ranks reported. How slow a rank is comes from the detector
(ui/rank_factors.py), never from these timings. Only the newest ``max_iterations`` iterations are
kept; older ones are evicted.

Memory follows the ranks that reported, never a rank's number: a report from rank 2,147,483,647
costs one entry, not an array that long. ``rank_ids`` lists them in rank order: 0..max rank while
that is at most a few times the ranks heard from, which holds for every job the platform runs;
otherwise each rank that reported.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from collector.events import ChunkKind, RankIteration


class RankStore:
    """Telemetry of one job, one entry per iteration, bounded."""

    def __init__(self, max_iterations: int = 4096) -> None:
        self.max_iterations = max_iterations
        self._reported: set[int] = set()  # every rank that reported
        self._rows: OrderedDict[int, dict[int, np.ndarray]] = OrderedDict()  # iteration -> rank -> its lengths

    @property
    def num_ranks(self) -> int:
        return len(self.rank_ids)

    @property
    def rank_ids(self) -> np.ndarray:
        """The ranks heard from, as rows in rank order, ascending."""
        if not self._reported:
            return np.zeros(0, dtype=np.int64)
        top = max(self._reported)
        if top < 4 * len(self._reported) + 1024:
            return np.arange(top + 1, dtype=np.int64)
        return np.asarray(sorted(self._reported), dtype=np.int64)

    def add(self, t: RankIteration) -> None:
        """Fold one rank's iteration (idempotent: a repeat overwrites the same cell)."""
        self._reported.add(t.rank)
        row = self._row(t.iteration)
        if t.coords.pp == 0 and t.coords.tp == 0:
            lens = [x for c in t.chunks if c.kind == ChunkKind.FORWARD and c.seq_lens for x in c.seq_lens]
            if lens:
                row[t.rank] = np.asarray(lens, dtype=np.int32)  # a repeat replaces, never adds

    def _row(self, iteration: int) -> dict[int, np.ndarray]:
        row = self._rows.get(iteration)
        if row is None:
            row = self._rows[iteration] = {}
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

    def seq_len_quantiles(self, first: int, last: int, max_points: int = 400) -> dict[str, np.ndarray]:
        """Per iteration in [first, last]: p5, p50, p95 and max of the packed sequence lengths."""
        its = [i for i in self._rows if first <= i <= last and self._rows[i]]
        step = max(1, len(its) // max_points)
        its = its[::step]
        out: dict[str, list[float]] = {"iteration": [], "p5": [], "p50": [], "p95": [], "max": []}
        for i in its:
            lens = np.concatenate(list(self._rows[i].values()))
            p5, p50, p95 = np.percentile(lens, [5, 50, 95])
            for k, v in (("iteration", i), ("p5", p5), ("p50", p50), ("p95", p95), ("max", lens.max())):
                out[k].append(float(v))
        return {k: np.asarray(v) for k, v in out.items()}
