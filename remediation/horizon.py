"""How long the next plan is expected to run: the time until the fault set changes again.

A reshape pays a fixed pause; it is worth it only if its gain over the time it will run beats that.
Faults are bursty (a failing node degrades, then dies; one failure cascades into another), so the
planner's horizon follows the recent gaps between changes instead of a constant: the mean of the
last few gaps between changes of the known fault set, clipped to [min_s, default_s]. With fewer
than two changes seen it is ``default_s`` (the expected time between independent failures).

The gap still open counts too. Changes as a Poisson process with an unknown rate: the estimate of
the mean gap is the time observed over the number of changes, and the time since the last change
is observed time like any other (a censored gap). So a calm after a burst lengthens the horizon —
after four faults in six minutes and then twenty calm minutes, the next change is not "two minutes
away" any more — and a plan not worth its pause over the burst's pace can become worth it.
"""

from __future__ import annotations

import math
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

    def horizon_s(self, now_s: float | None = None) -> float:
        """Expected seconds until the next change, as seen at ``now_s`` (the open gap since the
        last change counts as observed calm; without ``now_s`` only closed gaps count)."""
        if len(self.changes_s) < 2:
            return self.default_s
        recent = self.changes_s[-(self.window + 1):]
        gaps = [b - a for a, b in zip(recent, recent[1:])]
        calm = max(0.0, now_s - recent[-1]) if now_s is not None else 0.0
        return min(self.default_s, max(self.min_s, (sum(gaps) + calm) / len(gaps)))

    def band(self, now_s: float | None = None) -> int:
        """Which doubling of ``min_s`` the horizon is in: a planner that declined a reshape over a
        short horizon looks again when the band moves (the horizon doubled or halved), not at every
        second of calm."""
        return int(math.floor(math.log2(self.horizon_s(now_s) / self.min_s)))
