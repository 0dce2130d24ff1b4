"""Baseline detectors, in the same harness as ours: events in, incident payloads out.

None of them look at sequence lengths or the schedule; that is the point of comparing.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

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
class _WholeJobBaseline:
    """What the two whole-job baselines share: they read one wall time per iteration (from
    IterationSummary, each iteration once) and keep at most one job-level incident open. A
    subclass judges each new time in ``_judge``; its ``name`` starts its incident ids."""

    name: ClassVar[str]
    job: str
    _seen: set[int] = field(default_factory=set, init=False)
    _open_id: str | None = field(default=None, init=False)

    def on_event(self, event: Envelope) -> list[Payload]:
        p = event.payload
        if event.job != self.job or not isinstance(p, IterationSummary):
            return []
        return self.observe(p.iteration, p.wall_s)

    def observe(self, iteration: int, wall_s: float) -> list[Payload]:
        """One iteration's wall time (each iteration once): what ``on_event`` reads of a summary,
        and all a replay needs (``resihp bench detect`` tunes the thresholds on recorded times)."""
        if iteration in self._seen:
            return []
        self._seen.add(iteration)
        return self._judge(iteration, wall_s)

    def _judge(self, iteration: int, wall_s: float) -> list[Payload]:
        raise NotImplementedError

    def flush(self) -> list[Payload]:
        return []

    def _open(self, iteration: int, factor: float, statistic: str, summary: str) -> list[Payload]:
        inc = _incident(self.name, self.job, iteration, [Location(target="compute", factor=factor)], factor,
                        statistic, summary)
        self._open_id = inc.incident_id
        return [inc]

    def _resolve(self, iteration: int, reason: str) -> list[Payload]:
        assert self._open_id is not None
        out: list[Payload] = [IncidentResolved(incident_id=self._open_id, iteration=iteration, reason=reason)]
        self._open_id = None
        return out


@dataclass
class RawThresholdDetector(_WholeJobBaseline):
    """Iteration wall time above ``factor`` × the median of a warm-up window, ``consecutive``
    times. Blind to what the iteration was asked to do, so sequence-length variation trips it."""

    name: ClassVar[str] = "raw_threshold"
    factor: float = 1.2
    warmup_iterations: int = 10
    consecutive: int = 2
    _warm: list[float] = field(default_factory=list)
    _over: int = 0

    def _judge(self, iteration: int, wall_s: float) -> list[Payload]:
        if len(self._warm) < self.warmup_iterations:
            self._warm.append(wall_s)
            return []
        base = float(np.median(self._warm))
        self._over = self._over + 1 if wall_s > self.factor * base else 0
        if self._open_id is None and self._over >= self.consecutive:
            return self._open(iteration, wall_s / base, f"iteration time > {self.factor}× warm-up median",
                              "iteration time above threshold")
        if self._open_id is not None and self._over == 0:
            return self._resolve(iteration, "iteration time back under threshold")
        return []


@dataclass
class ChangePointDetector(_WholeJobBaseline):
    """Greyhound-style: a mean shift of at least ``min_shift`` (10%) on raw iteration time between
    a reference window and a recent window, change points at least ``min_distance`` iterations
    apart. Up-shifts open an incident, down-shifts resolve it."""

    name: ClassVar[str] = "greyhound_changepoint"
    min_shift: float = 0.10
    min_distance: int = 20
    reference_window: int = 20
    recent_window: int = 5
    _hist: deque = field(default_factory=lambda: deque(maxlen=200))
    _last_change: int = -10**9

    def _judge(self, iteration: int, wall_s: float) -> list[Payload]:
        self._hist.append(wall_s)
        n = self.reference_window + self.recent_window
        if len(self._hist) < n or iteration - self._last_change < self.min_distance:
            return []
        h = list(self._hist)[-n:]
        ref, recent = float(np.mean(h[: self.reference_window])), float(np.mean(h[self.reference_window:]))
        shift = recent / ref - 1.0
        if shift >= self.min_shift and self._open_id is None:
            self._last_change = iteration
            return self._open(iteration, 1 + shift, f"mean shift ≥ {self.min_shift:.0%} on raw iteration time",
                              "change point: slower")
        if shift <= -self.min_shift / (1 + self.min_shift) and self._open_id is not None:
            self._last_change = iteration
            return self._resolve(iteration, "change point: faster again")
        return []


@dataclass
class RelativeRankDetector:
    """NVIDIA-resiliency-style: each rank's median compute time over a window against the best
    (fastest) rank's; a score best/rank below ``threshold`` (0.75) flags the rank. It localises,
    but treats every rank as doing the same work: stage imbalance looks like a fault."""

    name: ClassVar[str] = "nvrx_relative"
    job: str
    threshold: float = 0.75
    window: int = 10
    _times: dict[int, deque] = field(default_factory=dict)
    _coords: dict[int, tuple[int, int]] = field(default_factory=dict)
    _open: dict[int, str] = field(default_factory=dict)
    _last_iteration: int = -1

    def on_event(self, event: Envelope) -> list[Payload]:
        p = event.payload
        if event.job != self.job or not isinstance(p, RankIteration):
            return []
        return self.observe(p.iteration, p.rank, p.coords.dp, p.coords.pp, sum(p.chunk_table.duration_s))

    def observe(self, iteration: int, rank: int, replica: int, stage: int, compute_s: float) -> list[Payload]:
        """One rank's compute time in one iteration (its chunks' durations summed): what ``on_event``
        reads of a report, and all a replay needs."""
        out: list[Payload] = []
        if iteration != self._last_iteration and self._last_iteration >= 0:
            out = self._score(self._last_iteration)
        self._last_iteration = iteration
        self._times.setdefault(rank, deque(maxlen=self.window)).append(compute_s)
        self._coords[rank] = (replica, stage)
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
