"""Baseline detectors, in the same harness as ours: events in, incident payloads out.

- ``RawThresholdDetector``: iteration wall time above ``factor`` × the median of a warm-up window.
  Blind to what the iteration was asked to do, so sequence-length variation trips it.
- ``ChangePointDetector`` (Greyhound-style): a mean shift of at least ``min_shift`` (10%) on raw
  iteration time between a reference window and a recent window, change points at least
  ``min_distance`` iterations apart. Up-shifts open an incident, down-shifts resolve it.
- ``RelativeRankDetector`` (NVIDIA-resiliency-style): each rank's median compute time over a window
  against the best (fastest) rank's; a score best/rank below ``threshold`` (0.75) flags the rank.
  It localises, but treats every rank as doing the same work: stage imbalance looks like a fault.

None of them look at sequence lengths or the schedule; that is the point of comparing.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from collector.events import (
    Envelope, Evidence, FaultCategory, IncidentOpened, IncidentResolved, IterationSummary, Location, Payload,
    RankIteration, Severity,
)

_NS = uuid.UUID("5e1d7c3a-0b9f-4a2e-8d6c-3f7a1b2c9e80")


def _incident(name: str, job: str, iteration: int, locations: list[Location], factor: float, statistic: str,
              summary: str) -> IncidentOpened:
    return IncidentOpened(
        incident_id=f"{name}-" + uuid.uuid5(_NS, f"{name}/{job}/{iteration}/{locations}").hex[:12],
        category=FaultCategory.FAIL_SLOW, severity=Severity.MEDIUM, iteration=iteration, locations=locations,
        evidence=Evidence(iterations=[iteration], statistic=statistic), summary=summary)


@dataclass
class _JobIncident:
    """The one job-level incident a whole-job baseline keeps open at a time."""

    name: str
    job: str
    open_id: str | None = None

    def open(self, iteration: int, factor: float, statistic: str, summary: str) -> list[Payload]:
        inc = _incident(self.name, self.job, iteration, [Location(target="compute", factor=factor)], factor,
                        statistic, summary)
        self.open_id = inc.incident_id
        return [inc]

    def resolve(self, iteration: int, reason: str) -> list[Payload]:
        assert self.open_id is not None
        out: list[Payload] = [IncidentResolved(incident_id=self.open_id, iteration=iteration, reason=reason)]
        self.open_id = None
        return out


class _JobSeries:
    """Iteration wall times from IterationSummary (or, lacking one, the slowest rank's wall_s)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def times(self, event: Envelope) -> tuple[int, float] | None:
        p = event.payload
        if isinstance(p, IterationSummary) and p.iteration not in self.seen:
            self.seen.add(p.iteration)
            return p.iteration, p.wall_s
        return None


@dataclass
class RawThresholdDetector:
    job: str
    factor: float = 1.2
    warmup_iterations: int = 10
    consecutive: int = 2
    name: str = "raw_threshold"
    _series: _JobSeries = field(default_factory=_JobSeries)
    _warm: list[float] = field(default_factory=list)
    _over: int = 0
    _incident: _JobIncident = field(init=False)

    def __post_init__(self) -> None:
        self._incident = _JobIncident(self.name, self.job)

    def on_event(self, event: Envelope) -> list[Payload]:
        got = self._series.times(event) if event.job == self.job else None
        if got is None:
            return []
        it, wall = got
        if len(self._warm) < self.warmup_iterations:
            self._warm.append(wall)
            return []
        base = float(np.median(self._warm))
        self._over = self._over + 1 if wall > self.factor * base else 0
        incident = self._incident
        if incident.open_id is None and self._over >= self.consecutive:
            return incident.open(it, wall / base, f"iteration time > {self.factor}× warm-up median",
                                 "iteration time above threshold")
        if incident.open_id is not None and self._over == 0:
            return incident.resolve(it, "iteration time back under threshold")
        return []

    def flush(self) -> list[Payload]:
        return []


@dataclass
class ChangePointDetector:
    job: str
    min_shift: float = 0.10
    min_distance: int = 20
    reference_window: int = 20
    recent_window: int = 5
    name: str = "greyhound_changepoint"
    _series: _JobSeries = field(default_factory=_JobSeries)
    _hist: deque = field(default_factory=lambda: deque(maxlen=200))
    _last_change: int = -10**9
    _incident: _JobIncident = field(init=False)

    def __post_init__(self) -> None:
        self._incident = _JobIncident(self.name, self.job)

    def on_event(self, event: Envelope) -> list[Payload]:
        got = self._series.times(event) if event.job == self.job else None
        if got is None:
            return []
        it, wall = got
        self._hist.append(wall)
        n = self.reference_window + self.recent_window
        if len(self._hist) < n or it - self._last_change < self.min_distance:
            return []
        h = list(self._hist)[-n:]
        ref, recent = float(np.mean(h[: self.reference_window])), float(np.mean(h[self.reference_window:]))
        shift = recent / ref - 1.0
        incident = self._incident
        if shift >= self.min_shift and incident.open_id is None:
            self._last_change = it
            return incident.open(it, 1 + shift, f"mean shift ≥ {self.min_shift:.0%} on raw iteration time",
                                 "change point: slower")
        if shift <= -self.min_shift / (1 + self.min_shift) and incident.open_id is not None:
            self._last_change = it
            return incident.resolve(it, "change point: faster again")
        return []

    def flush(self) -> list[Payload]:
        return []


@dataclass
class RelativeRankDetector:
    job: str
    threshold: float = 0.75
    window: int = 10
    name: str = "nvrx_relative"
    _times: dict[int, deque] = field(default_factory=dict)
    _coords: dict[int, tuple[int, int]] = field(default_factory=dict)
    _open: dict[int, str] = field(default_factory=dict)
    _last_iteration: int = -1

    def on_event(self, event: Envelope) -> list[Payload]:
        p = event.payload
        if event.job != self.job or not isinstance(p, RankIteration):
            return []
        out: list[Payload] = []
        if p.iteration != self._last_iteration and self._last_iteration >= 0:
            out = self._score(self._last_iteration)
        self._last_iteration = p.iteration
        self._times.setdefault(p.rank, deque(maxlen=self.window)).append(sum(c.duration_s for c in p.chunks))
        self._coords[p.rank] = (p.coords.dp, p.coords.pp)
        return out

    def _score(self, iteration: int) -> list[Payload]:
        full = {r: float(np.median(t)) for r, t in self._times.items() if len(t) >= self.window // 2}
        if len(full) < 2:
            return []
        best = min(full.values())
        out: list[Payload] = []
        for r, med in full.items():
            score = best / med
            if score < self.threshold and r not in self._open:
                dp, pp = self._coords[r]
                inc = _incident(self.name, self.job, iteration,
                                [Location(target="compute", rank=r, replica=dp, stage=pp, factor=1 / score)], 1 / score,
                                f"rank median / best rank median, score < {self.threshold}", f"rank {r} is slow")
                self._open[r] = inc.incident_id
                out.append(inc)
            elif score >= self.threshold and r in self._open:
                out.append(IncidentResolved(incident_id=self._open.pop(r), iteration=iteration,
                                            reason="score back above threshold"))
        return out

    def flush(self) -> list[Payload]:
        return self._score(self._last_iteration) if self._last_iteration >= 0 else []
