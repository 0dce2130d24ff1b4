"""The incident lifecycle: opened → confirmed → updated → resolved, as events.

One incident per location (a rank's compute, a link, a dead rank), keyed by ``IncidentKey``
(analytics/detection/incident_keys.py). Ids are derived from the job, the location and the opening
iteration, so replaying a log (or restarting from a snapshot) yields the same ids and consumers
dedupe them. Which probe an incident has asked (naming, links, re-probe of its TP group, health)
is its ``ProbeKind``: its answers are judged as that probe's.

Confirmation: by probe (if enabled: the suspects run a short fixed workload and report it against
a healthy reference), by persistence (still slow ``confirm_iterations`` later), or by heartbeat
(fail-stop). Resolution: ``resolve_iterations`` healthy iterations in a row, the plan moving off
the location, or a dead rank coming back.
"""

from __future__ import annotations

import math
import uuid
from statistics import median
from dataclasses import dataclass, field, replace
from typing import Literal

from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import LivenessChange
from analytics.detection.incident_keys import (
    COMM_KEY, DEAD_HIDDEN_KEY, UNTRACED_KEY, IncidentKey, KeyKind, ProbeKind,
)
from collector.events import (
    ConfirmMethod, Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated,
    Location, LocationTarget, Payload, ProbeRequest, ProbeResult, Severity,
)

_NS = uuid.UUID("0c5a7f0e-9b1d-4b8e-8f2a-5d3c1e7a9b40")
DEAD_FACTOR = 1e6


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
    confidence: float
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

    def location(self, factor: float | None = None) -> Location:
        return Location(target=self.target, rank=self.rank, link=self.link, node=self.node, replica=self.replica,
                        stage=self.stage, tp_group=self.tp_group, factor=max(factor or self.factor, 1e-6),
                        confidence=self.confidence, measure=self.measure)

    def evidence(self) -> Evidence:
        return Evidence(iterations=self.iterations, observed_s=self.observed_s, predicted_s=self.predicted_s,
                        rank_factors=self.rank_factors, statistic=self.statistic, note=self.note)


@dataclass
class _Open:
    incident_id: str
    category: FaultCategory
    suspect: Suspect
    opened_iteration: int
    factor: float
    published_factor: float  # the size consumers hold: the last one an opening, confirmation or update carried
    confirmed: bool = False
    healthy_streak: int = 0
    last_update_iteration: int = -1
    probe_id: str | None = None
    probe_ratios: dict[int, float] = field(default_factory=dict)
    probe_used: bool = False  # a probe's answers already named (or confirmed) the suspect: it is not asked to again
    probe_sized: bool = False  # a probe measured the location itself: its factor is the probe's
    probe: ProbeKind = ProbeKind.NAMING  # which probe is pending (or was asked last)
    probe_asked_iteration: int | None = None  # when the pending probe was asked (None: none pending)
    # A fail-slow rank the running plan leaves out sends no telemetry: only a probe can see it heal.
    # The iteration from which no telemetry sees it (the plan left it out, or nobody traces it and a
    # sweep probe found it): it is health-probed now and then instead (None: telemetry judges it).
    excluded_since: int | None = None
    unseen: bool = False  # found by a sweep of ranks nobody traces: health-probed in any plan
    health_asked_iteration: int | None = None  # when the last health probe was asked
    health_probes: int = 0  # asked since it was left out: each one doubles the wait for the next
    # The size as telemetry measures it, one factor per slow iteration since the opening (or the
    # last update that moved it by more than update_min_change): the refinement's evidence.
    slow_factors: list[float] = field(default_factory=list)
    refined: int = 0  # how many of the config's refine_iterations points the size was estimated again at


def severity_of(factor: float, category: FaultCategory) -> Severity:
    if category is FaultCategory.FAIL_STOP:
        return Severity.CRITICAL
    if factor < 1.1:
        return Severity.LOW
    if factor < 1.5:
        return Severity.MEDIUM
    return Severity.HIGH if factor < 3.0 else Severity.CRITICAL


