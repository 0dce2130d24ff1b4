"""What each rank's own stream told the fail-stop watch so far, held as columns (one row per rank).

Why columns: the watch (analytics/detection/fail_stop.py) judges every rank against the job's progress, and
the sharded merge receives every rank's heartbeat and report progress each iteration
(``LivenessBatch``). With an object per rank and a Python call per event that cost the merge 10.8 s
per iteration at 100k ranks. As columns, a shard's batch is applied with a few numpy operations
(``FailStopWatch.ingest``) and a judgement walks the job in numpy; the single process's
one-event-at-a-time path reads and writes the same rows.

Rows are given in order of first appearance, not indexed by rank: a rank is a device id up to
2^31, and a forged one must cost one row, not a table that large.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_COLUMNS: dict[str, tuple[type, float | int | bool]] = {
    "rank": (np.int64, -1),
    "heard": (np.bool_, False),  # an event of this rank's stream arrived (believed or not)
    "time_s": (np.float64, -np.inf),  # watermark: the newest believed event time
    "hb_time_s": (np.float64, np.nan),  # the newest heartbeat's time (NaN: none yet)
    "hb_interval_s": (np.float64, 1.0),
    "epoch": (np.int64, -1),
    "reported": (np.int64, -1),  # newest iteration reported in ``epoch``
    "started": (np.int64, -1),  # newest iteration a heartbeat said it started in ``epoch``
    "claimed_s": (np.float64, -np.inf),  # the newest time it stamped that was not believed
    "untrusted": (np.int64, 0),  # its events whose time was not believed
    "watched": (np.bool_, False),  # of the running plan (or heard from)
    "retired": (np.bool_, False),  # reconfigured away: never judged
    "in_plan": (np.bool_, False),  # a device of the newest announced plan
    "missing": (np.int64, 0),  # frames in a row scored without its report
}


@dataclass
class RankStreams:
    """The columns of ``_COLUMNS``, ``n`` rows in use; ``row`` maps a rank to its row."""

    n: int = 0
    _row: dict[int, int] = field(default_factory=dict)
    _sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ranks sorted, their rows), rebuilt on growth
    _last_batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # ``batch_rows``' last answer
    cols: dict[str, np.ndarray] = field(default_factory=lambda: {
        k: np.full(64, fill, dtype) for k, (dtype, fill) in _COLUMNS.items()})

    def __getattr__(self, name: str) -> np.ndarray:
        """A column, cut to the rows in use (a view: writes land in the table)."""
        cols = self.__dict__.get("cols")
        if cols is None or name not in cols:
            raise AttributeError(name)
        return cols[name][: self.n]

    def find(self, rank: int) -> int | None:
        return self._row.get(rank)

    def row(self, rank: int) -> int:
        """The rank's row, added when new."""
        i = self._row.get(rank)
        if i is None:
            i = int(self.add(np.array([rank], np.int64))[0])
        return i

    def rows(self, ranks: np.ndarray) -> np.ndarray:
        """The rows of ``ranks`` (any order, repeats allowed), the new ones added."""
        ranks = np.asarray(ranks, np.int64)
        if self._sorted is None:
            order = np.argsort(self.rank, kind="stable")
            self._sorted = (self.rank[order], order)
        keys, rows = self._sorted
        at = np.clip(np.searchsorted(keys, ranks), 0, max(len(keys) - 1, 0))
        found = (keys[at] == ranks) if len(keys) else np.zeros(len(ranks), bool)
        if found.all():
            return rows[at]
        self.add(np.unique(ranks[~found]))
        return self.rows(ranks)

    def batch_rows(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(``rows(ranks)``, then ``distinct_rows`` of them), read-only. A rank keeps its row for
        good (rows are only ever added), so the answer for the same ranks never changes: the sharded
        merge's batches list the same 200k ranks in the same order every iteration, and looking
        them up again (a search per rank) costs a tenth of its liveness work."""
        ranks = np.asarray(ranks, np.int64)
        last = self._last_batch
        if last is not None and np.array_equal(last[0], ranks):
            return last[1], last[2], last[3]
        rows = self.rows(ranks)
        u, inv = self.distinct_rows(rows)
        for a in (rows, u, inv):
            a.flags.writeable = False
        key = ranks.copy()
        self._last_batch = (key, rows, u, inv)
        return rows, u, inv

    def distinct_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct rows, ascending; each of ``rows``' index among them), as ``np.unique``
        with ``return_inverse``; a batch that is a good part of the table marks the table instead
        of sorting or hashing the batch (at 100k ranks that took the merge 0.1 s a batch)."""
        if 16 * len(rows) < self.n:
            u, inv = np.unique(rows, return_inverse=True)
            return u, inv.ravel()
        seen = np.zeros(self.n, bool)
        seen[rows] = True
        u = np.flatnonzero(seen)
        at = np.zeros(self.n, np.int64)
        at[u] = np.arange(len(u))
        return u, at[rows]

    def add(self, ranks: np.ndarray) -> np.ndarray:
        """New rows for ``ranks`` (none of them known yet); returns their rows."""
        need = self.n + len(ranks)
        size = len(self.cols["rank"])
        if need > size:
            grow = max(need, 2 * size) - size
            for k, (dtype, fill) in _COLUMNS.items():
                self.cols[k] = np.concatenate([self.cols[k], np.full(grow, fill, dtype)])
        new = np.arange(self.n, need)
        self.cols["rank"][new] = ranks
        self._row.update(zip(ranks.tolist(), new.tolist()))
        self.n, self._sorted = need, None
        return new

    def mask(self, ranks: set[int] | frozenset[int]) -> np.ndarray:
        """A row mask of the known ones among ``ranks``."""
        out = np.zeros(self.n, bool)
        idx = [i for r in ranks if (i := self._row.get(r)) is not None]
        out[idx] = True
        return out

    def ranks_of(self, mask: np.ndarray) -> list[int]:
        return sorted(self.rank[mask].tolist())

    def known_iteration(self, i: int, epoch: int) -> int:
        """The newest iteration of ``epoch`` row ``i``'s stream proves the rank got to (−1 if none)."""
        own = int(self.cols["epoch"][i])
        if own > epoch:
            return 1 << 40
        if own < epoch:
            return -1
        return max(int(self.cols["reported"][i]), int(self.cols["started"][i]) - 1)

    def passed(self, i: int, epoch: int, iteration: int) -> bool:
        """True when row ``i``'s stream moved beyond (epoch, iteration): a report of it can no longer come."""
        own = int(self.cols["epoch"][i])
        if own != epoch:
            return own > epoch
        return int(self.cols["reported"][i]) > iteration or int(self.cols["started"][i]) >= iteration + 2
