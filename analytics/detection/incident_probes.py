"""The probe lifecycle of the book's incidents: asking, collecting the answers, judging them.

An incident asks one probe at a time (``IncidentProbe.kind``, a ``ProbeKind``):

- **naming**, when it opens with probes on: its suspects run a short fixed workload against a
  healthy reference; the slowest one, if above ``probe_bar``, is named and the incident confirmed.
- **links**, when nobody the naming probe asked computes slow but the time went outside the traced
  ranks: every rank's links, for a slow link or NIC.
- **re-probe**, when a named rank gets worse: its TP group again, since a peer that slows too only
  shows up as the named rank getting worse.
- **health**, now and then, for a slow rank no telemetry sees (the plan left it out, or nobody
  traces it): resolved once it measures healthy.

A probe is judged once every asked rank answered, or every rank still awaited is dead. Nothing else
concludes it early, in particular no count of iterations: an analytics consumer catching up reads
telemetry far ahead of the answers, which travel on the control topic.
"""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import median
from typing import TYPE_CHECKING

from analytics.detection.calibration import PROBE
from analytics.detection.incident_keys import UNTRACED_KEY, IncidentKey, KeyKind, ProbeKind
from analytics.detection.open_incident import IncidentProbe, OpenIncident, severity_of
from collector.events import (
    FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated, Payload, ProbeRequest,
    ProbeResult,
)

if TYPE_CHECKING:
    from analytics.detection.incidents import IncidentBook