@dataclass
class IncidentBook:
    job: str
    config: DetectorConfig
    open: dict[IncidentKey, _Open] = field(default_factory=dict)
    opened_total: int = 0

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

    def _id(self, key: IncidentKey, iteration: int) -> str:
        return "inc-" + uuid.uuid5(_NS, f"{self.job}/{key}/{iteration}").hex[:16]

    def open_fail_slow(self, s: Suspect, iteration: int) -> list[Payload]:
        """Open a fail-slow incident for ``s``, unless its size says it is not slow at all.

        A factor of 1 or less (or not a number) is no slowdown, whatever a statistic summed on the way
        there: such a suspect opens nothing. This is the one place the rule lives, for ranks, links
        and communication alike."""
        if not (s.factor > 1.0):
            return []
        inc = _Open(self._id(s.key, iteration), FaultCategory.FAIL_SLOW, s, iteration, s.factor, s.factor,
                    last_update_iteration=iteration)
        self.open[s.key] = inc
        self.opened_total += 1
        if s.target == "link":
            where = f"link {s.link[0]}->{s.link[1]}" if s.link else "communication"
        else:
            where = (f"rank {s.rank}" if s.rank is not None else f"TP group {list(s.ranks)}" if s.tp_group
                     else f"one of ranks {list(s.ranks)}")
        out: list[Payload] = [IncidentOpened(
            incident_id=inc.incident_id, category=inc.category, severity=severity_of(s.factor, inc.category),
            iteration=iteration, locations=[s.location()], evidence=s.evidence(),
            summary=f"{where} is ×{s.factor:.2f} slower than its work predicts"
                    + (f" (replica {s.replica}, stage {s.stage})" if s.replica is not None else ""))]
        if self.config.probes:
            inc.probe_id, inc.probe_asked_iteration = "probe-" + inc.incident_id[4:], iteration
            ranks = list(s.ranks) or list(s.link or ())
            out.append(ProbeRequest(probe_id=inc.probe_id, incident_id=inc.incident_id, ranks=ranks,
                                    target="compute" if s.target == "compute" else "link"))
        return out

    def open_unseen(self, s: Suspect, iteration: int) -> list[Payload]:
        """A slow rank no telemetry sees (nobody traces it), found by a probe: opened as any
        fail-slow, then health-probed as a rank the plan left out is, since nothing else will
        ever see it healthy and resolve it."""
        out = self.open_fail_slow(s, iteration)
        inc = self.open.get(s.key)
        if out and inc is not None:
            inc.excluded_since, inc.health_asked_iteration, inc.health_probes = iteration, None, 0
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
                                     severity=severity_of(factor, inc.category),
                                     locations=[s.location(factor)], evidence=s.evidence())
            if not (worse and self._can_reprobe(inc)):
                return [update]
            # Its TP peers run in lock-step with it and are never alarmed on while it is open, so a
            # peer that slows down too only shows up here, as the named rank getting worse. The
            # update says the group is being probed: a planner should wait for the answer.
            inc.probe_id, inc.probe_ratios, inc.probe = f"probe-{inc.incident_id[4:]}-{iteration}", {}, ProbeKind.REPROBE
            inc.probe_asked_iteration = iteration
            group = list(s.tp_group or ())
            return [update.model_copy(update={"probing": group}),
                    ProbeRequest(probe_id=inc.probe_id, incident_id=inc.incident_id, ranks=group, target="compute")]
        return self._refine(inc, iteration)

    def _refine(self, inc: _Open, iteration: int) -> list[Payload]:
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
                                severity=severity_of(refined, inc.category), locations=[s.location(refined)],
                                evidence=s.evidence().model_copy(update={
                                    "statistic": f"sized again on {n} slow iterations: ×{refined:.3f} "
                                                 f"(was ×{before:.3f})"}))]

    def _can_reprobe(self, inc: _Open) -> bool:
        s = inc.suspect
        return (self.config.probes and s.target == "compute" and s.key.kind is KeyKind.RANKS and inc.probe_used
                and inc.probe is not ProbeKind.REPROBE
                and len(s.ranks) == 1 and len(s.tp_group or ()) > 1)

    def place_communication(self, link: tuple[int, int], factor: float, iteration: int) -> list[Payload]:
        """An open communication incident that names no place yet (opened on the iteration's excess
        while the links' timers held waits) takes the link that link scoring has since found slow,
        at that link's size, rather than a second incident opening for the same fault. Telemetry's
        excess no longer moves its size (as after a probe's naming): it is the iteration's, not the
        link's. Nothing when there is no such incident."""
        inc = self.open.get(COMM_KEY)
        if inc is None or inc.suspect.link is not None or inc.suspect.rank is not None or not factor > 1.0:
            return []
        s = inc.suspect
        s.link = link
        inc.factor = inc.published_factor = factor
        inc.probe_sized, inc.last_update_iteration = True, iteration
        return [IncidentUpdated(incident_id=inc.incident_id, iteration=iteration, severity=severity_of(factor, inc.category),
                                locations=[s.location(factor)], evidence=s.evidence().model_copy(update={
                                    "statistic": f"link {link[0]}->{link[1]} scored ×{factor:.2f} on its own timers"}))]

    def end_of_iteration(self, iteration: int) -> list[Payload]:
        out: list[Payload] = []
        for inc in self.open.values():
            if (not inc.confirmed and inc.category is FaultCategory.FAIL_SLOW and inc.healthy_streak == 0
                    and inc.excluded_since is None
                    and iteration >= inc.opened_iteration + self.config.confirm_iterations):
                inc.confirmed = True
                inc.published_factor = inc.factor
                out.append(IncidentConfirmed(
                    incident_id=inc.incident_id, method="persistence",
                    detail=f"still ×{inc.factor:.2f} after {iteration - inc.opened_iteration} iterations",
                    locations=[inc.suspect.location(inc.factor)]))
            out += self._health_probe(inc, iteration)
        return out

    def _health_probe(self, inc: _Open, iteration: int) -> list[Payload]:
        """Ask an excluded slow rank for a probe ``excluded_probe_iterations`` after it was left
        out, then after twice that, four times, ...: a GPU that throttled and recovered is
        otherwise never seen healthy (it sends no telemetry), its incident never resolves, and the
        planner never takes it back. The wait doubles because a probe pauses the job while it
        runs (every rank runs it at the same boundary) and a device slow for long is ever less
        likely to have just recovered: over a 30-minute run at 0.26 s an iteration that is 5
        probes, not 60."""
        first = self.config.excluded_probe_iterations
        if (not (self.config.probes and first) or inc.excluded_since is None
                or inc.probe_asked_iteration is not None or not inc.suspect.ranks):
            return []
        last = inc.health_asked_iteration if inc.health_asked_iteration is not None else inc.excluded_since
        if iteration - last < first * 2 ** inc.health_probes:
            return []
        inc.probe_id, inc.probe_ratios, inc.probe = f"probe-{inc.incident_id[4:]}-health-{iteration}", {}, ProbeKind.HEALTH
        inc.probe_asked_iteration = inc.health_asked_iteration = iteration
        inc.health_probes += 1
        return [ProbeRequest(probe_id=inc.probe_id, incident_id=inc.incident_id, ranks=list(inc.suspect.ranks),
                             target="compute")]

    @staticmethod
    def _asked(inc: _Open) -> tuple[int, ...]:
        if inc.probe is ProbeKind.LINKS:
            return inc.suspect.link_probe_ranks
        if inc.probe is ProbeKind.REPROBE:
            return inc.suspect.tp_group or ()
        return inc.suspect.ranks or tuple(inc.suspect.link or ())

    def probe_result(self, p: ProbeResult) -> list[Payload]:
        """Collect a probe's answers; once every asked rank that is alive answered, confirm on the
        slowest one (and name it, when telemetry could only point at its TP group)."""
        for inc in self.open.values():
            if inc.probe_id != p.probe_id:
                continue
            inc.probe_ratios[p.rank] = p.duration_s / p.reference_s
            if self._awaited(inc) - self._dead():
                return []
            return self._conclude_probe(inc)
        return []

    def _dead(self) -> set[int]:
        return {key.ranks[0] for key in self.open if key.kind is KeyKind.DEAD}

    def _awaited(self, inc: _Open) -> set[int]:
        """The asked ranks whose answer has not come."""
        return set(self._asked(inc)) - set(inc.probe_ratios)

    def _probes_left_to_the_dead(self, also: int) -> list[Payload]:
        """Conclude every pending probe whose missing answers are all from ranks now dead: a dead
        rank never answers. Nothing else concludes a probe early. In particular not a count of
        iterations: an analytics consumer catching up reads telemetry far ahead of the answers,
        which travel on the control topic, and would give up on answers already published."""
        dead, out = self._dead() | {also}, []
        for inc in list(self.open.values()):
            if inc.probe_asked_iteration is not None and (awaited := self._awaited(inc)) and awaited <= dead:
                out += self._conclude_probe(inc)
        return out

    def _conclude_probe(self, inc: _Open) -> list[Payload]:
        """Judge a probe on the answers it has: all of them, or all but those of ranks now dead."""
        if inc.probe_asked_iteration is None:
            return []  # concluded already: a repeated answer changes nothing
        asked_iteration, inc.probe_asked_iteration = inc.probe_asked_iteration, None
        asked = self._asked(inc)
        if inc.probe is ProbeKind.HEALTH:
            return self._health_result(inc, asked_iteration)
        if inc.probe is ProbeKind.REPROBE:
            return self._reprobe_result(inc, missing=sorted(set(asked) - set(inc.probe_ratios)))
        if not inc.probe_ratios:
            return []
        worst = max(inc.probe_ratios, key=lambda rank: inc.probe_ratios[rank])
        ratio = inc.probe_ratios[worst]
        s = inc.suspect
        bar = self.probe_bar(inc.probe_ratios)
        if ratio < bar and s.link_probe_ranks and inc.probe is not ProbeKind.LINKS:
            # nobody it named computes slow: the time went to a link or a NIC; ask every rank's links
            inc.probe, inc.probe_ratios = ProbeKind.LINKS, {}
            inc.probe_id, inc.probe_asked_iteration = f"probe-{inc.incident_id[4:]}-links", asked_iteration
            return [ProbeRequest(probe_id=inc.probe_id, incident_id=inc.incident_id, ranks=list(s.link_probe_ranks),
                                 target="link")]
        if ratio < bar or inc.probe_used:
            return []
        inc.probe_used = True
        if inc.probe is ProbeKind.LINKS:  # the links' probe found the slow one: the incident is about that link or NIC
            s.target, s.tp_group, s.ranks = "link", None, ()
        # Persistence may have confirmed the incident while the probe ran (telemetry and the
        # answers travel on different topics): the answers still name the member, as an update.
        already = inc.confirmed
        inc.confirmed = True
        if s.target == "compute" and s.rank is None:
            s.rank, s.ranks = worst, (worst,)
            s.confidence = min(0.99, s.confidence * len(asked))
            if s.key == UNTRACED_KEY and worst in s.rank_factors:
                # sized through the schedule for the named rank's own stage (analytics/detection/untraced.py),
                # no longer as the median stage
                inc.factor = s.rank_factors[worst]
            # The incident is now about the member alone: its healthy peers stop being suspects
            # (left out of fits, never alarmed on), or a later fault on one of them, in a
            # layout that keeps them, would go unseen for as long as this incident is open.
            named = IncidentKey.of_ranks((worst,))
            if s.key.kind is KeyKind.RANKS and named not in self.open:  # an untraced one stays job-level
                self.open[named] = self.open.pop(s.key)
                s.key = named
        elif s.target == "link":
            slow = sorted((r for r, v in inc.probe_ratios.items() if v >= self.config.probe_confirm_ratio),
                          key=lambda r: -inc.probe_ratios[r])
            if len(slow) >= 2 and abs(inc.probe_ratios[slow[1]] / ratio - 1) < 0.25:
                s.link, s.rank = (slow[0], slow[1]), None  # both ends of one slow link
            else:
                s.link, s.rank = None, worst  # one device's NIC
            s.confidence = 0.9
            # Telemetry measured how much the iteration lost; the planner needs how slow the
            # link is (it costs every transfer over it), which is what the probe timed.
            inc.factor = max(ratio, inc.factor)
            inc.probe_sized = True
        inc.published_factor = inc.factor  # what the naming below publishes: the size consumers now hold
        ratios = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(inc.probe_ratios.items()))
        if missing := sorted(set(asked) - set(inc.probe_ratios)):
            ratios += f"; no answer from {missing}: stopped"
        if already:
            return [IncidentUpdated(incident_id=inc.incident_id, iteration=inc.last_update_iteration,
                                    severity=severity_of(inc.factor, inc.category),
                                    locations=[s.location(inc.factor)],
                                    evidence=s.evidence().model_copy(update={
                                        "statistic": f"probe: rank {worst} took ×{ratio:.2f} ({ratios})"}))]
        return [IncidentConfirmed(
            incident_id=inc.incident_id, method="probe",
            detail=f"probe: rank {worst} took ×{ratio:.2f} of the healthy reference ({ratios})",
            locations=[s.location(inc.factor)])]

    def probe_bar(self, ratios: dict[int, float]) -> float:
        """The probe ratio that names a rank slow: ``probe_confirm_ratio``, and with three or more
        answers also four robust σ above their median. Why: a probe is noisy too (a few per cent per
        answer in the simulator), and the worst of sixteen healthy answers (an untraced replica's
        ranks, asked together) passed 1.03 by chance and named a healthy rank."""
        bar = self.config.probe_confirm_ratio
        if len(ratios) < 3:
            return bar
        logs = [math.log(max(v, 1e-12)) for v in ratios.values()]
        centre = median(logs)
        spread = 1.4826 * median(abs(x - centre) for x in logs)
        return max(bar, math.exp(centre + 4.0 * spread))

    def _health_result(self, inc: _Open, iteration: int) -> list[Payload]:
        """An excluded rank's health probe: resolved when every asked rank answered below the
        ratio that confirms a slowdown; otherwise it stays open, to be probed again."""
        inc.probe = ProbeKind.NAMING
        ratios, asked = inc.probe_ratios, self._asked(inc)
        if set(ratios) != set(asked) or max(ratios.values()) >= self.config.probe_confirm_ratio:
            return []
        key = next(k for k, v in self.open.items() if v is inc)
        del self.open[key]
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        return [IncidentResolved(incident_id=inc.incident_id, iteration=iteration,
                                 reason=f"probed healthy while the plan left it out ({table})")]

    def _reprobe_result(self, inc: _Open, missing: list[int]) -> list[Payload]:
        """A named rank's TP group answered a re-probe. If other members are slow too, each gets
        an incident of its own (opened and confirmed by the probe), and every slow member's factor
        becomes its share of the group's: telemetry measures the group's chunks, which the slowest
        member sets, so a member ×r in compute (by the probe) is 1 + (r − 1)·(F − 1)/(r_max − 1)
        in chunk time, F being the group's. Those factors are the probe's from then on (telemetry
        would give every member the group's). The named rank's incident is always updated, last:
        that update (``probing`` empty) is the answer a planner waits for, so every peer's
        incident is already on the log when it comes."""
        inc.probe = ProbeKind.NAMING
        ratios, s = inc.probe_ratios, inc.suspect
        slow = sorted((r for r, v in ratios.items() if v >= self.config.probe_confirm_ratio), key=lambda r: -ratios[r])
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        statistic = f"re-probe of TP group {list(s.tp_group or ())}: {table}"
        if missing:
            statistic += f" (no answer from {missing}: stopped)"
        out: list[Payload] = []
        if set(slow) - set(s.ranks):  # else only the named member is slow: it got worse itself
            r_max, group_f = ratios[slow[0]], inc.factor

            def chunk_factor(r: float) -> float:
                return 1.0 + (r - 1.0) * (group_f - 1.0) / (r_max - 1.0)

            assert s.rank is not None  # _can_reprobe: one rank
            inc.factor = inc.published_factor = chunk_factor(ratios.get(s.rank, 1.0))
            inc.probe_sized = True
            for r in slow:
                key = IncidentKey.of_ranks((r,))
                if r in s.ranks or key in self.open:
                    continue
                f = chunk_factor(ratios[r])
                peer = replace(s, key=key, rank=r, ranks=(r,), factor=f, confidence=0.9, statistic=statistic,
                               note=f"a TP peer of rank {s.rank}, found by re-probing its group when it got slower")
                new = _Open(self._id(key, inc.last_update_iteration), FaultCategory.FAIL_SLOW, peer,
                            inc.last_update_iteration, f, f, confirmed=True,
                            last_update_iteration=inc.last_update_iteration, probe_used=True, probe_sized=True)
                self.open[key] = new
                self.opened_total += 1
                out += [IncidentOpened(incident_id=new.incident_id, category=new.category,
                                       severity=severity_of(f, new.category), iteration=new.opened_iteration,
                                       locations=[peer.location()], evidence=peer.evidence(),
                                       summary=f"rank {r} is ×{f:.2f} slower than its work predicts (replica "
                                               f"{peer.replica}, stage {peer.stage}; a TP peer of rank {s.rank})"),
                        IncidentConfirmed(incident_id=new.incident_id, method="probe",
                                          detail=f"re-probe: rank {r} took ×{ratios[r]:.2f} of the healthy "
                                                 f"reference ({table})", locations=[peer.location()])]
        return out + [IncidentUpdated(
            incident_id=inc.incident_id, iteration=inc.last_update_iteration,
            severity=severity_of(inc.factor, inc.category), locations=[s.location(inc.factor)],
            evidence=s.evidence().model_copy(update={"statistic": statistic}))]

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
                out += self._probes_left_to_the_dead(also=ch.rank)
                slow_key = next((k for k in self.open if k.kind is KeyKind.RANKS and ch.rank in k.ranks), None)
                slow = self.open.pop(slow_key) if slow_key else None
                if slow is not None:
                    out.append(IncidentResolved(incident_id=slow.incident_id, iteration=iteration,
                                                reason="superseded: the rank stopped (fail-stop incident)"))
                s = Suspect(key=key, target="compute", rank=ch.rank, link=None, node=None, replica=None, stage=None,
                            tp_group=None, factor=DEAD_FACTOR, confidence=0.99, iterations=[iteration],
                            observed_s=[], predicted_s=[], rank_factors={ch.rank: DEAD_FACTOR},
                            statistic="heartbeat and telemetry liveness", note=ch.reason)
                inc = _Open(self._id(key, iteration), FaultCategory.FAIL_STOP, s, iteration, DEAD_FACTOR,
                            DEAD_FACTOR, confirmed=True)
                self.open[key] = inc
                self.opened_total += 1
                out.append(IncidentOpened(incident_id=inc.incident_id, category=inc.category,
                                          severity=Severity.CRITICAL, iteration=iteration, locations=[s.location()],
                                          evidence=s.evidence(), summary=f"rank {ch.rank} stopped: {ch.reason}"))
                method: ConfirmMethod = "heartbeat" if "heartbeat" in ch.reason else "persistence"
                out.append(IncidentConfirmed(incident_id=inc.incident_id, method=method, detail=ch.reason,
                                             locations=[s.location()]))
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
                    confidence=round(1.0 / len(ranks), 4), iterations=[iteration], observed_s=[], predicted_s=[],
                    rank_factors={}, statistic="job stalled while every traced rank heartbeats", note=reason,
                    ranks=ranks)
        inc = _Open(self._id(key, iteration), FaultCategory.FAIL_STOP, s, iteration, DEAD_FACTOR, DEAD_FACTOR,
                    confirmed=True)
        self.open[key] = inc
        self.opened_total += 1
        where = f"rank {one}" if one is not None else f"one of the {len(ranks)} untraced ranks {list(ranks)}"
        out: list[Payload] = [
            IncidentOpened(incident_id=inc.incident_id, category=inc.category, severity=Severity.CRITICAL,
                           iteration=iteration, locations=[s.location()], evidence=s.evidence(),
                           summary=f"{where} stopped: {reason}"),
            IncidentConfirmed(incident_id=inc.incident_id, method="persistence", detail=reason,
                              locations=[s.location()])]
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
                              confidence=0.99 if one is not None else round(1.0 / len(silent), 4),
                              rank_factors={r: DEAD_FACTOR for r in silent})
        self.open[inc.suspect.key] = inc
        return [IncidentConfirmed(incident_id=inc.incident_id, method="probe", detail=detail,
                                  locations=[inc.suspect.location()])]

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
                    inc.excluded_since, inc.health_asked_iteration, inc.health_probes = iteration, None, 0
                elif not out_of_plan and not inc.unseen:  # a rank nobody traces stays probed, kept or not
                    inc.excluded_since = None
        return out
