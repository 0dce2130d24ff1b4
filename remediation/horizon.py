"""How long the next plan is expected to run: the time until the fault set changes again.

A reshape pays a fixed pause; it is worth it only if its gain over the time it will run beats that.
Faults are bursty (a failing node degrades, then dies; one failure cascades into another), so the
planner's horizon follows the recent gaps between changes instead of a constant: the mean of the
last few gaps between changes of the known fault set, clipped to [min_s, default_s]. With fewer
than two changes seen it is ``default_s`` (the expected time between independent failures).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HorizonEstimator:
    default_s: float = 1800.0
    min_s: float = 60.0
    window: int = 3
    changes_s: list[float] = field(default_factory=list)

    def change(self, time_s: float) -> None:
        """Record that the known fault set changed at ``time_s``."""
        if not self.changes_s or time_s > self.changes_s[-1]:
            self.changes_s.append(time_s)

    def horizon_s(self) -> float:
        """Expected seconds until the next change."""
        if len(self.changes_s) < 2:
            return self.default_s
        recent = self.changes_s[-(self.window + 1):]
        gaps = [b - a for a, b in zip(recent, recent[1:])]
        return min(self.default_s, max(self.min_s, sum(gaps) / len(gaps)))
