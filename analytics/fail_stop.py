"""Fail-stop: a rank whose heartbeats stop, or whose telemetry stops while its peers' goes on.

Heartbeats come on a timer independent of progress, so they separate "dead" from "stuck in a
collective behind a dead peer" (a synchronous job stalls as a whole when one rank dies, and then
everyone's telemetry stops). The clock is the largest event time seen: never this process's own
clock, so a replayed trace gives the same verdicts. Hosts' clocks may differ by a little; the
threshold is several intervals (``heartbeat_miss_intervals``) for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from analytics.detector_config import DetectorConfig
from collector.events import Heartbeat


@dataclass(frozen=True)
class LivenessChange:
    rank: int
    alive: bool
    reason: str


@dataclass
class FailStopWatch:
    config: DetectorConfig
    dead: set[int] = field(default_factory=set)
    now_s: float = 0.0
    _last_hb: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (time_s, interval_s)
    _missing: dict[int, int] = field(default_factory=dict)
    _retired: set[int] = field(default_factory=set)
    _next_check_s: float = 0.0

    def heartbeat(self, hb: Heartbeat, time_s: float) -> list[LivenessChange]:
        self._last_hb[hb.rank] = (time_s, hb.interval_s)
        self.now_s = max(self.now_s, time_s)
        out = []
        if hb.rank in self.dead and hb.rank not in self._retired and self._missing.get(hb.rank, 0) == 0:
            self.dead.discard(hb.rank)
            out.append(LivenessChange(hb.rank, True, "heartbeats resumed"))
        if self.now_s >= self._next_check_s:
            out += self._check_heartbeats()
            self._next_check_s = self.now_s + 0.5 * hb.interval_s
        return out

    def _check_heartbeats(self) -> list[LivenessChange]:
        out = []
        miss = self.config.heartbeat_miss_intervals
        for rank, (t, interval) in self._last_hb.items():
            if rank in self.dead or rank in self._retired:
                continue
            if self.now_s - t > miss * interval:
                self.dead.add(rank)
                out.append(LivenessChange(rank, False, f"no heartbeat for {self.now_s - t:.1f} s "
                                                       f"(> {miss:g} intervals of {interval:g} s)"))
        return out

    def telemetry(self, rank: int, iteration: int, time_s: float) -> list[LivenessChange]:
        self.now_s = max(self.now_s, time_s)
        self._missing[rank] = 0
        if rank in self.dead:
            last = self._last_hb.get(rank)
            if last is None or self.now_s - last[0] <= self.config.heartbeat_miss_intervals * last[1]:
                self.dead.discard(rank)
                return [LivenessChange(rank, True, f"telemetry resumed at iteration {iteration}")]
        return []

    def missing(self, ranks: set[int], iteration: int) -> list[LivenessChange]:
        """Ranks expected in this iteration's frame that did not report."""
        out = []
        for rank in ranks:
            n = self._missing.get(rank, 0) + 1
            self._missing[rank] = n
            if n >= self.config.telemetry_lag_iterations and rank not in self.dead and rank not in self._retired:
                self.dead.add(rank)
                out.append(LivenessChange(rank, False, f"telemetry stopped: no report for {n} iterations "
                                                       f"while peers reported (up to iteration {iteration})"))
        return out

    def new_epoch(self, present: set[int]) -> None:
        """Ranks outside the new plan are no longer watched (nor dead: they were reconfigured away)."""
        self._retired = set(self._last_hb) - present
        self.dead &= present
        self._missing = {r: 0 for r in present}
