"""The console's read model: a fold over the bus's events into plain in-memory structures.

Every screen is a projection of the log (ARCHITECTURE.md), so this is the only state the console
has: jobs (predicted against observed series, rank health, the layout, the current plan, the
policy), incidents and plans with their lifecycle, and the Security page's log (ui/security_log.py).
It never opens another process's DuckDB file.

Only what verifies: a control event (plans, decisions, commands, incidents, ``plan.current``, probe
results; collector/auth.py) whose signature fails changes no job, plan, incident or goodput figure;
it is listed once on the Security page as refused by the console, beside the engine's or the
trainer's own ``control.rejected``.

Idempotent: control and incident events are deduplicated on their id; telemetry and predictions
are keyed by (epoch, iteration[, rank]) and overwrite, so their ids need not be remembered (a
1,024-rank job would otherwise fill memory with ids). Events of an unknown kind are counted and
ignored — the stream has already sent undecodable records to the dead-letter topic.

Where a plan stands is collector/plan_lifecycle.py's fold, and where an incident stands
collector/incident_lifecycle.py's (both kept per job in one :class:`JobFolds`), the same ones the
engine, the demo and the DuckDB rows use; a :class:`PlanView` or :class:`IncidentView` keeps only
what the screens draw on top (every decision, command, ack, confirmation and update with its time)
and names the fold's state in the console's words.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field

import numpy as np

from collector.goodput import GoodputFold
from collector.events import (
    AckStatus, BusOutage, CommandAck, Envelope, FaultInjected, IncidentConfirmed, IncidentOpened, IncidentResolved,
    IncidentUpdated, IterationPrediction, PlanCurrent, PlanDecision, PlanProposed, PlanRolledBack, PlanVerified,
    PlanWithheld, PolicyChanged, PolicyMode, RankHealth, RankHealthEntry, RankIteration, ReconfigureCommand,
    RecoveryPhase, Severity, TelemetryNotice,
)
from collector import incident_lifecycle, plan_lifecycle
from collector.auth import Keyring, Refusals, load_keyring, needs_signature
from collector.incident_lifecycle import IncidentLifecycle, IncidentRecord
from collector.plan import Plan
from collector.plan_lifecycle import PlanLifecycle, PlanRecord, PlanStatus
from ui.rank_factors import RankFactors
from ui.rank_store import RankStore
from ui.security_log import SecurityLog

CONSOLE_JOB = "resihp-console"  # the job name on events about the console itself (sign-in), not a training job
CONSOLE_SOURCE = "ui:console"
CONSOLE_READER = "console"  # who refused a control event the read model would not show

SEVERITY_ORDER = {Severity.LOW: 0, Severity.MEDIUM: 1, Severity.HIGH: 2, Severity.CRITICAL: 3}


@dataclass(frozen=True)
class Slot:
    """Where a device sits and what it does, as its own telemetry last reported."""

    device: int
    node: int | None
    replica: int
    stage: int
    tp_rank: int
    epoch: int


class PredictionSeries:
    """Observed and predicted iteration times, in iteration order, with O(1) overwrite by key."""

    def __init__(self) -> None:
        self._index: dict[tuple[int, int], int] = {}
        self.iteration = array("q")
        self.epoch = array("q")
        self.time_s = array("d")
        self.observed_s = array("d")
        self.predicted_s = array("d")
        self.tokens = array("d")
        self._sorted = True

    def add(self, p: IterationPrediction, time_s: float) -> None:
        key = (p.epoch, p.iteration)
        i = self._index.get(key)
        if i is None:
            if len(self.iteration) and p.iteration < self.iteration[-1]:
                self._sorted = False
            self._index[key] = len(self.iteration)
            self.iteration.append(p.iteration)
            self.epoch.append(p.epoch)
            for arr, v in ((self.time_s, time_s), (self.observed_s, p.observed_s), (self.predicted_s, p.predicted_s),
                           (self.tokens, p.tokens)):
                arr.append(v)
        else:
            self.time_s[i], self.observed_s[i], self.predicted_s[i], self.tokens[i] = (
                time_s, p.observed_s, p.predicted_s, p.tokens)

    def __len__(self) -> int:
        return len(self.iteration)

    def arrays(self) -> dict[str, np.ndarray]:
        """Copies as numpy arrays, sorted by iteration."""
        out = {name: np.frombuffer(getattr(self, name), dtype=np.int64 if name in ("iteration", "epoch") else np.float64).copy()
               for name in ("iteration", "epoch", "time_s", "observed_s", "predicted_s", "tokens")}
        if not self._sorted:
            order = np.argsort(out["iteration"], kind="stable")
            out = {k: v[order] for k, v in out.items()}
        return out

    def iteration_at(self, time_s: float) -> int | None:
        """The iteration being predicted around ``time_s`` (for marking events that carry no iteration)."""
        if not len(self.time_s):
            return None
        times = list(self.time_s) if not self._sorted else self.time_s
        i = min(bisect.bisect_left(times, time_s), len(times) - 1)
        return int(self.iteration[i])


@dataclass
class PolicyView:
    mode: PolicyMode
    auto_severities: list[Severity]
    actor: str
    time_s: float
    auto_min_p_real: float | None = None  # how sure of its incidents an auto-applied plan must be (None: no bar)


@dataclass
class Mark:
    """Something to draw on a job's time series: an incident opened, a reshape applied, a fail-stop
    recovery inside the job, a bus outage."""

    kind: str  # "incident" | "reshape" | "recovery" | "outage"
    iteration: int | None
    time_s: float
    label: str


@dataclass
class RecoveryView:
    """One fail-stop recovery inside the job (``telemetry.recovery``): its phases in order, each
    with its own duration and the time since the failure was detected (the reporting rank's clock)."""

    generation: int
    world: list[int]
    lost: list[int]
    iteration: int
    failed_op: str
    time_s: float
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase → (duration_s, since_detected_s)

    @property
    def total_s(self) -> float | None:
        """Failure detected → first step of the new world finished (None until that phase came)."""
        last = self.phases.get("first step")
        return None if last is None else last[1]


@dataclass
class ConsoleJob:
    """One training job as the console draws it: predicted against observed times, the detector's
    rank health, the layout and plan that run, the policy, the marks on its time line, its faults,
    recoveries and bus outages, and its ranks' telemetry."""

    job: str
    predictions: PredictionSeries = field(default_factory=PredictionSeries)
    health: dict[int, RankHealthEntry] = field(default_factory=dict)  # the detector's newest view
    factors: RankFactors = field(default_factory=RankFactors)  # its views over iterations: the heatmap
    layout: dict[int, Slot] = field(default_factory=dict)
    current_plan: Plan | None = None
    policy: PolicyView | None = None
    marks: list[Mark] = field(default_factory=list)
    faults: list[FaultInjected] = field(default_factory=list)
    recoveries: dict[int, RecoveryView] = field(default_factory=dict)  # generation → its recovery
    ranks: RankStore = field(default_factory=RankStore)
    last_iteration: int = -1
    last_epoch: int = 0
    outages: dict[str, BusOutage] = field(default_factory=dict)  # outage id -> its newest word (end over start)
    notices: dict[str, TelemetryNotice] = field(default_factory=dict)  # finding -> the detector's word on the telemetry

    def running_epoch(self) -> int:
        return self.current_plan.epoch if self.current_plan is not None else self.last_epoch

    def slowdown(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(iterations, ranks, matrix ranks × iterations) of the detector's slowdown factors from
        ``first`` to ``last`` or the newest iteration the console has seen, whichever is earlier."""
        return self.factors.matrix(first, min(last, self.last_iteration))


@dataclass
class PlanView:
    plan_id: str
    job: str
    proposed: PlanProposed
    proposed_time_s: float
    source: str
    record: PlanRecord | None = None  # the fold's record of this plan (None: the fold kept another proposal)
    decisions: list[tuple[float, PlanDecision]] = field(default_factory=list)
    commands: list[tuple[float, ReconfigureCommand]] = field(default_factory=list)
    acks: list[tuple[float, CommandAck]] = field(default_factory=list)
    verified: tuple[float, PlanVerified] | None = None
    rolled_back: tuple[float, PlanRolledBack] | None = None

    @property
    def decision(self) -> tuple[float, PlanDecision] | None:
        """The first verdict counts; later ones are kept but do not change the outcome."""
        return self.decisions[0] if self.decisions else None

    @property
    def pending(self) -> bool:
        return not self.decisions

    @property
    def applied(self) -> tuple[float, CommandAck] | None:
        return next(((t, a) for t, a in self.acks if a.status == AckStatus.APPLIED), None)

    @property
    def node_orders(self) -> list[str]:
        """A node plan's orders, each with where it stands (the plan fold's record): waiting for
        the layout to be applied, commanded, or the agent's answer and its detail."""
        lines = []
        for order in self.proposed.node_orders:
            state = self.record.node_order_state(order.command_id) if self.record is not None else "waiting"
            ack = self.record.node_acks.get(order.command_id) if self.record is not None else None
            words = "waiting for the plan to be applied" if state == "waiting" else state.replace("_", " ")
            lines.append(f"{order.action} node {order.node} (rendezvous round {order.round}): {words}"
                         + (f" — {ack.detail}" if ack is not None and ack.detail else ""))
        return lines

    @property
    def status(self) -> str:
        """The fold's state in the console's words."""
        state = self.record.status if self.record is not None else PlanStatus.PROPOSED
        if state == PlanStatus.PROPOSED:
            return "awaiting decision"
        if state == PlanStatus.APPROVED:
            by = self.record.decided_by if self.record is not None else None
            return "auto-applied" if by is not None and by.startswith("policy:") else "approved"
        if state == PlanStatus.FAILED and self.acks:
            return f"command {self.acks[-1][1].status.value}"
        return _STATUS_WORDS.get(state, state.value)


_STATUS_WORDS = {PlanStatus.ROLLED_BACK: "rolled back"}


@dataclass
class IncidentView:
    """One incident: the fold's record of where it stands, and the history the screens draw."""

    incident_id: str
    job: str
    opened: IncidentOpened
    opened_time_s: float
    record: IncidentRecord  # the incident fold's (collector/incident_lifecycle.py)
    confirmed: tuple[float, IncidentConfirmed] | None = None
    updates: list[tuple[float, IncidentUpdated]] = field(default_factory=list)
    resolved: tuple[float, IncidentResolved] | None = None
    plan_ids: list[str] = field(default_factory=list)
    withheld: list[tuple[float, PlanWithheld]] = field(default_factory=list)  # why the engine did not plan

    def note(self, time_s: float, p: IncidentConfirmed | IncidentUpdated | IncidentResolved) -> None:
        """One later event of this incident; a redelivered confirmation or resolution keeps the first."""
        if isinstance(p, IncidentUpdated):
            self.updates.append((time_s, p))
        elif isinstance(p, IncidentConfirmed):
            self.confirmed = self.confirmed or (time_s, p)
        else:
            self.resolved = self.resolved or (time_s, p)

    @property
    def severity(self) -> Severity:
        return self.record.severity

    @property
    def latest_evidence(self):  # -> Evidence
        return self.updates[-1][1].evidence if self.updates else self.opened.evidence

    @property
    def latest_locations(self):
        """Where the fold says it is: an update's or a probe's confirmation's locations, else the opening's."""
        return self.record.locations


@dataclass
class TimelineStep:
    label: str
    time_s: float | None  # None: not reached yet
    detail: str = ""


@dataclass
class JobFolds(PlanLifecycle, IncidentLifecycle):
    """Both folds of one job's control streams, the plan lifecycle's and the incidents', admitting
    each event once for both."""


class ReadModel:
    """The fold. ``apply`` one event at a time, in log order per source."""

    def __init__(self, *, max_rank_iterations: int = 4096, keyring: Keyring | None = None) -> None:
        self.jobs: dict[str, ConsoleJob] = {}
        self.incidents: dict[str, IncidentView] = {}
        self.plans: dict[str, PlanView] = {}
        self.commands: dict[str, str] = {}  # command id -> plan id
        self.lifecycles: dict[str, JobFolds] = {}  # job -> its plan lifecycle's and incidents' folds
        self.last_seq: dict[tuple[str, str], int] = {}  # (job, source) -> highest seq seen
        self.applied = 0
        self.ignored = 0
        self._seen: set[str] = set()
        self._max_rank_iterations = max_rank_iterations
        self._early_remediation_events: dict[str, list[Envelope]] = {}
        self.security = SecurityLog()
        self.goodput = GoodputFold()  # the one definition /metrics serves too (collector/goodput.py)
        self.keyring = keyring  # None: the environment's (collector/auth.py's load_keyring)
        self._refused = Refusals()  # the newest ids of control events that did not verify: a flood stays bounded

    def job(self, name: str) -> ConsoleJob:
        view = self.jobs.get(name)
        if view is None:
            view = self.jobs[name] = ConsoleJob(name, ranks=RankStore(self._max_rank_iterations))
        return view

    def lifecycle(self, job: str) -> JobFolds:
        """The plan lifecycle's and the incidents' folds for ``job``."""
        state = self.lifecycles.get(job)
        if state is None:
            state = self.lifecycles[job] = JobFolds(job=job)
        return state

    def next_seq(self, job: str, source: str) -> int:
        """The sequence number a source that restarts should use next (contract: per-source seq)."""
        return self.last_seq.get((job, source), -1) + 1

    def apply(self, event: Envelope) -> None:
        if needs_signature(event.kind) and not self._authentic(event):
            return  # a forgery changes no screen: it shows only as a rejection
        key = (event.job, event.source)
        if event.seq > self.last_seq.get(key, -1):
            self.last_seq[key] = event.seq
        p = event.payload
        self.goodput.apply(event)
        if isinstance(p, RankIteration):
            job = self.job(event.job)
            job.ranks.add(p)
            job.layout[p.rank] = Slot(p.rank, p.node, p.coords.dp, p.coords.pp, p.coords.tp, p.epoch)
            job.last_iteration = max(job.last_iteration, p.iteration)
            job.last_epoch = max(job.last_epoch, p.epoch)
            self.applied += 1
            return
        if isinstance(p, IterationPrediction):
            job = self.job(event.job)
            job.predictions.add(p, event.time_s)
            job.last_iteration = max(job.last_iteration, p.iteration)
            job.last_epoch = max(job.last_epoch, p.epoch)
            self.applied += 1
            return
        if event.kind.startswith("incident."):
            self.security.saw_incident_event(event, duplicate=event.id in self._seen)
        if event.id in self._seen:
            return
        self._seen.add(event.id)
        self.applied += 1
        if self.security.apply(event):  # console-wide: no job view, no plan lifecycle
            return
        job = self.job(event.job)
        self._fold(event)
        handler = getattr(self, "_on_" + event.kind.replace(".", "_"), None)
        if handler is None:
            self.ignored += 1
            return
        handler(event, event.payload, job)  # each handler names the payload its kind carries

    def _fold(self, event: Envelope) -> None:
        state = self.lifecycle(event.job)
        if not plan_lifecycle.admit(state, event):
            return
        if isinstance(event.payload, incident_lifecycle.PAYLOADS):
            incident_lifecycle.transition(state, event)
        else:
            plan_lifecycle.transition(state, event)

    def _authentic(self, event: Envelope) -> bool:
        """Whether a control event's signature verifies; a refusal goes to the Security page once."""
        reason = (self.keyring or load_keyring()).verify(event)
        if reason is None:
            return True
        if self._refused.remember(event.id, reason):
            self.security.refused(event, reason, by=CONSOLE_READER)
        return False

    # ---- analytics ------------------------------------------------------------------------------

    def _on_telemetry_recovery(self, e: Envelope, p: RecoveryPhase, job: ConsoleJob) -> None:
        view = job.recoveries.get(p.generation)
        if view is None:
            view = job.recoveries[p.generation] = RecoveryView(p.generation, list(p.world), list(p.lost), p.iteration,
                                                               p.failed_op, e.time_s)
            job.marks.append(Mark("recovery", p.iteration, e.time_s,
                                  f"ranks {list(p.lost)} lost; world of {len(p.world)} went on"))
        view.phases[p.phase] = (p.duration_s, p.since_detected_s)

    def _on_analytics_rank_health(self, e: Envelope, p: RankHealth, job: ConsoleJob) -> None:
        for entry in p.entries():
            job.health[entry.rank] = entry
        job.factors.add(p)

    def _on_incident_opened(self, e: Envelope, p: IncidentOpened, job: ConsoleJob) -> None:
        record = self.lifecycle(e.job).incidents.get(p.incident_id)
        if record is None or p.incident_id in self.incidents:
            return  # the fold keeps an incident's first opening
        self.incidents[p.incident_id] = IncidentView(p.incident_id, e.job, p, e.time_s, record)
        job.marks.append(Mark("incident", p.iteration, e.time_s, f"{p.severity.value}: {p.summary}"))
        for pending in self._early_remediation_events.pop(p.incident_id, []):
            self._attach(pending, p.incident_id)

    def _on_incident_later(self, e: Envelope, p: IncidentConfirmed | IncidentUpdated | IncidentResolved,
                           job: ConsoleJob) -> None:
        """A confirmation, update or resolution of an incident this view holds (one it never saw
        opened is not shown)."""
        inc = self.incidents.get(p.incident_id)
        if inc is not None:
            inc.note(e.time_s, p)

    _on_incident_confirmed = _on_incident_updated = _on_incident_resolved = _on_incident_later

    def _on_analytics_bus_outage(self, e: Envelope, p: BusOutage, job: ConsoleJob) -> None:
        """Analytics could not read the bus and judged no rank dead meanwhile: a bus outage, not an incident."""
        known = job.outages.get(p.outage_id)
        if known is not None and known.ended_s is not None:
            return  # the end arrived first: the start adds nothing
        job.outages[p.outage_id] = p
        if p.ended_s is not None:
            job.marks.append(Mark("outage", job.predictions.iteration_at(p.started_s), p.started_s,
                                  f"bus outage: {p.duration_s or 0:.0f} s, fail-stop judgement of "
                                  f"{p.ranks_suspended} ranks suspended"))

    def _on_analytics_telemetry_notice(self, e: Envelope, p: TelemetryNotice, job: ConsoleJob) -> None:
        """The detector read the job's telemetry otherwise than its producer declared it: kept once per
        finding (the first word), shown on the job's page with what to declare."""
        job.notices.setdefault(p.finding, p)

    def _on_truth_fault(self, e: Envelope, p: FaultInjected, job: ConsoleJob) -> None:
        job.faults.append(p)

    # ---- remediation ----------------------------------------------------------------------------

    def _on_plan_current(self, e: Envelope, p: PlanCurrent, job: ConsoleJob) -> None:
        """The trainer (or simulator) says what it runs: the grid needs no telemetry to be drawn."""
        job.current_plan = self.lifecycle(e.job).running_plan or job.current_plan

    def _on_plan_proposed(self, e: Envelope, p: PlanProposed, job: ConsoleJob) -> None:
        self.plans[p.plan_id] = PlanView(p.plan_id, e.job, p, e.time_s, e.source,
                                         record=self.lifecycle(e.job).plans.get(p.plan_id))
        self._attach_to_incidents(e, p.incident_ids)

    def _on_plan_withheld(self, e: Envelope, p: PlanWithheld, job: ConsoleJob) -> None:
        self._attach_to_incidents(e, p.incident_ids)

    def _attach_to_incidents(self, e: Envelope, incident_ids: list[str]) -> None:
        """A remediation event about incidents; one that came before its incident (control and
        analytics are different topics) waits for it."""
        for iid in incident_ids:
            if iid in self.incidents:
                self._attach(e, iid)
            else:
                self._early_remediation_events.setdefault(iid, []).append(e)

    def _attach(self, e: Envelope, incident_id: str) -> None:
        inc = self.incidents[incident_id]
        p = e.payload
        if isinstance(p, PlanWithheld):
            inc.withheld.append((e.time_s, p))
        elif isinstance(p, PlanProposed) and p.plan_id not in inc.plan_ids:
            inc.plan_ids.append(p.plan_id)

    def _on_plan_decision(self, e: Envelope, p: PlanDecision, job: ConsoleJob) -> None:
        plan = self.plans.get(p.plan_id)
        if plan is not None:
            plan.decisions.append((e.time_s, p))

    def _on_command_reconfigure(self, e: Envelope, p: ReconfigureCommand, job: ConsoleJob) -> None:
        self.commands[p.command_id] = p.plan_id
        plan = self.plans.get(p.plan_id)
        if plan is not None:
            plan.commands.append((e.time_s, p))

    def _on_command_ack(self, e: Envelope, p: CommandAck, job: ConsoleJob) -> None:
        plan = self.plans.get(p.plan_id)
        if plan is not None:
            plan.acks.append((e.time_s, p))
        record = self.lifecycle(e.job).plans.get(p.plan_id)
        if record is not None and record.ack is p and record.status == PlanStatus.APPLIED:  # this ack applied it
            job.current_plan = self.lifecycle(e.job).running_plan or job.current_plan
            job.marks.append(Mark("reshape", job.predictions.iteration_at(e.time_s), e.time_s,
                                  f"epoch {p.running_epoch} applied ({p.pause_s:.1f}s pause)"))

    def _on_plan_verified(self, e: Envelope, p: PlanVerified, job: ConsoleJob) -> None:
        plan = self.plans.get(p.plan_id)
        if plan is not None:
            plan.verified = (e.time_s, p)

    def _on_plan_rolled_back(self, e: Envelope, p: PlanRolledBack, job: ConsoleJob) -> None:
        plan = self.plans.get(p.plan_id)
        if plan is not None:
            plan.rolled_back = (e.time_s, p)
            job.marks.append(Mark("reshape", job.predictions.iteration_at(e.time_s), e.time_s, "rolled back"))

    def _on_policy_changed(self, e: Envelope, p: PolicyChanged, job: ConsoleJob) -> None:
        job.policy = PolicyView(p.mode, list(p.auto_severities), p.actor, e.time_s, p.auto_min_p_real)

    # ---- derived views --------------------------------------------------------------------------

    def incident_state(self, inc: IncidentView) -> str:
        """The furthest lifecycle step reached: what the incident list shows."""
        if inc.resolved:
            return "resolved"
        for pid in reversed(inc.plan_ids):
            plan = self.plans.get(pid)
            if plan is not None:
                return plan.status
        return "confirmed" if inc.confirmed else "opened"

    def timeline(self, inc: IncidentView) -> list[TimelineStep]:
        """opened → confirmed → plan proposed → approved/auto-applied/rejected → applied → verified/rolled back."""
        steps = [TimelineStep("opened", inc.opened_time_s, inc.opened.summary)]
        steps.append(TimelineStep("confirmed", inc.confirmed[0] if inc.confirmed else None,
                                  f"{inc.confirmed[1].method}: {inc.confirmed[1].detail}" if inc.confirmed else ""))
        plan = self.plans.get(inc.plan_ids[-1]) if inc.plan_ids else None
        steps.append(TimelineStep("plan proposed", plan.proposed_time_s if plan else None,
                                  f"{plan.plan_id} by {plan.source} ({plan.proposed.strategy})" if plan else ""))
        if plan is not None and plan.decision is not None:
            t, d = plan.decision
            label = ("auto-applied" if d.actor.startswith("policy:") else "approved") if d.approve else "rejected"
            steps.append(TimelineStep(label, t, f"by {d.actor}" + (f": {d.comment}" if d.comment else "")))
        else:
            steps.append(TimelineStep("approved / auto-applied", None))
        if plan is not None and plan.decision is not None and not plan.decision[1].approve:
            return steps + ([TimelineStep("resolved", inc.resolved[0], inc.resolved[1].reason)] if inc.resolved else [])
        applied = plan.applied if plan else None
        steps.append(TimelineStep("applied", applied[0] if applied else None,
                                  f"epoch {applied[1].running_epoch}, pause {applied[1].pause_s:.1f} s" if applied else ""))
        if plan is not None and plan.rolled_back:
            t, r = plan.rolled_back
            steps.append(TimelineStep("rolled back", t, r.reason))
        else:
            v = plan.verified if plan else None
            steps.append(TimelineStep("verified", v[0] if v else None,
                                      f"{v[1].measured_tokens_per_s:,.0f} tokens/s measured"
                                      + (f": {v[1].reason}" if v[1].reason else "") if v else ""))
        if inc.resolved:
            steps.append(TimelineStep("resolved", inc.resolved[0], inc.resolved[1].reason))
        return steps

    def incidents_sorted(self, job: str | None = None) -> list[IncidentView]:
        """Open ones first, then by severity, newest first."""
        items = [i for i in list(self.incidents.values()) if job is None or i.job == job]
        return sorted(items, key=lambda i: (i.resolved is not None, -SEVERITY_ORDER[i.severity], -i.opened_time_s))

    def base_plan(self, plan: PlanView) -> Plan | None:
        """The plan a proposal starts from, if the console has seen it applied."""
        job = self.jobs.get(plan.job)
        if job is None:
            return None
        if job.current_plan is not None and job.current_plan.epoch == plan.proposed.base_epoch:
            return job.current_plan
        for other in self.plans.values():
            if other.applied and other.proposed.plan.epoch == plan.proposed.base_epoch:
                return other.proposed.plan
        return None
