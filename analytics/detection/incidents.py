"""The incident lifecycle: opened → confirmed → updated → resolved, as events.

One incident per location (a rank's compute, a link, a dead rank), keyed by ``IncidentKey``
(analytics/detection/incident_keys.py). Ids are derived from the job, the location and the opening
iteration, so replaying a log (or restarting from a snapshot) yields the same ids and consumers
dedupe them. The book keeps the lifecycle; its probe half, ``IncidentProbes``
(analytics/detection/incident_probes.py), asks each incident's probes and judges their answers.

Confirmation: by probe (if enabled: the suspects run a short fixed workload and report it against
a healthy reference), by persistence (still slow ``confirm_iterations`` later), or by heartbeat
(fail-stop). Resolution: ``resolve_iterations`` healthy iterations in a row, the plan moving off
the location, or a dead rank coming back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import median

from analytics.detection.calibration import HEARTBEAT, HIDDEN_STOP
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import LivenessChange
from analytics.detection.incident_keys import COMM_KEY, DEAD_HIDDEN_KEY, IncidentKey, KeyKind
from analytics.detection.incident_probes import IncidentProbes
from analytics.detection.open_incident import DEAD_FACTOR, OpenIncident, Suspect, incident_id, severity_of
from collector.events import (
    ConfirmMethod, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated, Payload,
    ProbeRequest, ProbeResult, Severity,
)


@dataclass
class IncidentBook:
    """``job``'s open incidents, one per key, and the events of their lifecycle. The probes they
    ask are ``probes``' to judge (analytics/detection/incident_probes.py)."""

    job: str
    config: DetectorConfig
    open: dict[IncidentKey, OpenIncident] = field(default_factory=dict)
    opened_total: int = 0
    probes: IncidentProbes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.probes = IncidentProbes(self)

    # ---- views ----------------------------------------------------------------------------------

    def suspect_ranks(self) -> set[int]:
        return self.open_compute_ranks() | {k.ranks[0] for k in self.open if k.kind is KeyKind.DEAD}

    def open_compute_ranks(self) -> set[int]:
        return {r for k in self.open if k.kind is KeyKind.RANKS for r in k.ranks}

    def names(self, rank: int) -> bool:
        """Whether an open incident is about ``rank``: its own, its TP group's, or one that a
        probe named it in (time lost on untraced ranks stays a job-level incident)."""
        return rank in self.suspect_ranks() or any(inc.suspect.rank == rank for inc in self.open.values())

    def open_rank_keys(self) -> list[IncidentKey]:
        return [k for k in self.open if k.kind is KeyKind.RANKS]

    def open_links(self) -> set[IncidentKey]:
        return {k for k in self.open if k.kind is KeyKind.LINK}

    def slow_factors(self) -> dict[int, float]:
        return {r: inc.factor for k, inc in self.open.items() if k.kind is KeyKind.RANKS for r in inc.suspect.ranks}

    # ---- fail-slow ------------------------------------------------------------------------------

    def incident_id(self, key: IncidentKey, iteration: int) -> str:
        return incident_id(self.job, key, iteration)

    def add(self, inc: OpenIncident) -> None:
        """Hold a newly opened incident under its suspect's key."""
        self.open[inc.suspect.key] = inc
        self.opened_total += 1

    def dead_ranks(self) -> set[int]:
        return {key.ranks[0] for key in self.open if key.kind is KeyKind.DEAD}

    def big_enough(self, factor: float) -> bool:
        """Whether a fail-slow of this size may open or be confirmed: above the detector's smallest
        incident (``min_incident_factor``, ×1.03), and a number."""
        return factor > self.config.min_incident_factor

    def open_fail_slow(self, s: Suspect, iteration: int) -> list[Payload]:
        """Open a fail-slow incident for ``s``, unless its size is under the smallest incident.

        At or under ``min_incident_factor`` (or not a number) a size is within what a healthy
        device or link reads, whatever a statistic summed on the way there: such a suspect opens
        nothing (a ×1.03 link on fused timers never pages). This is the one place the rule lives,
        for ranks, links, communication and probes' finds alike."""
        if not self.big_enough(s.factor):
            return []
        inc = OpenIncident(self.incident_id(s.key, iteration), FaultCategory.FAIL_SLOW, s, iteration, s.factor,
                           s.factor, p_real=s.p_real(), last_update_iteration=iteration)
        self.add(inc)
        if s.target == "link":
            where = f"link {s.link[0]}->{s.link[1]}" if s.link else "communication"
        else:
            where = (f"rank {s.rank}" if s.rank is not None else f"TP group {list(s.ranks)}" if s.tp_group
                     else f"one of ranks {list(s.ranks)}")
        out: list[Payload] = [IncidentOpened(
            incident_id=inc.incident_id, category=inc.category, severity=severity_of(s.factor),
            iteration=iteration, locations=[s.location()], evidence=s.evidence(), p_real=inc.p_real,
            summary=f"{where} is ×{s.factor:.2f} slower than its work predicts"
                    + (f" (replica {s.replica}, stage {s.stage})" if s.replica is not None else ""))]
        if self.config.probes:
            out.append(self.probes.ask_naming(inc, iteration))
        return out

    def open_unseen(self, s: Suspect, iteration: int) -> list[Payload]:
        """A slow rank no telemetry sees (nobody traces it), found by a probe: opened as any
        fail-slow, then health-probed as a rank the plan left out is, since nothing else will
        ever see it healthy and resolve it."""
        out = self.open_fail_slow(s, iteration)
        inc = self.open.get(s.key)
        if out and inc is not None:
            inc.left_out(iteration)
            inc.unseen = True
        return out

    def observe(self, key: IncidentKey, z: float, k: float, iteration: int, factor: float,
                sample: float | None = None) -> list[Payload]:
        """One more iteration of an open incident's location: update, or count toward resolution.
        ``sample``: this iteration's own size for the refinements (default exp(z), the location's
        slowdown; a location sized another way, as an untraced replica's stage, passes its own)."""
        inc = self.open.get(key)
        if inc is None:
            return []
        if z < k:
            inc.healthy_streak += 1
            if inc.healthy_streak >= self.config.resolve_iterations:
                del self.open[key]
                return [IncidentResolved(incident_id=inc.incident_id, iteration=iteration,
                                         reason=f"back within ×{self.config.min_slowdown:g} of prediction for "
                                                f"{inc.healthy_streak} iterations")]
            return []
        inc.healthy_streak = 0
        if inc.probe_sized:
            return []  # telemetry sees the iteration's excess, not the link's own slowdown
        inc.factor = factor
        if inc.refined < len(self.config.refine_iterations):  # the evidence a refinement still to come needs
            inc.slow_factors.append(math.exp(z) if sample is None else sample)
        change = abs(factor / inc.published_factor - 1.0)
        if change > self.config.update_min_change and iteration - inc.last_update_iteration >= 3:
            worse = factor > inc.published_factor
            inc.published_factor, inc.last_update_iteration = factor, iteration
            inc.slow_factors, inc.refined = [], 0  # a new size: refine it again on its own iterations
            s = inc.suspect
            update = IncidentUpdated(incident_id=inc.incident_id, iteration=iteration,
                                     severity=severity_of(factor),
                                     locations=[s.location(factor)], evidence=s.evidence(), p_real=inc.p_real)
            if not (worse and self.probes.can_reprobe(inc)):
                return [update]
            return self.probes.reprobe(inc, update, iteration)
        return self._refine(inc, iteration)

    def _refine(self, inc: OpenIncident, iteration: int) -> list[Payload]:
        """Publish the size again, as the median of the first n slow iterations for each n of
        ``refine_iterations`` (8, 32, then 128), when it differs from the published one by more than
        ``refine_min_change``.

        Why: an incident is sized when it opens, on the last 3 iterations, and one of them may
        predate the onset; their median is then the lower of two slow samples (a ×2 GPU read as
        ×1.85 in chunk time where it is ×1.90). Updates otherwise need a 10 % move, so that first
        figure would stay for the incident's life, and the planner's gains follow from it: a ×2
        GPU at 1,024 GPUs whose rebalance gains 2.6 % was read ×1.96 and its plan, 2.0 %, fell
        under the engine's 2 % minimum. 8 iterations correct the opening's window soon. Where one
        iteration is noisy to ~1.5 % (1,024 GPUs) the median of 32 is good to ~0.4 % (σ; 1 % at
        worst), which still left that GPU unplanned through the bus; 128 are good to ~0.2 %. Then
        no more: a size that keeps drifting is the 10 % rule's job."""
        points = self.config.refine_iterations
        if inc.refined >= len(points) or len(inc.slow_factors) < points[inc.refined]:
            return []
        n = points[inc.refined]
        inc.refined += 1
        refined = median(inc.slow_factors[:n])
        if abs(refined / inc.published_factor - 1.0) <= self.config.refine_min_change:
            return []
        before = inc.published_factor
        inc.factor = inc.published_factor = refined
        inc.last_update_iteration = iteration
        s = inc.suspect
        return [IncidentUpdated(incident_id=inc.incident_id, iteration=iteration,
                                severity=severity_of(refined), locations=[s.location(refined)], p_real=inc.p_real,
                                evidence=s.evidence().model_copy(update={
                                    "statistic": f"sized again on {n} slow iterations: ×{refined:.3f} "
                                                 f"(was ×{before:.3f})"}))]

    def place_communication(self, link: tuple[int, int], factor: float, iteration: int) -> list[Payload]:
        """An open communication incident that names no place yet (opened on the iteration's excess
        while the links' timers held waits) takes the link that link scoring has since found slow,
        at that link's size, rather than a second incident opening for the same fault. Telemetry's
        excess no longer moves its size (as after a probe's naming): it is the iteration's, not the
        link's. Nothing when there is no such incident."""
        inc = self.open.get(COMM_KEY)
        if (inc is None or inc.suspect.link is not None or inc.suspect.rank is not None
                or not self.big_enough(factor)):
            return []
        s = inc.suspect
        s.link = link
        inc.factor = inc.published_factor = factor
        inc.probe_sized, inc.last_update_iteration = True, iteration
        return [IncidentUpdated(incident_id=inc.incident_id, iteration=iteration, severity=severity_of(factor),
                                locations=[s.location(factor)], p_real=inc.p_real, evidence=s.evidence().model_copy(update={
                                    "statistic": f"link {link[0]}->{link[1]} scored ×{factor:.2f} on its own timers"}))]

    def end_of_iteration(self, iteration: int) -> list[Payload]:
        out: list[Payload] = []
        for inc in self.open.values():
            if (not inc.confirmed and inc.category is FaultCategory.FAIL_SLOW and inc.healthy_streak == 0
                    and inc.excluded_since is None and self.big_enough(inc.factor)
                    and iteration >= inc.opened_iteration + self.config.confirm_iterations):
                inc.confirmed = True
                inc.published_factor = inc.factor
                out.append(IncidentConfirmed(
                    incident_id=inc.incident_id, method="persistence",
                    detail=f"still ×{inc.factor:.2f} after {iteration - inc.opened_iteration} iterations",
                    locations=[inc.suspect.location(inc.factor)], p_real=inc.p_real))
            out += self.probes.health_probe(inc, iteration)
        return out

    def probe_result(self, p: ProbeResult) -> list[Payload]:
        """A probe's answer (``IncidentProbes.result``)."""
        return self.probes.result(p)

    # ---- fail-stop and reconfiguration -----------------------------------------------------------

    def fail_stop(self, changes: list[LivenessChange]) -> list[Payload]:
        """Open (and confirm) a fail-stop per rank that died; resolve it when the rank is back. The
        iteration is the change's own (from the rank's stream), so delivery order cannot move it."""
        out: list[Payload] = []
        for ch in changes:
            iteration = ch.iteration
            key = IncidentKey.of_dead(ch.rank)
            if not ch.alive and key not in self.open:
                # A dead rank never answers: judge its pending probes on the answers in first, so
                # a slow peer it answered alongside is named before a group incident is superseded.
                out += self.probes.left_to_the_dead(also=ch.rank)
                slow_key = next((k for k in self.open if k.kind is KeyKind.RANKS and ch.rank in k.ranks), None)
                slow = self.open.pop(slow_key) if slow_key else None
                if slow is not None:
                    out.append(IncidentResolved(incident_id=slow.incident_id, iteration=iteration,
                                                reason="superseded: the rank stopped (fail-stop incident)"))
                s = Suspect(key=key, target="compute", rank=ch.rank, link=None, node=None, replica=None, stage=None,
                            tp_group=None, factor=DEAD_FACTOR, place_confidence=1.0, iterations=[iteration],
                            observed_s=[], predicted_s=[], rank_factors={ch.rank: DEAD_FACTOR},
                            statistic="heartbeat and telemetry liveness", note=ch.reason, basis=HEARTBEAT,
                            margin=1.0)
                inc = OpenIncident(self.incident_id(key, iteration), FaultCategory.FAIL_STOP, s, iteration,
                                   DEAD_FACTOR, DEAD_FACTOR, p_real=s.p_real(), confirmed=True)
                self.add(inc)
                out.append(IncidentOpened(incident_id=inc.incident_id, category=inc.category,
                                          severity=Severity.CRITICAL, iteration=iteration, locations=[s.location()],
                                          evidence=s.evidence(), summary=f"rank {ch.rank} stopped: {ch.reason}",
                                          p_real=inc.p_real))
                method: ConfirmMethod = "heartbeat" if "heartbeat" in ch.reason else "persistence"
                out.append(IncidentConfirmed(incident_id=inc.incident_id, method=method, detail=ch.reason,
                                             locations=[s.location()], p_real=inc.p_real))
            elif ch.alive and key in self.open:
                inc = self.open.pop(key)
                out.append(IncidentResolved(incident_id=inc.incident_id, iteration=iteration, reason=ch.reason))
        return out

    def hidden_fail_stop(self, ranks: tuple[int, ...], iteration: int, reason: str,
                         probe_id: str | None) -> list[Payload]:
        """Open (and confirm) one fail-stop on ranks nobody traces, as a group: the job hangs while
        every watched rank lives on (analytics/detection/hidden_stop.py). With ``probe_id``, ask them for a
        liveness probe; ``hidden_named`` then narrows the group to the ranks that stayed silent."""
        key = DEAD_HIDDEN_KEY
        if key in self.open:
            return []
        one = ranks[0] if len(ranks) == 1 else None
        s = Suspect(key=key, target="compute", rank=one, link=None, node=None, replica=None, stage=None,
                    tp_group=None if one is not None else ranks, factor=DEAD_FACTOR,
                    place_confidence=round(1.0 / len(ranks), 4), iterations=[iteration], observed_s=[],
                    predicted_s=[], rank_factors={}, statistic="job stalled while every traced rank heartbeats",
                    note=reason, ranks=ranks, basis=HIDDEN_STOP, margin=1.0)
        inc = OpenIncident(self.incident_id(key, iteration), FaultCategory.FAIL_STOP, s, iteration, DEAD_FACTOR,
                           DEAD_FACTOR, p_real=s.p_real(), confirmed=True)
        self.add(inc)
        where = f"rank {one}" if one is not None else f"one of the {len(ranks)} untraced ranks {list(ranks)}"
        out: list[Payload] = [
            IncidentOpened(incident_id=inc.incident_id, category=inc.category, severity=Severity.CRITICAL,
                           iteration=iteration, locations=[s.location()], evidence=s.evidence(),
                           summary=f"{where} stopped: {reason}", p_real=inc.p_real),
            IncidentConfirmed(incident_id=inc.incident_id, method="persistence", detail=reason,
                              locations=[s.location()], p_real=inc.p_real)]
        if probe_id is not None:
            out.append(ProbeRequest(probe_id=probe_id, incident_id=inc.incident_id, ranks=list(ranks), repeats=1))
        return out

    def hidden_named(self, silent: tuple[int, ...], detail: str) -> list[Payload]:
        """The liveness probe's verdict: the ranks in ``silent`` never answered. A single one takes
        over the group's incident as its own fail-stop (so a new plan without it resolves it, and
        heartbeats, should it send any, revive it); several narrow the group."""
        inc = self.open.pop(DEAD_HIDDEN_KEY, None)
        if inc is None:
            return []
        one = silent[0] if len(silent) == 1 else None
        inc.suspect = replace(inc.suspect, key=IncidentKey.of_dead(one) if one is not None else DEAD_HIDDEN_KEY, rank=one,
                              tp_group=None if one is not None else silent, ranks=silent,
                              place_confidence=1.0 if one is not None else round(1.0 / len(silent), 4),
                              rank_factors={r: DEAD_FACTOR for r in silent})
        self.open[inc.suspect.key] = inc
        return [IncidentConfirmed(incident_id=inc.incident_id, method="probe", detail=detail,
                                  locations=[inc.suspect.location()], p_real=inc.p_real)]

    def hidden_cleared(self, iteration: int, reason: str) -> list[Payload]:
        """The job moved on: the group suspected of a hidden stop held nobody up."""
        inc = self.open.pop(DEAD_HIDDEN_KEY, None)
        return [] if inc is None else [IncidentResolved(incident_id=inc.incident_id, iteration=iteration, reason=reason)]

    def reconfigured(self, present: set[int], iteration: int) -> list[Payload]:
        """A new plan: a fail-stop on a rank it no longer uses is resolved (the remediation keeps the
        device as dead until a plan uses it again). A fail-slow on a rank or link it no longer
        uses stays open: nothing measured the device healthy, so resolving it would tell the
        planner the device is fine and invite it back, slow, into the next plan. A left-out slow
        rank is probed now and then instead, and resolved when the probe finds it healthy."""
        out: list[Payload] = []
        for key in list(self.open):
            if key.kind is KeyKind.DEAD and key.ranks[0] not in present:  # fail-slow (ranks, links, comm) stays open
                inc = self.open.pop(key)
                out.append(IncidentResolved(incident_id=inc.incident_id, iteration=iteration,
                                            reason="the new plan no longer uses this location"))
            elif key.kind is KeyKind.RANKS:  # left out, a slow rank is health-probed now and then (end_of_iteration)
                inc = self.open[key]
                out_of_plan = not set(inc.suspect.ranks) & present
                if out_of_plan and inc.excluded_since is None:
                    inc.left_out(iteration)
                elif not out_of_plan and not inc.unseen:  # a rank nobody traces stays probed, kept or not
                    inc.excluded_since = None
        return out
