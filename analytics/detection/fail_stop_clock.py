"""The fail-stop watch's sense of time: which event times to believe, and the heartbeat interval
that is its unit.

An event's time is believed only within a bounded skew of what had arrived before it
(analytics/detection/fail_stop.py, Clocks): a time stamped far in the future would drag the job's
reference ahead and make every other rank look dead, unless enough of the job corroborates it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from analytics.detection.rank_streams import RankStreams

REFERENCE_QUANTILE = 1 / 3
log = logging.getLogger("analytics.detection.fail_stop")


@dataclass
class HeartbeatIntervals:
    """The shortest heartbeat interval announced (1 s before any heartbeat), cached: it is asked
    at every event."""

    cache_s: float | None = None  # the shortest, until a stream's announced interval changes
    heartbeating: int = 0  # streams that delivered a heartbeat so far

    def shortest_s(self, table: RankStreams) -> float:
        if self.cache_s is None:
            has = ~np.isnan(table.hb_time_s)
            self.cache_s = float(table.hb_interval_s[has].min()) if has.any() else 1.0
        return self.cache_s

    def first(self, interval_s: float) -> None:
        """A stream's first heartbeat, announcing ``interval_s``."""
        self.changed(None, interval_s)
        self.heartbeating += 1

    def changed(self, old_s: float | None, new_s: float) -> None:
        """Keep the cache: the minimum falls with a shorter interval; it may rise only when a
        stream that held it announces a longer one (then it is walked again)."""
        cached = self.cache_s
        if cached is None or old_s == new_s:
            return
        if self.heartbeating == 0 or new_s <= cached:
            self.cache_s = new_s
        elif old_s is not None and old_s <= cached:
            self.cache_s = None


@dataclass
class EventClock:
    """The newest believed event time of any stream, and the events whose time was not believed."""

    newest_s: float = float("-inf")
    untrusted_times: int = 0  # events whose time was not believed (too far ahead of the job's)

    def believable(self, table: RankStreams, rank: int, i: int, time_s: float, what: str, bound_s: float,
                   watched_n: int, live: Callable[[], np.ndarray]) -> bool:
        """Whether ``time_s`` is within ``bound_s`` of what arrived before; an unbelieved time is
        counted, logged (the first per rank, then every 100th) and remembered as the rank's claim,
        which the claims of more than a third of the ``watched_n`` watched ranks corroborate
        (``live``: the rows of the watched live ranks, should they)."""
        if not math.isfinite(time_s):
            self.untrusted_times += 1
            return False
        c = table.cols
        base = max(float(c["time_s"][i]), self.newest_s)
        if base == float("-inf") or time_s <= base + bound_s:
            return True
        c["claimed_s"][i] = max(float(c["claimed_s"][i]), time_s)
        floor = time_s - bound_s
        t = table
        backers = int(np.count_nonzero(t.watched & t.heard & (np.maximum(t.time_s, t.claimed_s) >= floor)))
        if watched_n and backers > REFERENCE_QUANTILE * watched_n:
            self._believe_claims(table, live(), floor, time_s)  # the job's clocks moved together (a restart after downtime)
            return True
        self.untrusted_times += 1
        c["untrusted"][i] += 1
        untrusted = int(c["untrusted"][i])
        if untrusted % 100 == 1:
            log.warning("%s", json.dumps({"event": "clock_skew", "rank": rank, "what": what,
                                          "ahead_s": round(time_s - base, 3), "bound_s": round(bound_s, 3),
                                          "untrusted": untrusted}))
        return False

    def _believe_claims(self, t: RankStreams, live: np.ndarray, floor_s: float, now_s: float) -> None:
        """The jump to ``now_s`` is corroborated: the claims at or after ``floor_s`` were true too,
        and the time before it was observed for nobody, so every other live rank counts as heard
        at ``now_s`` (as after an outage: only silence after the jump is judged)."""
        heard = np.where(t.claimed_s >= floor_s, t.claimed_s, now_s)[live]
        t.time_s[live] = np.maximum(t.time_s[live], heard)
        hb = t.hb_time_s[live]
        t.hb_time_s[live] = np.where(np.isnan(hb), hb, np.maximum(hb, heard))
        if len(heard):
            self.newest_s = max(self.newest_s, float(heard.max()))
        t.claimed_s[live] = -np.inf

    def batch_believable(self, hb: np.ndarray, time_s: np.ndarray, interval_s: np.ndarray, base_interval_s: float,
                         lag_intervals: float) -> bool:
        """Whether every row of a batch is believable against the newest time of the rows before
        it (``hb``: the heartbeat rows, which may shorten the interval the bound is counted in)."""
        if (math.isfinite(base_interval_s) and self.newest_s > -np.inf
                and not (hb & (interval_s < base_interval_s)).any()
                and bool((time_s <= self.newest_s + lag_intervals * base_interval_s).all())):
            return True  # every row within the bound of the newest time held before the batch
        hb_int = np.where(hb, interval_s, np.inf)
        int_before = np.minimum(base_interval_s, np.concatenate([[np.inf], np.minimum.accumulate(hb_int)[:-1]]))
        int_before = np.where(np.isinf(int_before), 1.0, int_before)
        newest_before = np.maximum(self.newest_s, np.concatenate([[-np.inf], np.maximum.accumulate(time_s)[:-1]]))
        bound = lag_intervals * int_before
        return bool(((newest_before == -np.inf) | (time_s <= newest_before + bound)).all())
