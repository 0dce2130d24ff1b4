"""Which open incidents the planner can plan around now, and which must wait to be located.

The detector does not always name a device at once: a fail-slow in a lock-step TP group is
first opened on the whole group (``Location.rank`` unset, ``tp_group`` set) until a probe names
the member (``incident.confirmed`` / ``incident.updated`` with the rank), and a communication
slowdown may be opened with no link at all. Planning around a whole TP group at once would
reshape twice (once around the group, once around the member) and exclude seven good GPUs to
avoid one bad one, so:

* a **group-level fail-slow** waits up to ``wait_s`` (event time since the incident opened) for
  the location that names the rank; after that the group is treated as slow as a whole (every
  member slow by the factor: the group runs at that speed) and the planner plans around it;
* a **group-level fail-stop** is planned around at once (the job hangs meanwhile): the whole
  group is treated as dead; once the member is named, its healthy peers re-grow into the plan;
* a location that names **no device** (a link fault with no ends) cannot be planned around; it
  waits for a confirmation that locates it, and is reported meanwhile;
* an incident whose latest update says a probe is **re-asking** its TP group (the named member
  got slower, which is how a lock-step peer slowing too first shows) holds planning for up to
  ``wait_s`` after that update: the answer may name more slow members, and a plan made before it
  keeps them (it ran, failed verification and was rolled back: two pauses for nothing). Its
  location stays in the view; the engine plans anyway while a fail-stop is open (the job hangs).

Every location left out is listed in :attr:`PlanningView.waiting` with the reason, so the engine
can report it (never silently dropped). The view is a pure function of the fold and the clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from collector.events import FaultCategory, Location
from remediation.cluster import precision
from collector.incident_lifecycle import IncidentRecord


@dataclass(frozen=True)
class Waiting:
    """An incident (or one of its locations) the planner leaves out for now, and why."""

    incident_id: str
    reason: str
    until_s: float | None = None  # event time after which it is planned around anyway (None: until located)


@dataclass(frozen=True)
class PlanningView:
    incidents: list[tuple[FaultCategory, list[Location]]] = field(default_factory=list)
    waiting: list[Waiting] = field(default_factory=list)
    grouped: tuple[str, ...] = ()  # incidents whose TP-group location is planned around as a whole
    probing: tuple[str, ...] = ()  # incidents whose TP group a probe re-asks: planning waits for the answer

    @property
    def key(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What changes the view without a new incident event (a wait running out)."""
        return self.grouped, self.probing


def planning_view(open_incidents: Iterable[IncidentRecord], now_s: float, wait_s: float) -> PlanningView:
    """The view of ``open_incidents`` at event time ``now_s`` (see the module docstring)."""
    usable: list[tuple[FaultCategory, list[Location]]] = []
    waiting: list[Waiting] = []
    grouped: list[str] = []
    probing: list[str] = []
    for inc in open_incidents:
        if inc.probing and now_s < inc.probing_since_s + wait_s:
            probing.append(inc.incident_id)
            members = ", ".join(str(d) for d in inc.probing)
            waiting.append(Waiting(
                inc.incident_id,
                f"incident {inc.incident_id} got worse and a probe is re-asking TP group [{members}]; waiting up "
                f"to {wait_s:.0f} s for the answer before planning (another member may be slow too)",
                until_s=inc.probing_since_s + wait_s))
        keep: list[Location] = []
        for loc in inc.locations:
            kind = precision(loc)
            if kind == "device":
                keep.append(loc)
            elif kind == "group":
                deadline = inc.opened_at_s + wait_s
                if FaultCategory(inc.category) == FaultCategory.FAIL_STOP or now_s >= deadline:
                    keep.append(loc)
                    if inc.incident_id not in grouped:
                        grouped.append(inc.incident_id)
                else:
                    members = ", ".join(str(d) for d in loc.tp_group or ())
                    waiting.append(Waiting(
                        inc.incident_id,
                        f"incident {inc.incident_id} names TP group [{members}] but not the slow member; waiting up "
                        f"to {wait_s:.0f} s for a probe to name it, then planning around the whole group",
                        until_s=deadline))
            else:
                waiting.append(Waiting(
                    inc.incident_id,
                    f"incident {inc.incident_id} ({loc.target} fault) names no device (no link ends, rank or node); "
                    "nothing to plan around until a confirmation locates it"))
        if keep:
            usable.append((FaultCategory(inc.category), keep))
    return PlanningView(usable, waiting, tuple(grouped), tuple(probing))
