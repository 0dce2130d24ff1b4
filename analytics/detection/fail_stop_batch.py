"""A shard's batch of heartbeats and report progress, applied to the fail-stop watch as arrays.

The sharded merge receives every rank's liveness from the shards (analytics/sharding/merge.py); one
Python call per event cost it seconds per iteration at 100k ranks. Here a batch is applied in a few
numpy operations, by the same rules as the watch's one-event path (analytics/detection/fail_stop.py),
checked to hold before anything is applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from analytics.detection.fail_stop import FailStopWatch, LivenessChange


def ingest(w: FailStopWatch, kind: np.ndarray, rank: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
           time_s: np.ndarray, interval_s: np.ndarray) -> list[LivenessChange] | None:
    """A shard's batch of rows (``kind`` 1: a heartbeat with its interval, 0: a rank report),
    in the order the shard read them, applied as ``heartbeat`` and ``telemetry`` would apply
    them one by one, in a few numpy operations over the batch (the sharded merge's path).

    The judgement runs once, after the batch, when one of its events would have made it due:
    a rank is named at the end of the batch that made it dead, not at the event inside it.
    None, with nothing changed, when the batch holds what only the one-by-one rules settle:
    a time too far ahead to believe at once (Clocks), a row of a dead rank (it may revive),
    a heartbeat interval that changes, a non-finite time. The caller then applies the rows
    one by one (``Detector.on_liveness``)."""
    n = len(rank)
    if n == 0:
        return []
    if not np.isfinite(time_s).all():
        return None
    if w.dead and np.isin(rank, np.fromiter(w.dead, np.int64, len(w.dead))).any():
        return None
    t = w.table
    rows, u, inv = t.batch_rows(rank)
    hb = kind > 0
    if _interval_changes(hb, inv, len(u), interval_s, t.hb_interval_s[rows], ~np.isnan(t.hb_time_s[rows])):
        return None
    base_int = w.interval_s() if w.intervals.heartbeating else np.inf
    if not w.clock.batch_believable(hb, time_s, interval_s, base_int, w.config.reference_max_lag_intervals):
        return None
    return _apply(w, rows, u, inv, hb, epoch.astype(np.int64), iteration.astype(np.int64), time_s, interval_s)


def _interval_changes(hb: np.ndarray, inv: np.ndarray, streams: int, interval_s: np.ndarray, held_s: np.ndarray,
                      had_hb: np.ndarray) -> bool:
    """Whether a stream's announced heartbeat interval changes in the batch (against the one it
    held, or between its own rows): the one-event path settles that."""
    if (hb & had_hb & (interval_s != held_s)).any():
        return True
    hb_intervals = interval_s[hb]
    if len(hb_intervals) and hb_intervals.min() != hb_intervals.max():  # one interval for all: none changes
        first_int = np.full(streams, np.nan)
        np.fmax.at(first_int, inv[hb], hb_intervals)
        low = np.full(streams, np.nan)
        np.fmin.at(low, inv[hb], hb_intervals)
        if not np.array_equal(first_int, low, equal_nan=True):
            return True
    return False


def _apply(w: FailStopWatch, rows: np.ndarray, u: np.ndarray, inv: np.ndarray, hb: np.ndarray, epoch: np.ndarray,
           iteration: np.ndarray, time_s: np.ndarray, interval_s: np.ndarray) -> list[LivenessChange]:
    """``ingest`` once the batch is known to be believable: per rank, what its rows leave."""
    t = w.table
    # the batch's rows as an index: a slice (views, no gathers) when it covers every row, as
    # the merge's batches do; ``u`` stays the rows' numbers
    uu: np.ndarray | slice = slice(0, t.n) if len(u) == t.n else u
    t.heard[uu] = True
    t_max = np.full(len(u), -np.inf)
    np.maximum.at(t_max, inv, time_s)
    before = t.time_s[uu]
    deadline_s = w.judgement.deadline_s
    if deadline_s < np.inf:
        crossing = (before <= deadline_s) & (deadline_s < t_max) & t.watched[uu]
        if w.dead:
            crossing &= ~np.isin(t.rank[u], np.fromiter(w.dead, np.int64, len(w.dead)))
        w.judgement.short_of_deadline -= int(np.count_nonzero(crossing))
    t.time_s[uu] = np.maximum(before, t_max)
    w.clock.newest_s = max(w.clock.newest_s, float(time_s.max()))
    w.progress.heard(int(epoch.max()))
    e_max = np.full(len(u), -1, np.int64)
    np.maximum.at(e_max, inv, epoch)
    moved = e_max > t.epoch[uu]
    reset = u[moved]
    t.epoch[reset], t.reported[reset], t.started[reset] = e_max[moved], -1, -1
    current = epoch == t.epoch[rows]  # rows of the epoch each stream is now in
    for col, sel in (("reported", ~hb), ("started", hb)):
        top = np.full(len(u), -1, np.int64)
        np.maximum.at(top, inv[sel & current], iteration[sel & current])
        getattr(t, col)[uu] = np.maximum(getattr(t, col)[uu], top)
    if hb.any():
        _apply_heartbeats(w, rows, u, uu, inv, hb, time_s, interval_s)
    t.missing[rows[~hb]] = 0
    fresh = u[~t.watched[uu] & ~t.retired[uu]]
    t.watched[fresh] = True
    w.watched_n += len(fresh)
    w.progress.note_batch(~hb, epoch, iteration, time_s)
    w.judgement.events_since_check += len(rows) - 1
    return w.judgement.maybe_check(w, float(time_s.max()))


def _apply_heartbeats(w: FailStopWatch, rows: np.ndarray, u: np.ndarray, uu: np.ndarray | slice, inv: np.ndarray,
                      hb: np.ndarray, time_s: np.ndarray, interval_s: np.ndarray) -> None:
    """Each stream's newest heartbeat and its interval; a stream's first one may lower the job's."""
    t = w.table
    last_hb = np.full(len(u), -np.inf)
    np.maximum.at(last_hb, inv[hb], time_s[hb])
    got = last_hb > -np.inf
    old = t.hb_time_s[uu]
    new_hb = got & np.isnan(old)
    for r in u[new_hb].tolist():
        w.intervals.first(float(interval_s[hb & (rows == r)][0]))
    t.hb_time_s[uu] = np.where(got, np.fmax(old, last_hb), old)
    interval = np.full(len(u), np.nan)
    np.fmax.at(interval, inv[hb], interval_s[hb])
    t.hb_interval_s[uu] = np.where(got, interval, t.hb_interval_s[uu])
