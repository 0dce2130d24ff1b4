"""The remediation lifecycle as a fold over events (event sourcing: state = fold(events)).

    incident.opened/confirmed/updated/resolved → plan.proposed → plan.decision (operator or
    policy:auto) → command.reconfigure (epoch e+1) → command.ack → plan.verified | plan.rolled_back

:func:`step` applies one event to a :class:`LifecycleState` and does no I/O, so the same log
always folds to the same state — the engine, ``resihp plans list`` and the console all get their
view this way. Anything that must not take effect is *reported*, never applied: a decision on a
plan that is no longer waiting (a decision made twice applies once), a command for a plan nobody
approved, a command whose epoch is not the running epoch + 1 (stale or out of order), a duplicate
command, a trainer's ``ignored_*`` acknowledgement. Events are deduplicated on their id.

:func:`reactions` is the other half: what the engine should publish given the state (auto
decisions, commands for approved plans, verification verdicts). It is pure too, and every
reaction has a deterministic event id, so publishing one twice is harmless.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import StrEnum

from collector.events import (
    AckStatus, CommandAck, CostModelFitted, Envelope, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved,
    IncidentUpdated, IterationPrediction, IterationSummary, Location, Payload, PlanDecision, PlanProposed,
    PlanCurrent, PlanRolledBack, PlanVerified, PlanWithheld, PolicyChanged, PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import Plan
from remediation.verification import Verification, verdict

_NAMESPACE = uuid.UUID("3b0d7c52-8f7e-4d3a-9c61-5a2e7f1b9d04")


class PlanStatus(StrEnum):
    PROPOSED = "proposed"
    APPROVED = "approved"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"
    COMMANDED = "commanded"
    APPLIED = "applied"
    VERIFIED = "verified"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


WAITING = (PlanStatus.PROPOSED, PlanStatus.APPROVED)
IN_FLIGHT = (PlanStatus.APPROVED, PlanStatus.COMMANDED, PlanStatus.APPLIED)


@dataclass
class IncidentRecord:
    incident_id: str
    category: FaultCategory
    severity: Severity
    locations: list[Location]
    summary: str
    opened_iteration: int
    status: str = "open"  # open | confirmed | resolved
    # the iteration of its latest update (or opening): the faults it describes have been as they are
    # since then, so a plan answering it is judged against the old layout's samples from there on
    changed_iteration: int = -1
    opened_at_s: float = 0.0  # the opening event's time (the analytics consumer stamps the telemetry's)
    probing: tuple[int, ...] = ()  # ranks a probe re-asks since the latest update: a better location follows
    probing_since_s: float = 0.0  # that update's time


@dataclass
class PlanRecord:
    plan_id: str
    proposal: PlanProposed
    status: PlanStatus = PlanStatus.PROPOSED
    proposed_at_s: float = 0.0
    decided_by: str | None = None
    comment: str = ""
    command_id: str | None = None
    ack: CommandAck | None = None
    samples: dict[int, tuple[int, float]] = field(default_factory=dict)  # iteration -> (tokens, wall_s)
    measured_tokens_per_s: float | None = None
    verdict: str = ""

    @property
    def epoch(self) -> int:
        return self.proposal.plan.epoch


@dataclass(frozen=True)
class Report:
    """Something that was not applied, and why (stale, duplicate, unknown, refused)."""

    event_id: str
    kind: str
    message: str


_SEVERITY_ORDER = {s: i for i, s in enumerate([Severity.LOW, Severity.MEDIUM, Severity.HIGH, Severity.CRITICAL])}


@dataclass
class LifecycleState:
    job: str | None = None
    running_epoch: int = 0
    running_plan: Plan | None = None
    incidents: dict[str, IncidentRecord] = field(default_factory=dict)
    plans: dict[str, PlanRecord] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)  # command_id -> plan_id
    policy_mode: PolicyMode = PolicyMode.PROPOSE
    auto_severities: list[Severity] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    incident_version: int = 0  # bumps whenever the set of faults changes (a cue to re-plan)
    seen: set[str] = field(default_factory=set)
    announced: dict[int, PlanCurrent] = field(default_factory=dict)  # epoch -> the trainer's plan.current
    cost_fits: dict[int, CostModelFitted] = field(default_factory=dict)  # epoch -> latest analytics.cost_model
    epoch_samples: dict[int, dict[int, tuple[int, float]]] = field(default_factory=dict)  # epoch -> it -> (tokens, s)
    # devices a fail-stop incident named, until a plan the trainer runs uses them again (repaired): a
    # fail-stop incident is *resolved* once the new plan leaves its device out, but the device stays dead
    known_dead: set[int] = field(default_factory=set)
    layouts: dict[int, Plan] = field(default_factory=dict)  # epoch -> the plan that ran (for roll-backs)
    withheld: list[PlanWithheld] = field(default_factory=list)  # why the engine did not plan, in order

    def open_incidents(self) -> list[IncidentRecord]:
        return [i for i in self.incidents.values() if i.status != "resolved"]

    def plan_in_flight(self) -> PlanRecord | None:
        return next((p for p in self.plans.values() if p.status in IN_FLIGHT), None)

    def blocking_plan(self) -> PlanRecord | None:
        """The plan that holds back new planning, if any: one approved or commanded, or one applied
        and awaiting verification — unless a fail-stop it does not answer is open: the job hangs, so
        that plan can never gather its samples, and waiting for it would leave the job hung for good."""
        record = self.plan_in_flight()
        if record is None or record.status != PlanStatus.APPLIED:
            return record
        answered = set(record.proposal.incident_ids)
        new_stop = any(i.category == FaultCategory.FAIL_STOP and i.incident_id not in answered
                       for i in self.open_incidents())
        return None if new_stop else record

    def waiting(self) -> list[PlanRecord]:
        return [p for p in self.plans.values() if p.status == PlanStatus.PROPOSED]

    def failed(self) -> list[PlanRecord]:
        """Plans the trainer could not apply (or that went stale on the way)."""
        return [p for p in self.plans.values() if p.status == PlanStatus.FAILED]

    def max_severity(self) -> Severity:
        open_ = self.open_incidents()
        return max((i.severity for i in open_), key=lambda s: _SEVERITY_ORDER[s], default=Severity.LOW)


def initial_state(job: str | None = None, plan: Plan | None = None) -> LifecycleState:
    return LifecycleState(job=job, running_epoch=plan.epoch if plan else 0, running_plan=plan,
                          layouts={plan.epoch: plan} if plan else {})


def _note_dead(state: LifecycleState, category: FaultCategory, locations: list[Location]) -> None:
    if FaultCategory(category) != FaultCategory.FAIL_STOP:
        return
    for loc in locations:
        if loc.rank is not None:
            state.known_dead.add(loc.rank)
        elif loc.tp_group:
            state.known_dead.update(loc.tp_group)


def _run(state: LifecycleState, plan: Plan) -> None:
    """``plan`` runs now: its devices are alive, and plans left behind by the epoch change close."""
    state.running_epoch = plan.epoch
    state.running_plan = plan
    state.layouts[plan.epoch] = plan
    state.known_dead.difference_update(plan.devices)
    for other in state.plans.values():
        if other.status == PlanStatus.APPLIED and other.epoch < plan.epoch:
            other.status = PlanStatus.SUPERSEDED
            other.verdict = f"not verified: epoch {plan.epoch} replaced it first"
        elif other.status in WAITING and other.proposal.base_epoch < plan.epoch:
            other.status = PlanStatus.SUPERSEDED
            other.verdict = f"its base epoch {other.proposal.base_epoch} no longer runs (epoch {plan.epoch} does)"


def _report(state: LifecycleState, event: Envelope, message: str) -> None:
    state.reports.append(Report(event.id, event.kind, message))


def step(state: LifecycleState, event: Envelope) -> LifecycleState:
    """Fold one event into ``state`` (updated in place and returned). Events of other jobs and
    events already seen are ignored."""
    if state.job is not None and event.job != state.job:
        return state
    if event.id in state.seen:
        return state
    state.seen.add(event.id)
    p = event.payload
    handler = _HANDLERS.get(type(p))
    if handler is not None:
        handler(state, event, p)
    return state


def fold(events: list[Envelope] | tuple[Envelope, ...], state: LifecycleState | None = None) -> LifecycleState:
    state = state or initial_state()
    for e in events:
        step(state, e)
    return state


# ---- handlers ------------------------------------------------------------------------------------


def _incident_opened(state: LifecycleState, e: Envelope, p: IncidentOpened) -> None:
    if p.incident_id in state.incidents:
        _report(state, e, f"incident {p.incident_id} opened twice; kept the first")
        return
    state.incidents[p.incident_id] = IncidentRecord(p.incident_id, p.category, p.severity, list(p.locations),
                                                    p.summary, p.iteration, changed_iteration=p.iteration,
                                                    opened_at_s=e.time_s)
    _note_dead(state, p.category, list(p.locations))
    state.incident_version += 1


def _incident_confirmed(state: LifecycleState, e: Envelope, p: IncidentConfirmed) -> None:
    inc = state.incidents.get(p.incident_id)
    if inc is None:
        _report(state, e, f"confirmation of unknown incident {p.incident_id}")
        return
    inc.status = "confirmed"
    inc.probing = ()
    if p.locations:
        _relocate(state, inc, p.locations)


def _incident_updated(state: LifecycleState, e: Envelope, p: IncidentUpdated) -> None:
    inc = state.incidents.get(p.incident_id)
    if inc is None:
        _report(state, e, f"update of unknown incident {p.incident_id}")
        return
    inc.severity = p.severity
    inc.changed_iteration = max(inc.changed_iteration, p.iteration)
    inc.probing, inc.probing_since_s = tuple(p.probing), e.time_s
    _relocate(state, inc, p.locations)


def _relocate(state: LifecycleState, inc: IncidentRecord, locations: list[Location]) -> None:
    """New locations for an open incident: what the planner plans around changed."""
    inc.locations = list(locations)
    _note_dead(state, inc.category, inc.locations)
    state.incident_version += 1


def _incident_resolved(state: LifecycleState, e: Envelope, p: IncidentResolved) -> None:
    inc = state.incidents.get(p.incident_id)
    if inc is None:
        _report(state, e, f"resolution of unknown incident {p.incident_id}")
        return
    inc.status = "resolved"
    inc.probing = ()
    state.incident_version += 1


def _plan_proposed(state: LifecycleState, e: Envelope, p: PlanProposed) -> None:
    if p.plan_id in state.plans:
        _report(state, e, f"plan {p.plan_id} proposed twice; kept the first")
        return
    record = PlanRecord(p.plan_id, p, proposed_at_s=e.time_s)
    state.plans[p.plan_id] = record
    if p.base_epoch != state.running_epoch:
        record.status = PlanStatus.SUPERSEDED
        _report(state, e, f"plan {p.plan_id} is based on epoch {p.base_epoch} but epoch {state.running_epoch} runs; "
                          "superseded on arrival")
        return
    for other in state.plans.values():
        if other is not record and other.status == PlanStatus.PROPOSED and other.proposal.base_epoch == p.base_epoch:
            other.status = PlanStatus.SUPERSEDED
            other.verdict = f"superseded by {p.plan_id}"


def _plan_decision(state: LifecycleState, e: Envelope, p: PlanDecision) -> None:
    record = state.plans.get(p.plan_id)
    if record is None:
        _report(state, e, f"decision by {p.actor} on unknown plan {p.plan_id}; ignored")
        return
    if record.status != PlanStatus.PROPOSED:
        _report(state, e, f"decision by {p.actor} on plan {p.plan_id}, which is already {record.status.value}"
                          f"{' by ' + record.decided_by if record.decided_by else ''}; ignored (a decision applies once)")
        return
    record.status = PlanStatus.APPROVED if p.approve else PlanStatus.REJECTED
    record.decided_by = p.actor
    record.comment = p.comment


def _policy_changed(state: LifecycleState, e: Envelope, p: PolicyChanged) -> None:
    state.policy_mode = p.mode
    state.auto_severities = list(p.auto_severities)


def _command(state: LifecycleState, e: Envelope, p: ReconfigureCommand) -> None:
    record = state.plans.get(p.plan_id)
    if p.command_id in state.commands:
        _report(state, e, f"duplicate command {p.command_id} for plan {p.plan_id}; ignored")
        return
    if record is None or record.status != PlanStatus.APPROVED:
        status = "unknown" if record is None else record.status.value
        _report(state, e, f"command {p.command_id} for plan {p.plan_id} ({status}, not approved); ignored")
        return
    if p.plan.epoch != state.running_epoch + 1:
        _report(state, e, f"stale command {p.command_id}: asks for epoch {p.plan.epoch} but epoch "
                          f"{state.running_epoch} runs (needs {state.running_epoch + 1}); ignored")
        return
    state.commands[p.command_id] = p.plan_id
    record.status = PlanStatus.COMMANDED
    record.command_id = p.command_id


def _ack(state: LifecycleState, e: Envelope, p: CommandAck) -> None:
    plan_id = state.commands.get(p.command_id)
    record = state.plans.get(plan_id) if plan_id else None
    if record is None:
        _report(state, e, f"ack for unknown command {p.command_id}")
        return
    if p.status == AckStatus.APPLIED:
        if record.status != PlanStatus.COMMANDED:
            _report(state, e, f"second 'applied' ack for command {p.command_id}; ignored")
            return
        record.status = PlanStatus.APPLIED
        record.ack = p
        _run(state, record.proposal.plan)
        state.running_epoch = p.running_epoch
        # Iterations of the new epoch folded before the ack (they travel on other topics, so a
        # replay or a lagging control consumer can read them first) are this plan's samples too.
        for iteration, sample in state.epoch_samples.get(record.epoch, {}).items():
            record.samples.setdefault(iteration, sample)
    elif p.status == AckStatus.FAILED:
        record.status = PlanStatus.FAILED
        record.ack = p
        record.verdict = f"trainer failed to apply: {p.detail}"
    else:
        _report(state, e, f"trainer {p.status.value.replace('_', ' ')} command {p.command_id} "
                          f"(asked epoch {p.epoch}, runs {p.running_epoch}): {p.detail}")
        if p.running_epoch != state.running_epoch and p.status == AckStatus.IGNORED_STALE:
            record.status = PlanStatus.FAILED
            record.verdict = f"trainer runs epoch {p.running_epoch}; command was stale"


KEPT_UNVERIFIED = "kept: the layout before it cannot run again"  # a short plan's verdict when no roll-back exists
SAMPLES_KEPT_PER_EPOCH = 256  # the newest iterations of each epoch, the "before" of a plan's verification


def _sample(state: LifecycleState, epoch: int, iteration: int, tokens: int, wall_s: float) -> None:
    if wall_s <= 0:
        return
    kept = state.epoch_samples.setdefault(epoch, {})
    kept.setdefault(iteration, (tokens, wall_s))
    if len(kept) > SAMPLES_KEPT_PER_EPOCH:
        del kept[min(kept)]
    if epoch != state.running_epoch:
        return
    for record in state.plans.values():
        if record.status == PlanStatus.APPLIED and record.epoch == epoch:
            record.samples.setdefault(iteration, (tokens, wall_s))


def _summary(state: LifecycleState, e: Envelope, p: IterationSummary) -> None:
    _sample(state, p.epoch, p.iteration, p.tokens, p.wall_s)


def _prediction(state: LifecycleState, e: Envelope, p: IterationPrediction) -> None:
    _sample(state, p.epoch, p.iteration, p.tokens, p.observed_s)


def _verified(state: LifecycleState, e: Envelope, p: PlanVerified) -> None:
    record = state.plans.get(p.plan_id)
    if record is None or record.status != PlanStatus.APPLIED:
        _report(state, e, f"verification of plan {p.plan_id} that is not applied; ignored")
        return
    record.status = PlanStatus.VERIFIED
    record.measured_tokens_per_s = p.measured_tokens_per_s


def _rolled_back(state: LifecycleState, e: Envelope, p: PlanRolledBack) -> None:
    record = state.plans.get(p.plan_id)
    if record is None or record.status != PlanStatus.APPLIED:
        _report(state, e, f"roll-back of plan {p.plan_id} that is not applied; ignored")
        return
    record.status = PlanStatus.ROLLED_BACK
    record.measured_tokens_per_s = p.measured_tokens_per_s
    record.verdict = p.reason


def _plan_current(state: LifecycleState, e: Envelope, p: PlanCurrent) -> None:
    """The trainer's own word on what runs: authoritative for the running plan (it covers a start
    with no command, and an elastic restart the launcher did by itself)."""
    state.announced[p.plan.epoch] = p
    if p.plan.epoch >= state.running_epoch:
        _run(state, p.plan)
    else:
        _report(state, e, f"plan.current for epoch {p.plan.epoch} arrived after epoch {state.running_epoch}; kept")


def _cost_model(state: LifecycleState, e: Envelope, p: CostModelFitted) -> None:
    old = state.cost_fits.get(p.epoch)
    if old is None or p.iteration >= old.iteration:
        state.cost_fits[p.epoch] = p


def _withheld(state: LifecycleState, e: Envelope, p: PlanWithheld) -> None:
    state.withheld.append(p)


_HANDLERS = {
    PlanCurrent: _plan_current, CostModelFitted: _cost_model,
    IncidentOpened: _incident_opened, IncidentConfirmed: _incident_confirmed, IncidentUpdated: _incident_updated,
    IncidentResolved: _incident_resolved, PlanProposed: _plan_proposed, PlanDecision: _plan_decision,
    PolicyChanged: _policy_changed, ReconfigureCommand: _command, CommandAck: _ack, IterationSummary: _summary,
    IterationPrediction: _prediction, PlanVerified: _verified, PlanRolledBack: _rolled_back, PlanWithheld: _withheld,
}


# ---- reactions -----------------------------------------------------------------------------------


def can_roll_back(state: LifecycleState, record: PlanRecord) -> bool:
    """Whether the layout ``record`` replaced could run again: known, and using no device known dead
    (a plan that resumed a job hung on a dead device has nothing to roll back to: it is kept)."""
    previous = state.layouts.get(record.proposal.base_epoch)
    if record.proposal.current_tokens_per_s <= 0 or previous is None:
        return False
    return not any(d in state.known_dead for d in previous.devices)


def reaction_id(job: str, what: str) -> str:
    """Deterministic event id of a reaction, so re-publishing it is deduplicated by every fold."""
    return uuid.uuid5(_NAMESPACE, f"{job}/{what}").hex


def reactions(state: LifecycleState, verification: Verification = Verification()) -> list[tuple[str, Payload]]:
    """(event id key, payload) the engine should publish now."""
    out: list[tuple[str, Payload]] = []
    for record in state.plans.values():
        prop = record.proposal
        if (record.status == PlanStatus.PROPOSED and state.policy_mode == PolicyMode.AUTO
                and prop.severity in state.auto_severities):
            out.append((f"decision/{record.plan_id}", PlanDecision(
                plan_id=record.plan_id, approve=True, actor="policy:auto",
                comment=f"auto-applied: severity {prop.severity.value} is in the policy's auto set")))
        elif record.status == PlanStatus.APPROVED and prop.base_epoch == state.running_epoch:
            out.append((f"command/{record.plan_id}", ReconfigureCommand(
                command_id=f"cmd-{record.plan_id}", plan_id=record.plan_id, plan=prop.plan)))
        elif record.status == PlanStatus.APPLIED:
            judged = verdict(state, record, verification)
            if judged is None:
                continue
            ok, measured, why = judged
            predicted = prop.predicted_tokens_per_s
            if ok or not can_roll_back(state, record):
                reason = why if ok else f"{why}; {KEPT_UNVERIFIED}"
                out.append((f"verified/{record.plan_id}", PlanVerified(
                    plan_id=record.plan_id, measured_tokens_per_s=measured, predicted_tokens_per_s=predicted,
                    reason=reason)))
            else:
                out.append((f"rolled_back/{record.plan_id}", PlanRolledBack(
                    plan_id=record.plan_id, measured_tokens_per_s=measured, predicted_tokens_per_s=predicted,
                    reason=f"below the predicted change: {why}")))
    return out
