"""The incident stream as one fold over contract events: every reader of incidents imports it.

    incident.opened → incident.confirmed | incident.updated (any number, any order) → incident.resolved

:class:`IncidentRecord` is one incident as the log says it stands now: its category, severity and
locations (an update's or a confirmation's locations replace the opening's: a probe that names the
device is the better word), whether it is open, confirmed or resolved. :func:`transition` applies
one event to an :class:`IncidentLifecycle` (no I/O), so the remediation engine, the console's read
model, the demo's watcher, the closed loop's referee and the goodput fold read the same incidents
from the same log. Each reader keeps only its own projection on top (the console the events'
history for its timeline, goodput the drag each incident cost).

Anything that must not take effect is *reported*, never applied: a second opening of an incident id
(the first is kept), a confirmation, update or resolution of an incident never opened. A second
confirmation or resolution keeps the first one's word. Events are admitted the way the plan fold
admits them (collector/plan_lifecycle.py's :func:`~collector.plan_lifecycle.admit`): once per id,
only for the fold's job, and only when signed by the analytics role; a forgery is kept in
``rejected`` with why, and reported.

The fold lives in collector/ because it reads nothing but the contract: analytics (goodput), which
must not import remediation, folds it as well as the engine and the console do. Its records are
plain data (:meth:`IncidentRecord.to_state`) so a reader that stores its state with its offsets
(goodput) stores them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from collector.events import (
    Envelope, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated, Location, Severity,
)
from collector.plan_lifecycle import Admission, admit

# What an incident reads when nothing calibrated says how sure its fault is real (a schema 1–2
# record, a baseline detector's): as likely real as not. Readers that act on p_real (the auto-apply
# policy) also check ``IncidentRecord.calibrated``.
UNCALIBRATED = 0.5


class IncidentStatus(StrEnum):
    """Where an incident stands. The values are what the demo and the engine's logs show."""

    OPEN = "open"
    CONFIRMED = "confirmed"
    RESOLVED = "resolved"


@dataclass
class IncidentRecord:
    """One incident as the fold knows it. ``locations`` are the newest ones the stream gave."""

    incident_id: str
    category: FaultCategory
    severity: Severity
    locations: list[Location]
    summary: str
    opened_iteration: int
    status: IncidentStatus = IncidentStatus.OPEN
    # the iteration of its latest update (or opening): the faults it describes have been as they are
    # since then, so a plan answering it is judged against the old layout's samples from there on
    changed_iteration: int = -1
    opened_at_s: float = 0.0  # the opening event's time (the analytics consumer stamps the telemetry's)
    # the first iteration of the opening's evidence (the opening iteration when it names none): the
    # fault has cost time since then, before the detector could tell
    evidence_from_iteration: int = -1
    probing: tuple[int, ...] = ()  # ranks a probe re-asks since the latest update: a better location follows
    probing_since_s: float = 0.0  # that update's time
    confirmed_by: str | None = None  # the first confirmation's method (probe, …)
    # How sure the detector is that the fault is real: the latest p_real its events carried
    # (docs/detector.md, "Confidence"); UNCALIBRATED, with calibrated False, when none carried one.
    p_real: float = UNCALIBRATED
    calibrated: bool = False

    @property
    def is_open(self) -> bool:
        return self.status != IncidentStatus.RESOLVED

    @property
    def factor(self) -> float:
        """The largest slowdown factor its locations name (1.0: none named): the detector's word."""
        return max((loc.factor for loc in self.locations), default=1.0)

    @property
    def place_confidence(self) -> float:
        """How sure the detector is of the place: the best of its locations' (0.0: none named)."""
        return max((loc.place_confidence for loc in self.locations), default=0.0)

    def to_state(self) -> dict[str, Any]:
        """The record as plain data (JSON-ready); :meth:`from_state` reads it back."""
        return {"incident_id": self.incident_id, "category": self.category.value, "severity": self.severity.value,
                "locations": [loc.model_dump(mode="json") for loc in self.locations], "summary": self.summary,
                "opened_iteration": self.opened_iteration, "status": self.status.value,
                "changed_iteration": self.changed_iteration, "opened_at_s": self.opened_at_s,
                "evidence_from_iteration": self.evidence_from_iteration, "probing": list(self.probing),
                "probing_since_s": self.probing_since_s, "confirmed_by": self.confirmed_by, "p_real": self.p_real,
                "calibrated": self.calibrated}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> IncidentRecord:
        return cls(state["incident_id"], FaultCategory(state["category"]), Severity(state["severity"]),
                   [Location.model_validate(loc) for loc in state["locations"]], state["summary"],
                   state["opened_iteration"], IncidentStatus(state["status"]), state["changed_iteration"],
                   state["opened_at_s"], state["evidence_from_iteration"], tuple(state["probing"]),
                   state["probing_since_s"], state["confirmed_by"], state.get("p_real", UNCALIBRATED),
                   state.get("calibrated", False))  # a state stored before p_real: uncalibrated


