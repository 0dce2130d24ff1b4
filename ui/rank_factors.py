"""Each rank's slowdown factor over iterations, as the detector publishes it: what the heatmap draws.

"Slowdown" on the console is the detector's word (``analytics.rank_health``: a rank's factor, its
time over what its work predicts), never a figure the console works out from raw telemetry, so the
heatmap, the plan grid's labels and an incident's locations say the same thing. The detector
publishes a view only when it changes, so a view holds from its iteration until the next one.

A view keeps the ranks it knows (shared with the previous view while they stay the same) and only
the ranks that are not healthy, so a 100k-rank job costs a few bytes per slow rank per change, not
a row of 100k factors. Only the newest ``max_views`` views are kept.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass

import numpy as np

from collector.events import RankHealth, RankState


@dataclass(frozen=True)
class _View:
    iteration: int
    ranks: np.ndarray  # (known ranks,) int64 ascending: every rank the view names
    unusual: dict[int, float]  # rank -> factor of a slow rank; NaN for a dead or untraced one (no factor)


class RankFactors:
    """The detector's rank-health views of one job, by iteration, bounded."""

    def __init__(self, max_views: int = 4096) -> None:
        self.max_views = max_views
        self._views: list[_View] = []  # ascending iteration; a later view of the same iteration replaces it

    def __len__(self) -> int:
        return len(self._views)

    def add(self, p: RankHealth) -> None:
        ranks, unusual = [], {}
        for entry in p.entries():
            ranks.append(entry.rank)
            if entry.state == RankState.SLOW:
                unusual[entry.rank] = float(entry.factor)
            elif entry.state != RankState.HEALTHY:
                unusual[entry.rank] = float("nan")
        known = np.asarray(ranks, dtype=np.int64)
        at = bisect.bisect_left([v.iteration for v in self._views], p.iteration)
        before = self._views[at - 1] if at > 0 else None
        if before is not None and np.array_equal(before.ranks, known):
            known = before.ranks  # the same ranks: share the array
        view = _View(p.iteration, known, unusual)
        if at < len(self._views) and self._views[at].iteration == p.iteration:
            self._views[at] = view
        else:
            self._views.insert(at, view)
        if len(self._views) > self.max_views:
            del self._views[: len(self._views) - self.max_views]

    def matrix(self, first: int, last: int, max_columns: int = 240) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(iterations, ranks, matrix ranks × iterations) for iterations ``first``..``last``: each
        rank's factor in the view in force at each iteration (1.0 healthy; NaN: no view yet, or a
        rank dead or untraced). Rows are the ranks the views in force name, ascending. Past
        ``max_columns`` iterations are bucketed, each bucket keeping a rank's worst factor, so a
        short slowdown is not averaged away."""
        iterations = np.arange(first, last + 1, dtype=np.int64)
        if len(iterations) == 0 or not self._views:
            return iterations[:0], np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        starts = [v.iteration for v in self._views]
        lo = max(bisect.bisect_right(starts, first) - 1, 0)
        hi = bisect.bisect_right(starts, last)
        shown = self._views[lo:hi]
        if not shown:
            return iterations[:0], np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        ranks = np.unique(np.concatenate([v.ranks for v in shown]))
        row = {int(r): i for i, r in enumerate(ranks)}
        matrix = np.full((len(ranks), len(iterations)), np.nan, dtype=np.float32)
        for k, view in enumerate(shown):
            end = shown[k + 1].iteration if k + 1 < len(shown) else last + 1
            a, b = max(view.iteration, first) - first, end - first
            if b <= a:
                continue
            rows = np.searchsorted(ranks, view.ranks)
            matrix[rows, a:b] = 1.0
            for rank, factor in view.unusual.items():
                matrix[row[rank], a:b] = factor
        if len(iterations) > max_columns:
            edges = np.linspace(0, len(iterations), max_columns + 1).astype(int)
            with warnings.catch_warnings():  # an all-NaN bucket stays NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                matrix = np.stack([np.nanmax(matrix[:, a:b], axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
            iterations = iterations[edges[:-1]]
        return iterations, ranks, matrix