class IncidentProbes:
    """The book's probe half. It reads and writes the book's open incidents (a naming re-keys one,
    a health probe resolves one, a re-probe opens a peer's) and reads its config at each use, so a
    retuned book is obeyed at once."""

    def __init__(self, book: IncidentBook) -> None:
        self.book = book

    # ---- asking ---------------------------------------------------------------------------------

    def ask_naming(self, inc: OpenIncident, iteration: int) -> ProbeRequest:
        """The probe a fail-slow incident asks when it opens: its suspects' compute, or a link's ends."""
        s = inc.suspect
        probe_id = inc.probe.ask(ProbeKind.NAMING, "probe-" + inc.incident_id[4:], iteration)
        ranks = list(s.ranks) or list(s.link or ())
        return ProbeRequest(probe_id=probe_id, incident_id=inc.incident_id, ranks=ranks,
                            target="compute" if s.target == "compute" else "link")

    def can_reprobe(self, inc: OpenIncident) -> bool:
        """Whether a worse size of ``inc`` re-probes its TP group: a probe named it, one rank of a
        group, and no re-probe is pending."""
        s = inc.suspect
        return (self.book.config.probes and s.target == "compute" and s.key.kind is KeyKind.RANKS and inc.probe.named
                and inc.probe.kind is not ProbeKind.REPROBE
                and len(s.ranks) == 1 and len(s.tp_group or ()) > 1)

    def reprobe(self, inc: OpenIncident, update: IncidentUpdated, iteration: int) -> list[Payload]:
        """Its TP peers run in lock-step with it and are never alarmed on while it is open, so a
        peer that slows down too only shows up as the named rank getting worse. The update says
        the group is being probed: a planner should wait for the answer."""
        probe_id = inc.probe.ask(ProbeKind.REPROBE, f"probe-{inc.incident_id[4:]}-{iteration}", iteration)
        group = list(inc.suspect.tp_group or ())
        return [update.model_copy(update={"probing": group}),
                ProbeRequest(probe_id=probe_id, incident_id=inc.incident_id, ranks=group, target="compute")]

    def health_probe(self, inc: OpenIncident, iteration: int) -> list[Payload]:
        """Ask an excluded slow rank for a probe ``excluded_probe_iterations`` after it was left
        out, then after twice that, four times, ...: a GPU that throttled and recovered is
        otherwise never seen healthy (it sends no telemetry), its incident never resolves, and the
        planner never takes it back. The wait doubles because a probe pauses the job while it
        runs (every rank runs it at the same boundary) and a device slow for long is ever less
        likely to have just recovered: over a 30-minute run at 0.26 s an iteration that is 5
        probes, not 60."""
        config, probe = self.book.config, inc.probe
        first = config.excluded_probe_iterations
        if (not (config.probes and first) or inc.excluded_since is None
                or probe.asked_iteration is not None or not inc.suspect.ranks):
            return []
        last = probe.health_asked_iteration if probe.health_asked_iteration is not None else inc.excluded_since
        if iteration - last < first * 2 ** probe.health_probes:
            return []
        probe_id = probe.ask(ProbeKind.HEALTH, f"probe-{inc.incident_id[4:]}-health-{iteration}", iteration)
        probe.health_asked_iteration = iteration
        probe.health_probes += 1
        return [ProbeRequest(probe_id=probe_id, incident_id=inc.incident_id, ranks=list(inc.suspect.ranks),
                             target="compute")]

    @staticmethod
    def asked(inc: OpenIncident) -> tuple[int, ...]:
        """The ranks the pending (or last) probe asked."""
        if inc.probe.kind is ProbeKind.LINKS:
            return inc.suspect.link_probe_ranks
        if inc.probe.kind is ProbeKind.REPROBE:
            return inc.suspect.tp_group or ()
        return inc.suspect.ranks or tuple(inc.suspect.link or ())

    # ---- answers --------------------------------------------------------------------------------

    def result(self, p: ProbeResult) -> list[Payload]:
        """Collect a probe's answers; once every asked rank that is alive answered, confirm on the
        slowest one (and name it, when telemetry could only point at its TP group)."""
        for inc in self.book.open.values():
            if inc.probe.id != p.probe_id:
                continue
            inc.probe.ratios[p.rank] = p.duration_s / p.reference_s
            if self._awaited(inc) - self.book.dead_ranks():
                return []
            return self._conclude(inc)
        return []

    def _awaited(self, inc: OpenIncident) -> set[int]:
        """The asked ranks whose answer has not come."""
        return set(self.asked(inc)) - set(inc.probe.ratios)

    def left_to_the_dead(self, also: int) -> list[Payload]:
        """Conclude every pending probe whose missing answers are all from ranks now dead (``also``
        among them): a dead rank never answers."""
        dead, out = self.book.dead_ranks() | {also}, []
        for inc in list(self.book.open.values()):
            if inc.probe.asked_iteration is not None and (awaited := self._awaited(inc)) and awaited <= dead:
                out += self._conclude(inc)
        return out

    def _conclude(self, inc: OpenIncident) -> list[Payload]:
        """Judge a probe on the answers it has: all of them, or all but those of ranks now dead."""
        probe = inc.probe
        if probe.asked_iteration is None:
            return []  # concluded already: a repeated answer changes nothing
        asked_iteration, probe.asked_iteration = probe.asked_iteration, None
        asked = self.asked(inc)
        if probe.kind is ProbeKind.HEALTH:
            return self._health_result(inc, asked_iteration)
        if probe.kind is ProbeKind.REPROBE:
            return self._reprobe_result(inc, missing=sorted(set(asked) - set(probe.ratios)))
        if not probe.ratios:
            return []
        worst = max(probe.ratios, key=lambda rank: probe.ratios[rank])
        s, below = inc.suspect, probe.ratios[worst] < self.bar(probe.ratios)
        if below and s.link_probe_ranks and probe.kind is not ProbeKind.LINKS:
            # nobody it named computes slow: the time went to a link or a NIC; ask every rank's links
            probe_id = probe.ask(ProbeKind.LINKS, f"probe-{inc.incident_id[4:]}-links", asked_iteration)
            return [ProbeRequest(probe_id=probe_id, incident_id=inc.incident_id, ranks=list(s.link_probe_ranks),
                                 target="link")]
        if below or probe.named or not self.book.big_enough(max(inc.factor, probe.ratios[worst])):
            return []  # nobody slow, named already, or too small to confirm (it may grow, or resolve)
        return self._named(inc, worst, asked)

    def _named(self, inc: OpenIncident, worst: int, asked: tuple[int, ...]) -> list[Payload]:
        """A naming (or links) probe found ``worst`` slow: the incident is about it from now on,
        confirmed by the probe (or updated, when persistence confirmed it while the probe ran)."""
        probe, s = inc.probe, inc.suspect
        ratio = probe.ratios[worst]
        probe.named = True
        if probe.kind is ProbeKind.LINKS:  # the links' probe found the slow one: the incident is about that link or NIC
            s.target, s.tp_group, s.ranks = "link", None, ()
        # Persistence may have confirmed the incident while the probe ran (telemetry and the
        # answers travel on different topics): the answers still name the member, as an update.
        already = inc.confirmed
        inc.confirmed = True
        if s.target == "compute" and s.rank is None:
            self._name_member(inc, worst, asked)
        elif s.target == "link":
            self._place_link(inc, worst)
        inc.published_factor = inc.factor  # what the naming below publishes: the size consumers now hold
        ratios = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(probe.ratios.items()))
        if missing := sorted(set(asked) - set(probe.ratios)):
            ratios += f"; no answer from {missing}: stopped"
        if already:
            return [IncidentUpdated(incident_id=inc.incident_id, iteration=inc.last_update_iteration,
                                    severity=severity_of(inc.factor),
                                    locations=[s.location(inc.factor)], p_real=inc.p_real,
                                    evidence=s.evidence().model_copy(update={
                                        "statistic": f"probe: rank {worst} took ×{ratio:.2f} ({ratios})"}))]
        return [IncidentConfirmed(
            incident_id=inc.incident_id, method="probe",
            detail=f"probe: rank {worst} took ×{ratio:.2f} of the healthy reference ({ratios})",
            locations=[s.location(inc.factor)], p_real=inc.p_real)]

    def _name_member(self, inc: OpenIncident, worst: int, asked: tuple[int, ...]) -> None:
        """The compute incident names one member of the group telemetry pointed at."""
        s = inc.suspect
        s.rank, s.ranks = worst, (worst,)
        s.place_confidence = 1.0  # the probe measured each member alone
        if s.key == UNTRACED_KEY and worst in s.rank_factors:
            # sized through the schedule for the named rank's own stage (analytics/detection/untraced.py),
            # no longer as the median stage
            inc.factor = s.rank_factors[worst]
        # The incident is now about the member alone: its healthy peers stop being suspects
        # (left out of fits, never alarmed on), or a later fault on one of them, in a
        # layout that keeps them, would go unseen for as long as this incident is open.
        named = IncidentKey.of_ranks((worst,))
        book = self.book
        if s.key.kind is KeyKind.RANKS and named not in book.open:  # an untraced one stays job-level
            book.open[named] = book.open.pop(s.key)
            s.key = named

    def _place_link(self, inc: OpenIncident, worst: int) -> None:
        """The link incident is about the slow link between two slow ends, or one device's NIC,
        sized by the probe."""
        s, ratios = inc.suspect, inc.probe.ratios
        slow = sorted((r for r, v in ratios.items() if v >= self.book.config.probe_confirm_ratio),
                      key=lambda r: -ratios[r])
        if len(slow) >= 2 and abs(ratios[slow[1]] / ratios[worst] - 1) < 0.25:
            s.link, s.rank = (slow[0], slow[1]), None  # both ends of one slow link
        else:
            s.link, s.rank = None, worst  # one device's NIC
        s.place_confidence = 1.0  # the probe timed it
        # Telemetry measured how much the iteration lost; the planner needs how slow the
        # link is (it costs every transfer over it), which is what the probe timed.
        inc.factor = max(ratios[worst], inc.factor)
        inc.probe_sized = True

    def bar(self, ratios: dict[int, float]) -> float:
        """The probe ratio that names a rank slow: ``probe_confirm_ratio``, and with three or more
        answers also four robust σ above their median. Why: a probe is noisy too (a few per cent per
        answer in the simulator), and the worst of sixteen healthy answers (an untraced replica's
        ranks, asked together) passed 1.03 by chance and named a healthy rank."""
        bar = self.book.config.probe_confirm_ratio
        if len(ratios) < 3:
            return bar
        logs = [math.log(max(v, 1e-12)) for v in ratios.values()]
        centre = median(logs)
        spread = 1.4826 * median(abs(x - centre) for x in logs)
        return max(bar, math.exp(centre + 4.0 * spread))

    def _health_result(self, inc: OpenIncident, iteration: int) -> list[Payload]:
        """An excluded rank's health probe: resolved when every asked rank answered below the
        ratio that confirms a slowdown; otherwise it stays open, to be probed again."""
        inc.probe.kind = ProbeKind.NAMING
        ratios, asked = inc.probe.ratios, self.asked(inc)
        if set(ratios) != set(asked) or max(ratios.values()) >= self.book.config.probe_confirm_ratio:
            return []
        key = next(k for k, v in self.book.open.items() if v is inc)
        del self.book.open[key]
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        return [IncidentResolved(incident_id=inc.incident_id, iteration=iteration,
                                 reason=f"probed healthy while the plan left it out ({table})")]

    def _reprobe_result(self, inc: OpenIncident, missing: list[int]) -> list[Payload]:
        """A named rank's TP group answered a re-probe. If other members are slow too, each gets
        an incident of its own (opened and confirmed by the probe), and every slow member's factor
        becomes its share of the group's: telemetry measures the group's chunks, which the slowest
        member sets, so a member ×r in compute (by the probe) is 1 + (r − 1)·(F − 1)/(r_max − 1)
        in chunk time, F being the group's. Those factors are the probe's from then on (telemetry
        would give every member the group's). The named rank's incident is always updated, last:
        that update (``probing`` empty) is the answer a planner waits for, so every peer's
        incident is already on the log when it comes."""
        inc.probe.kind = ProbeKind.NAMING
        ratios, s = inc.probe.ratios, inc.suspect
        slow = sorted((r for r, v in ratios.items() if v >= self.book.config.probe_confirm_ratio),
                      key=lambda r: -ratios[r])
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        statistic = f"re-probe of TP group {list(s.tp_group or ())}: {table}"
        if missing:
            statistic += f" (no answer from {missing}: stopped)"
        out: list[Payload] = []
        if set(slow) - set(s.ranks):  # else only the named member is slow: it got worse itself
            r_max, group_f = ratios[slow[0]], inc.factor

            def chunk_factor(r: float) -> float:
                return 1.0 + (r - 1.0) * (group_f - 1.0) / (r_max - 1.0)

            assert s.rank is not None  # can_reprobe: one rank
            inc.factor = inc.published_factor = chunk_factor(ratios.get(s.rank, 1.0))
            inc.probe_sized = True
            for r in slow:
                if r not in s.ranks and IncidentKey.of_ranks((r,)) not in self.book.open:
                    out += self._open_peer(inc, r, chunk_factor(ratios[r]), statistic, table)
        return out + [IncidentUpdated(
            incident_id=inc.incident_id, iteration=inc.last_update_iteration,
            severity=severity_of(inc.factor), locations=[s.location(inc.factor)], p_real=inc.p_real,
            evidence=s.evidence().model_copy(update={"statistic": statistic}))]

    def _open_peer(self, inc: OpenIncident, r: int, f: float, statistic: str, table: str) -> list[Payload]:
        """A TP peer the re-probe found slow: its own incident, opened and confirmed by the probe,
        at the named rank's last update (the iteration the re-probe was asked at)."""
        s, at = inc.suspect, inc.last_update_iteration
        key = IncidentKey.of_ranks((r,))
        bar = self.book.config.probe_confirm_ratio
        peer = replace(s, key=key, rank=r, ranks=(r,), factor=f, place_confidence=1.0, statistic=statistic,
                       note=f"a TP peer of rank {s.rank}, found by re-probing its group when it got slower",
                       basis=PROBE, margin=math.log(max(inc.probe.ratios[r], 1e-12)) / math.log(bar) if bar > 1 else 1.0)
        new = OpenIncident(self.book.incident_id(key, at), FaultCategory.FAIL_SLOW, peer, at, f, f, p_real=peer.p_real(),
                           confirmed=True, last_update_iteration=at, probe=IncidentProbe(named=True), probe_sized=True)
        self.book.add(new)
        return [IncidentOpened(incident_id=new.incident_id, category=new.category,
                               severity=severity_of(f), iteration=new.opened_iteration,
                               locations=[peer.location()], evidence=peer.evidence(), p_real=new.p_real,
                               summary=f"rank {r} is ×{f:.2f} slower than its work predicts (replica "
                                       f"{peer.replica}, stage {peer.stage}; a TP peer of rank {s.rank})"),
                IncidentConfirmed(incident_id=new.incident_id, method="probe",
                                  detail=f"re-probe: rank {r} took ×{inc.probe.ratios[r]:.2f} of the healthy "
                                         f"reference ({table})", locations=[peer.location()], p_real=new.p_real)]