@dataclass
class IncidentLifecycle(Admission):
    """The fold's state for one job (``job=None``: every job's incidents together).

    Subclasses may override :meth:`faults_changed`, the point where a reader learns that the set
    of faults it plans around changed (an incident opened, moved or resolved)."""

    incidents: dict[str, IncidentRecord] = field(default_factory=dict)

    def faults_changed(self, record: IncidentRecord) -> None:
        """``record`` opened, was resolved, or has new locations (a confirmation naming none does not count)."""

    def open_incidents(self) -> list[IncidentRecord]:
        return [i for i in self.incidents.values() if i.is_open]


def step(state: IncidentLifecycle, event: Envelope) -> IncidentRecord | None:
    """:func:`~collector.plan_lifecycle.admit` then :func:`transition`."""
    return transition(state, event) if admit(state, event) else None


def transition(state: IncidentLifecycle, event: Envelope) -> IncidentRecord | None:
    """Apply one admitted event. Returns the incident it changed (None: it changed none — reported,
    or another stream's event)."""
    p = event.payload
    if isinstance(p, IncidentOpened):
        return _opened(state, event, p)
    if isinstance(p, IncidentConfirmed | IncidentUpdated | IncidentResolved):
        return _later(state, event, p)
    return None


# ---- transitions ---------------------------------------------------------------------------------


def _opened(state: IncidentLifecycle, e: Envelope, p: IncidentOpened) -> IncidentRecord | None:
    if p.incident_id in state.incidents:
        state.report(e, f"incident {p.incident_id} opened twice; kept the first")
        return None
    record = state.incidents[p.incident_id] = IncidentRecord(
        p.incident_id, p.category, p.severity, list(p.locations), p.summary, p.iteration,
        changed_iteration=p.iteration, opened_at_s=e.time_s,
        evidence_from_iteration=min(min(p.evidence.iterations, default=p.iteration), p.iteration))
    _read_p_real(record, p)
    state.faults_changed(record)
    return record


_WHAT = {IncidentConfirmed: "confirmation", IncidentUpdated: "update", IncidentResolved: "resolution"}


def _later(state: IncidentLifecycle, e: Envelope,
           p: IncidentConfirmed | IncidentUpdated | IncidentResolved) -> IncidentRecord | None:
    """A confirmation, update or resolution of an incident the fold holds; one about an incident
    never opened is reported and ignored."""
    record = state.incidents.get(p.incident_id)
    if record is None:
        state.report(e, f"{_WHAT[type(p)]} of unknown incident {p.incident_id}")
        return None
    if not isinstance(p, IncidentResolved):
        _read_p_real(record, p)
    if isinstance(p, IncidentUpdated):
        record.severity = p.severity
        record.changed_iteration = max(record.changed_iteration, p.iteration)
        record.probing, record.probing_since_s = tuple(p.probing), e.time_s
        record.locations = list(p.locations)
    elif isinstance(p, IncidentConfirmed):
        record.status, record.probing = IncidentStatus.CONFIRMED, ()
        record.confirmed_by = record.confirmed_by or p.method
        if not p.locations:
            return record  # confirmed where it was: the faults are the same
        record.locations = list(p.locations)
    else:
        record.status, record.probing = IncidentStatus.RESOLVED, ()
    state.faults_changed(record)
    return record


def _read_p_real(record: IncidentRecord, p: IncidentOpened | IncidentConfirmed | IncidentUpdated) -> None:
    """An event that carries p_real sets it; one without (schema 1–2) leaves what the record holds."""
    if p.p_real is not None:
        record.p_real, record.calibrated = p.p_real, True


PAYLOADS: tuple[type, ...] = (IncidentOpened, *_WHAT)  # what this fold reads: a reader of several streams routes by it
