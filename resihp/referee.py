"""The referee: which incident detects which injected fault, how precisely, which are false alarms.

One home for scoring a run against the simulator's or the launcher's ground truth
(``truth.fault``), used by ``resihp bench detect`` (bench/detect.py), the closed loop
(resihp/closed_loop.py: ``resihp bench recover --loop bus``) and the demo's summary
(resihp/demo/summary.py), so the three cannot disagree on what a match is.

The meaning, in the words every scorer uses:

- **Devices a fault hits** (``fault_devices``): its rank, a link's two ends, or every device of a
  node. Never its TP group: the truth carries the group as coordinates, but a slow GPU's peers
  are healthy.
- **Devices an incident names** (``named_devices``): every rank, TP group, link end and node
  (a location whose target is ``node``) of its locations. Elsewhere ``node`` only says where a
  rank lives.
- An incident **covers** a fault when it names a device the fault hits. An incident that names
  no device at all covers any fault only where the scorer says so (``unplaced_covers``): a
  raw-time baseline cannot localise, and the detection benchmark still credits it.
- An incident **detects** a fault (``detects``) when it covers it, opened within the fault's
  window — from ``before`` iterations before the onset (a dead rank's incident names the last
  iteration the detector saw, which may precede the onset) to ``after`` iterations past its end
  (``None``: no end) — and, where the scorer asks, is of the fault's category. The first such
  incident (by opening iteration) is *the* detecting incident; its delay is its opening minus the
  onset, never below 0.
- **Exact localisation** (``exact``): the detecting incident's final first location names the
  fault's device (compute, fail-stop, NIC); for a pipeline link its endpoints' TP groups hold the
  fault's two ends (either order: lock-step TP ranks report the same waits); for a node, its node
  or a device on it. ``grade`` says how precisely one location names a device fault: ``rank``,
  ``tp_group`` (the group holds it), ``node``, or None.
- A **false alarm** is an incident that detects no fault.

What each scorer picks: the detection benchmark scores by iteration with the category, a window of
one iteration before the onset to ``--grace`` after the end, and unplaced incidents covering; the
closed loop scores on the bus as events arrive, by simulated time from the onset, any category,
counting the first incident event (opened, confirmed, updated) that covers the fault, since a
probe's confirmation may be what first places an incident; the demo summary takes the first
incident of the category opened from three iterations before the onset and grades it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol

import numpy as np

from collector.events import FaultInjected, Location

Grade = Literal["rank", "tp_group", "node"]


class Opened(Protocol):
    """An incident as a scorer tracks it: when it opened, its category, where it is now."""

    @property
    def opened(self) -> int: ...
    @property
    def category(self) -> str: ...
    @property
    def locations(self) -> list: ...


def location_devices(loc: Location, gpus_per_node: int) -> set[int]:
    """Devices a location names: a rank, a TP group, a link's two ends, or a node's devices."""
    out: set[int] = set()
    if loc.rank is not None:
        out.add(loc.rank)
    if loc.tp_group:
        out.update(loc.tp_group)
    if loc.link is not None:
        out.update(loc.link)
    if loc.target == "node" and loc.node is not None:  # elsewhere ``node`` only says where a rank lives
        out.update(range(loc.node * gpus_per_node, (loc.node + 1) * gpus_per_node))
    return out


def fault_devices(loc: Location, gpus_per_node: int) -> set[int]:
    """The devices a fault at ``loc`` hits: not its TP group (the group's other GPUs are healthy)."""
    return location_devices(loc.model_copy(update={"tp_group": None}), gpus_per_node)


def named_devices(locations: Iterable[Location], gpus_per_node: int) -> set[int]:
    """Every device an incident's locations name."""
    out: set[int] = set()
    for loc in locations:
        out |= location_devices(loc, gpus_per_node)
    return out


def covers(hit: set[int], locations: Sequence[Location], gpus_per_node: int, *, unplaced_covers: bool) -> bool:
    """Whether an incident at ``locations`` covers a fault hitting ``hit``."""
    named = named_devices(locations, gpus_per_node)
    return bool(named & hit) or (unplaced_covers and not named)


def in_window(opened: int, start: int, end: int | None, *, before: int, after: int) -> bool:
    """``opened`` lies in [start - before, end + after); ``end`` None: the fault has no end."""
    return start - before <= opened and (end is None or opened < end + after)


def detects(fault: FaultInjected, incident: Opened, *, gpus_per_node: int, iterations: int, before: int,
            after: int, by_category: bool = True, unplaced_covers: bool = True) -> bool:
    """Whether ``incident`` detects ``fault`` (a ``FaultInjected``); a fault without an end lasts
    to ``iterations``."""
    if by_category and incident.category != fault.category.value:
        return False
    end = fault.end_iteration if fault.end_iteration is not None else iterations
    return (in_window(incident.opened, fault.start_iteration, end, before=before, after=after)
            and covers(fault_devices(fault.location, gpus_per_node), incident.locations, gpus_per_node,
                       unplaced_covers=unplaced_covers))


def detecting(fault: FaultInjected, incidents: Mapping[str, Opened], *, gpus_per_node: int, iterations: int,
              grace: int) -> list[tuple[int, str]]:
    """(opening iteration, incident id) of the incidents that detect ``fault`` in the detection
    benchmark's terms (its category, one iteration before the onset to ``grace`` after the end,
    unplaced incidents covering), first first."""
    return sorted((t.opened, iid) for iid, t in incidents.items()
                  if detects(fault, t, gpus_per_node=gpus_per_node, iterations=iterations, before=1, after=grace))


def exact(fault: FaultInjected, locations: list, gpus_per_node: int, tp_of: Mapping[int, tuple]) -> bool:
    """Whether ``locations`` (the detecting incident's latest) localise ``fault`` exactly;
    ``tp_of`` maps a device to its TP group in the plan the fault hit."""
    if not locations:
        return False
    loc, truth = locations[0], fault.location
    if truth.target == "node":
        return loc.node == truth.node or (loc.rank is not None and loc.rank // gpus_per_node == truth.node)
    if truth.target == "link" and truth.link is not None:
        if loc.link is None:
            return False
        a, b = loc.link
        ga, gb = set(tp_of.get(a, (a,))), set(tp_of.get(b, (b,)))
        x, y = truth.link
        return (x in ga and y in gb) or (y in ga and x in gb)
    return loc.rank is not None and loc.rank == truth.rank and (truth.target != "link" or loc.target == "link")


def grade(loc: Location, fault_location: Location) -> Grade | None:
    """How precisely ``loc`` names the device of a device fault at ``fault_location`` (None: it does not)."""
    device = fault_location.rank
    if loc.rank is not None and loc.rank == device:
        return "rank"
    if loc.tp_group and device in loc.tp_group:
        return "tp_group"
    if loc.target == "node" and loc.node is not None and loc.node == fault_location.node:
        return "node"
    return None


def score(results: list, grace: int = 5) -> dict[str, dict]:
    """Per detector over a suite: precision (incidents that detect some fault / incidents), recall
    (detected faults / faults), F1, exact localisation of detected faults, delay p50 / p95 in
    iterations (and the p95 of faults ×1.2 and slower apart), false alarms per 10,000 healthy
    iterations. ``results`` holds one (faults, incidents per detector, iterations, healthy
    iterations, cluster, tp_of) per run; ``cluster`` has ``gpus_per_node``."""
    per: dict[str, dict] = {}
    for faults, incidents, iterations, healthy, cluster, tp_of in results:
        per_node = cluster.gpus_per_node
        for name, incs in incidents.items():
            acc = per.setdefault(name, {"faults": 0, "detected": 0, "exact": 0, "incidents": 0, "matched": 0,
                                        "false": 0, "healthy_iterations": 0, "delays": [], "delays_big": []})
            acc["healthy_iterations"] += healthy
            acc["incidents"] += len(incs)
            matched: set[str] = set()
            for f in faults:
                acc["faults"] += 1
                hits = detecting(f, incs, gpus_per_node=per_node, iterations=iterations, grace=grace)
                matched |= {iid for _, iid in hits}
                if not hits:
                    continue
                first = incs[hits[0][1]]
                acc["detected"] += 1
                acc["exact"] += int(exact(f, first.locations, per_node, tp_of))
                delay = max(0, first.opened - f.start_iteration)
                acc["delays"].append(delay)
                if f.location.factor >= 1.2:
                    acc["delays_big"].append(delay)
            acc["matched"] += len(matched)
            acc["false"] += len(incs) - len(matched)
    out = {}
    for name, a in per.items():
        precision = a["matched"] / a["incidents"] if a["incidents"] else 1.0
        recall = a["detected"] / a["faults"] if a["faults"] else 1.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
        out[name] = {
            "precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4),
            "localisation": round(a["exact"] / a["detected"], 4) if a["detected"] else 0.0,
            "delay_p50_iters": pct(a["delays"], 50), "delay_p95_iters": pct(a["delays"], 95),
            "delay_p95_iters_x1_2_plus": pct(a["delays_big"], 95),
            "false_alarms_per_10k": round(1e4 * a["false"] / max(a["healthy_iterations"], 1), 2),
            "faults": a["faults"], "detected": a["detected"], "incidents": a["incidents"],
        }
    return out


__all__ = ["Grade", "location_devices", "fault_devices", "named_devices", "covers", "in_window", "detects",
           "detecting", "exact", "grade", "score"]
