"""What the incident book holds per open incident: its suspect, its size, its probe.

The book (analytics/detection/incidents.py) keeps the lifecycle (open, update, confirm, resolve);
its probe half (analytics/detection/incident_probes.py) asks probes and judges their answers. Both
read and write these records, so they live here, below both.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Literal

from analytics.detection.calibration import COMPUTE_CUSUM, p_real
from analytics.detection.incident_keys import IncidentKey, ProbeKind
from collector.events import Evidence, FaultCategory, Location, LocationTarget, Severity

_NS = uuid.UUID("0c5a7f0e-9b1d-4b8e-8f2a-5d3c1e7a9b40")
DEAD_FACTOR = 1e6


def incident_id(job: str, key: IncidentKey, iteration: int) -> str:
    """The id of ``job``'s incident at ``key`` opened at ``iteration``: the same in every replay."""
    return "inc-" + uuid.uuid5(_NS, f"{job}/{key}/{iteration}").hex[:16]


def severity_of(factor: float) -> Severity:
    """How urgent an incident is, from its size alone: what the slowdown costs the job, whatever
    found it (a rank, a link, the iteration's excess, a probe). A dead rank is critical because its
    size (``DEAD_FACTOR``) is: a fail-stop is always sized so."""
    if not factor < 3.0:
        return Severity.CRITICAL
    if factor < 1.1:
        return Severity.LOW
    if factor < 1.5:
        return Severity.MEDIUM
    return Severity.HIGH


@dataclass
class Suspect:
    """What the detector knows about a location when it raises an incident."""

    key: IncidentKey
    target: LocationTarget
    rank: int | None
    link: tuple[int, int] | None
    node: int | None
    replica: int | None
    stage: int | None
    tp_group: tuple[int, ...] | None
    factor: float
    place_confidence: float  # share of the evidence pointing at this place (Location.place_confidence)
    iterations: list[int]
    observed_s: list[float]
    predicted_s: list[float]
    rank_factors: dict[int, float]
    statistic: str
    note: str
    ranks: tuple[int, ...] = ()  # the compute suspects (one, or a TP group telemetry cannot split)
    # Ranks whose links to probe when the compute probe of ``ranks`` finds nobody slow: time lost
    # outside the traced ranks is an untraced rank's compute or some link or NIC (analytics/detection/untraced.py).
    link_probe_ranks: tuple[int, ...] = ()
    # What the factor slows: the rank's chunks (telemetry's measure) or its compute alone (a probe's,
    # for a rank no telemetry sees: Location.measure).
    measure: Literal["chunks", "compute"] = "chunks"
    # The evidence it rests on and how far that passed its alarm bar (analytics/detection/calibration.py):
    # what the incident's p_real is read from.
    basis: str = COMPUTE_CUSUM
    margin: float = 0.0

    def location(self, factor: float | None = None) -> Location:
        return Location(target=self.target, rank=self.rank, link=self.link, node=self.node, replica=self.replica,
                        stage=self.stage, tp_group=self.tp_group, factor=max(factor or self.factor, 1e-6),
                        place_confidence=self.place_confidence, measure=self.measure)

    def evidence(self) -> Evidence:
        return Evidence(iterations=self.iterations, observed_s=self.observed_s, predicted_s=self.predicted_s,
                        rank_factors=self.rank_factors, statistic=self.statistic, note=self.note,
                        basis=self.basis, margin=round(self.margin, 4) if math.isfinite(self.margin) else None)

    def p_real(self) -> float:
        """How sure an incident on this evidence is that its fault is real (the calibrated table)."""
        return p_real(self.basis, self.margin)


@dataclass
class IncidentProbe:
    """One incident's probe state: which probe it asked, the answers in, and whether a probe has
    named its location (then a naming probe is not asked again, and a rank that gets worse has
    its TP group re-probed instead)."""

    kind: ProbeKind = ProbeKind.NAMING  # which probe is pending (or was asked last)
    id: str | None = None
    ratios: dict[int, float] = field(default_factory=dict)  # rank → its time over the healthy reference
    asked_iteration: int | None = None  # when the pending probe was asked (None: none pending)
    named: bool = False  # a probe's answers named (or confirmed) the suspect
    health_asked_iteration: int | None = None  # when the last health probe was asked
    health_probes: int = 0  # asked since it was left out: each one doubles the wait for the next

    def ask(self, kind: ProbeKind, probe_id: str, iteration: int) -> str:
        """A new probe is pending: its answers are judged as ``kind``'s. Returns its id."""
        self.kind, self.id, self.ratios, self.asked_iteration = kind, probe_id, {}, iteration
        return probe_id


@dataclass
class OpenIncident:
    incident_id: str
    category: FaultCategory
    suspect: Suspect
    opened_iteration: int
    factor: float
    published_factor: float  # the size consumers hold: the last one an opening, confirmation or update carried
    p_real: float = 0.5  # how sure the opening's evidence is that the fault is real: every event of it carries this
    confirmed: bool = False
    healthy_streak: int = 0
    last_update_iteration: int = -1
    probe: IncidentProbe = field(default_factory=IncidentProbe)
    probe_sized: bool = False  # the location itself was measured (a probe, a link's own timers): its factor is that
    # A fail-slow rank the running plan leaves out sends no telemetry: only a probe can see it heal.
    # The iteration from which no telemetry sees it (the plan left it out, or nobody traces it and a
    # sweep probe found it): it is health-probed now and then instead (None: telemetry judges it).
    excluded_since: int | None = None
    unseen: bool = False  # found by a sweep of ranks nobody traces: health-probed in any plan
    # The size as telemetry measures it, one factor per slow iteration since the opening (or the
    # last update that moved it by more than update_min_change): the refinement's evidence.
    slow_factors: list[float] = field(default_factory=list)
    refined: int = 0  # how many of the config's refine_iterations points the size was estimated again at

    def left_out(self, iteration: int) -> None:
        """No telemetry sees it from ``iteration``: health probes start counting from there."""
        self.excluded_since, self.probe.health_asked_iteration, self.probe.health_probes = iteration, None, 0
