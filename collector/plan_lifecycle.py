"""The plan lifecycle as one fold over contract events: every reader of the stream imports it.

    plan.proposed → plan.decision (an operator or policy:auto) → command.reconfigure (epoch e+1)
    → command.ack → plan.verified | plan.rolled_back, with plan.current and policy.changed;
    a node plan's command.node → command.node_ack once it is applied

:class:`PlanStatus` names the states once; :func:`claimed_status` says which state an event moves
its plan to; :func:`transition` applies one event to a :class:`PlanLifecycle` (no I/O), so the same
log folds to the same plans in the remediation engine, the console's read model, the demo's
watcher and the DuckDB ``plan_events`` rows. Each reader keeps only its own projection on top.

Anything that must not take effect is *reported*, never applied: a decision on a plan that is no
longer waiting (a decision applies once), a command for a plan nobody approved, a command whose
epoch is not the running epoch + 1 (stale or out of order), a duplicate command, an ack for a
command the fold has not accepted, a trainer's ``ignored_*`` acknowledgement. Events are
deduplicated on their id (:func:`admit`).

A node plan (a proposal with ``node_orders``) names the ids of the ``command.node`` orders it
issues; the fold keeps each such order and its agent's ``command.node_ack`` on the plan's record.
They move no status: the plan's state is its layout's (the node leaves once the layout runs
without it). A node command that no plan names (an operator's ``resihp node``) moves nothing; one a
plan names that arrives before the plan is applied is kept and reported.

A decision is bound to the proposal it answers (:func:`decision_refusal`): it names the
proposal's event id and the digest of its plan (:func:`plan_digest`), and applies only when both
match the live proposal of that plan id. A decision copied from another run, or written for an
earlier proposal that reused the id, is refused and reported. The run itself is the executor's
``plan.current`` ``run``: a new run of the job starts its epochs afresh, and what was planned for
the old one is superseded.

A control event that does not verify (collector/auth.py: unsigned, or signed by a role that may
not write its kind) is refused before it can move anything: kept in ``rejected`` with why, and
reported. Its id is not remembered as seen, so a forgery that copies the id of a real event the
engine will publish (reaction ids are deterministic) cannot shadow it.

The fold lives in collector/ because it reads nothing but the contract: analytics, which must not
import remediation, projects it as well as the engine does.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from collector.auth import Keyring, Refusals, load_keyring, needs_signature
from collector.epoch_fence import fence_verdict
from collector.events import (
    AckStatus, CommandAck, Envelope, NodeCommand, NodeCommandAck, PlanCurrent, PlanDecision, PlanProposed,
    PlanRolledBack, PlanVerified, PolicyChanged, PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import DEVICE_LISTS, Plan


class PlanStatus(StrEnum):
    """Where a plan stands. The values are what DuckDB rows, the demo and ``resihp plans`` show."""

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
REPORTS_KEPT = 1_000  # reports kept on the fold: a flood of refused events must not grow it


def plan_digest(plan: Plan) -> str:
    """SHA-256 (hex) of ``plan`` in canonical form: sorted compact JSON with devices as lists, so
    the digest is the same whichever wire form (lists or ranges) carried the plan."""
    body = plan.model_dump(mode="json", context={DEVICE_LISTS: True})
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def claimed_status(payload: object) -> PlanStatus | None:
    """The status an event moves its plan to when the fold accepts it; None for an event that moves
    no plan (an ``ignored_*`` ack, or an event of another stream)."""
    if isinstance(payload, PlanProposed):
        return PlanStatus.PROPOSED
    if isinstance(payload, PlanDecision):
        return PlanStatus.APPROVED if payload.approve else PlanStatus.REJECTED
    if isinstance(payload, ReconfigureCommand):
        return PlanStatus.COMMANDED
    if isinstance(payload, CommandAck):
        return {AckStatus.APPLIED: PlanStatus.APPLIED, AckStatus.FAILED: PlanStatus.FAILED}.get(payload.status)
    if isinstance(payload, PlanVerified):
        return PlanStatus.VERIFIED
    if isinstance(payload, PlanRolledBack):
        return PlanStatus.ROLLED_BACK
    return None


@dataclass
class PlanRecord:
    """One plan as the fold knows it. ``*_at_s`` are the times of the events that moved it."""

    plan_id: str
    proposal: PlanProposed
    status: PlanStatus = PlanStatus.PROPOSED
    proposal_id: str = ""  # the plan.proposed event's id: a decision names it
    proposed_at_s: float = 0.0
    decided_by: str | None = None
    decided_at_s: float | None = None
    comment: str = ""
    command_id: str | None = None
    ack: CommandAck | None = None
    applied_at_s: float | None = None
    # iteration -> (tokens, wall_s) of the plan's epoch while it runs: the "after" of its verification
    samples: dict[int, tuple[int, float]] = field(default_factory=dict)
    measured_tokens_per_s: float | None = None
    verdict: str = ""
    # a node plan's orders as issued (command id -> command.node) and the agents' answers (-> command.node_ack)
    node_commands: dict[str, NodeCommand] = field(default_factory=dict)
    node_acks: dict[str, NodeCommandAck] = field(default_factory=dict)

    @property
    def epoch(self) -> int:
        return self.proposal.plan.epoch

    def decision(self, *, approve: bool, actor: str, comment: str = "") -> PlanDecision:
        """A decision on this proposal, bound to it (its event id and plan digest)."""
        return PlanDecision(plan_id=self.plan_id, approve=approve, actor=actor, comment=comment,
                            proposal_id=self.proposal_id, plan_digest=plan_digest(self.proposal.plan))

    @property
    def trainer_could_not_apply(self) -> bool:
        """Failed on its merits: the trainer tried it and answered ``failed`` (a plan that went
        stale on the way failed too, but its layout may still be the right one)."""
        return self.status == PlanStatus.FAILED and self.ack is not None and self.ack.status == AckStatus.FAILED

    def node_order_state(self, command_id: str) -> str:
        """Where one of the plan's node orders stands: ``waiting`` (for the plan to be applied),
        ``commanded``, or the agent's ack status (``applied``, ``failed``, ``ignored_stale`` …)."""
        ack = self.node_acks.get(command_id)
        if ack is not None:
            return ack.status.value
        return "commanded" if command_id in self.node_commands else "waiting"


@dataclass(frozen=True)
class Report:
    """Something that was not applied, and why (stale, duplicate, unknown, refused)."""

    event_id: str
    kind: str
    message: str


@dataclass
class Admission:
    """What a fold of the log remembers to admit each event once, and only a verified one: the job
    it folds (``None``: every job's events together), the ids seen, the refusals, the reports.
    Every fold of a control stream (this one, collector/incident_lifecycle.py's) extends it, so one
    state can fold both streams and an event is admitted once for both."""

    job: str | None = None
    reports: deque[Report] = field(default_factory=lambda: deque(maxlen=REPORTS_KEPT))  # the newest, for logs and tests
    seen: set[str] = field(default_factory=set)
    keyring: Keyring | None = None  # None: the environment's (collector/auth.py's load_keyring)
    rejected: Refusals = field(default_factory=Refusals)  # refused event id -> why (the newest only)

    def report(self, event: Envelope, message: str) -> None:
        self.reports.append(Report(event.id, event.kind, message))


@dataclass
class PlanLifecycle(Admission):
    """The fold's state for one job (``job=None``: every job's events are folded together).

    Subclasses extend it (the engine adds incidents and samples) and may override
    :meth:`plan_runs` and :meth:`plan_applied`, the two points where a reader learns more."""

    run: str | None = None  # the run incarnation the executor announced last (plan.current's run)
    running_epoch: int = 0
    running_plan: Plan | None = None
    layouts: dict[int, Plan] = field(default_factory=dict)  # epoch -> the plan that ran (for roll-backs)
    plans: dict[str, PlanRecord] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)  # command_id -> plan_id
    node_orders: dict[str, str] = field(default_factory=dict)  # a node plan's command.node id -> plan_id
    policy_mode: PolicyMode = PolicyMode.PROPOSE
    auto_severities: list[Severity] = field(default_factory=list)
    auto_min_p_real: float | None = None  # the p_real every answered incident needs to auto-apply (None: no bar)

    def plan_runs(self, plan: Plan) -> None:
        """``plan`` runs now; plans left behind by the epoch change close."""
        self.running_epoch = plan.epoch
        self.running_plan = plan
        self.layouts[plan.epoch] = plan
        for other in self.plans.values():
            if other.status == PlanStatus.APPLIED and other.epoch < plan.epoch:
                other.status = PlanStatus.SUPERSEDED
                other.verdict = f"not verified: epoch {plan.epoch} replaced it first"
            elif other.status in WAITING and other.proposal.base_epoch < plan.epoch:
                other.status = PlanStatus.SUPERSEDED
                other.verdict = f"its base epoch {other.proposal.base_epoch} no longer runs (epoch {plan.epoch} does)"

    def plan_applied(self, record: PlanRecord) -> None:
        """The trainer acknowledged ``record`` as applied (after :meth:`plan_runs`)."""


def admit(state: Admission, event: Envelope) -> bool:
    """Whether ``event`` is new to ``state``, of its job and, for a control event, signed by a role
    that may write it; remembers its id. A refused event is reported once and never remembered."""
    if state.job is not None and event.job != state.job:
        return False
    signed = needs_signature(event.kind)
    # unsigned kinds keep their ids apart, so an unsigned event cannot take a control event's id
    key = event.id if signed else "u:" + event.id
    if key in state.seen:
        return False
    if signed:
        reason = (state.keyring or load_keyring()).verify(event)
        if reason is not None:
            if state.rejected.remember(event.id, reason):
                state.report(event, f"not authenticated, ignored: {reason}")
            return False
    state.seen.add(key)
    return True


def transition(state: PlanLifecycle, event: Envelope) -> PlanRecord | None:
    """Apply one admitted event. Returns the plan whose status it changed (None: it changed none —
    reported, another stream's event, or one that changes no status, such as policy.changed)."""
    handler = _HANDLERS.get(type(event.payload))
    return handler(state, event, event.payload) if handler is not None else None


def step(state: PlanLifecycle, event: Envelope) -> PlanRecord | None:
    """:func:`admit` then :func:`transition`."""
    return transition(state, event) if admit(state, event) else None


def fold(events: list[Envelope] | tuple[Envelope, ...], state: PlanLifecycle | None = None) -> PlanLifecycle:
    state = state if state is not None else PlanLifecycle()
    for e in events:
        step(state, e)
    return state


# ---- transitions ---------------------------------------------------------------------------------


def _proposed(state: PlanLifecycle, e: Envelope, p: PlanProposed) -> PlanRecord | None:
    if p.plan_id in state.plans:
        state.report(e, f"plan {p.plan_id} proposed twice; kept the first")
        return None
    record = PlanRecord(p.plan_id, p, proposed_at_s=e.time_s, proposal_id=e.id)
    state.plans[p.plan_id] = record
    for order in p.node_orders:
        state.node_orders.setdefault(order.command_id, p.plan_id)
    if p.base_epoch != state.running_epoch:
        record.status = PlanStatus.SUPERSEDED
        state.report(e, f"plan {p.plan_id} is based on epoch {p.base_epoch} but epoch {state.running_epoch} runs; "
                        "superseded on arrival")
        return record
    for other in state.plans.values():
        if other is not record and other.status == PlanStatus.PROPOSED and supersedes(p, other.proposal.base_epoch):
            other.status = PlanStatus.SUPERSEDED
            other.verdict = f"superseded by {p.plan_id}"
    return record


def supersedes(proposal: PlanProposed, waiting_base_epoch: int) -> bool:
    """Whether ``proposal`` supersedes a plan still waiting for its decision that was based on
    ``waiting_base_epoch``: a newer proposal from the same running layout replaces it, since only one
    plan can move the job off a layout. (A plan whose base stops running is superseded by
    :meth:`PlanLifecycle.plan_runs`.) Goodput's wait for approval reads this rule too."""
    return proposal.base_epoch == waiting_base_epoch


def decision_refusal(state: PlanLifecycle, p: PlanDecision) -> str | None:
    """Why ``p`` does not answer the live proposal of its plan id (None: it does, or no such plan is
    known, which the fold reports as unknown). A reader that publishes refusals reports this one as
    ``control.rejected``: a signed decision that names another proposal is a replay or a mistake."""
    record = state.plans.get(p.plan_id)
    if record is None:
        return None
    if p.proposal_id is None or p.plan_digest is None:
        return (f"decision by {p.actor} on plan {p.plan_id} names no proposal (schema 1: no proposal_id and "
                "plan_digest); it cannot be told from a replay of another run's decision: decide again")
    if p.proposal_id != record.proposal_id:
        return (f"decision by {p.actor} on plan {p.plan_id} answers proposal {p.proposal_id}, not the live one "
                f"{record.proposal_id}: a decision from another run or an earlier proposal; decide again")
    if p.plan_digest != plan_digest(record.proposal.plan):
        return (f"decision by {p.actor} on plan {p.plan_id} approves a plan whose digest {p.plan_digest[:12]}… is not "
                f"the proposed plan's: the plan changed since it was decided; decide again")
    return None


def _decision(state: PlanLifecycle, e: Envelope, p: PlanDecision) -> PlanRecord | None:
    record = state.plans.get(p.plan_id)
    if record is None:
        state.report(e, f"decision by {p.actor} on unknown plan {p.plan_id}; ignored")
        return None
    refusal = decision_refusal(state, p)
    if refusal is not None:
        state.rejected.remember(e.id, refusal)
        state.report(e, f"refused: {refusal}")
        return None
    if record.status != PlanStatus.PROPOSED:
        state.report(e, f"decision by {p.actor} on plan {p.plan_id}, which is already {record.status.value}"
                        f"{' by ' + record.decided_by if record.decided_by else ''}; ignored (a decision applies once)")
        return None
    record.status = claimed_status(p) or record.status  # a decision always claims approved or rejected
    record.decided_by, record.decided_at_s, record.comment = p.actor, e.time_s, p.comment
    return record


def _policy(state: PlanLifecycle, e: Envelope, p: PolicyChanged) -> None:
    state.policy_mode = p.mode
    state.auto_severities = list(p.auto_severities)
    state.auto_min_p_real = p.auto_min_p_real


def _command(state: PlanLifecycle, e: Envelope, p: ReconfigureCommand) -> PlanRecord | None:
    """A command moves its plan only where an executor would obey it (collector/epoch_fence.py's
    ``fence_verdict``: each id once, epoch e+1 on top of e), and only for an approved plan."""
    record = state.plans.get(p.plan_id)
    fenced, why = fence_verdict(p, state.running_epoch, state.commands)
    if fenced == AckStatus.IGNORED_DUPLICATE:
        state.report(e, f"duplicate command {p.command_id} for plan {p.plan_id}; ignored")
        return None
    if record is None or record.status != PlanStatus.APPROVED:
        status = "unknown" if record is None else record.status.value
        state.report(e, f"command {p.command_id} for plan {p.plan_id} ({status}, not approved); ignored")
        return None
    if fenced is not None:
        state.report(e, f"stale command {p.command_id}: {why}; ignored")
        return None
    state.commands[p.command_id] = p.plan_id
    record.status = PlanStatus.COMMANDED
    record.command_id = p.command_id
    return record


def _ack(state: PlanLifecycle, e: Envelope, p: CommandAck) -> PlanRecord | None:
    plan_id = state.commands.get(p.command_id)
    record = state.plans.get(plan_id) if plan_id else None
    if record is None:
        state.report(e, f"ack for unknown command {p.command_id}")
        return None
    if p.status == AckStatus.APPLIED:
        if record.status != PlanStatus.COMMANDED:
            state.report(e, f"second 'applied' ack for command {p.command_id}; ignored")
            return None
        record.status, record.ack, record.applied_at_s = PlanStatus.APPLIED, p, e.time_s
        state.plan_runs(record.proposal.plan)
        state.running_epoch = p.running_epoch
        state.plan_applied(record)
        return record
    if p.status == AckStatus.FAILED:
        record.status, record.ack = PlanStatus.FAILED, p
        record.verdict = f"trainer failed to apply: {p.detail}"
        return record
    state.report(e, f"trainer {p.status.value.replace('_', ' ')} command {p.command_id} "
                    f"(asked epoch {p.epoch}, runs {p.running_epoch}): {p.detail}")
    if p.status == AckStatus.IGNORED_STALE and record.status == PlanStatus.COMMANDED:
        # Never to apply: the trainer moved past the epoch it asked for. That includes a plan
        # commanded for the same epoch as another the trainer applied first (a roll-back and a
        # new plan both decided at epoch 2, both asking for 3): left commanded, it held the
        # engine's next plan back for good, a fail-stop's included.
        record.status = PlanStatus.FAILED
        record.verdict = f"trainer runs epoch {p.running_epoch}; command was stale"
        return record
    return None


def _node_command(state: PlanLifecycle, e: Envelope, p: NodeCommand) -> PlanRecord | None:
    """A node plan's order, kept on its record (the agent fences it by round and id, not the fold).
    An order no plan names is an operator's: no plan moves."""
    record = state.plans.get(state.node_orders.get(p.command_id, ""))
    if record is None:
        return None
    if p.command_id in record.node_commands:
        state.report(e, f"duplicate node command {p.command_id} for plan {record.plan_id}; ignored")
        return None
    early = any(o.with_command for o in record.proposal.node_orders if o.command_id == p.command_id)
    allowed = (PlanStatus.APPLIED, PlanStatus.VERIFIED, PlanStatus.ROLLED_BACK) + ((PlanStatus.COMMANDED,) if early else ())
    if record.status not in allowed:
        state.report(e, f"node command {p.command_id} of plan {record.plan_id}, which is {record.status.value}: "
                        "a node plan orders its nodes once its layout is applied (with its command when the job's "
                        "devices leave only with their node)")
    record.node_commands[p.command_id] = p
    return record


def _node_ack(state: PlanLifecycle, e: Envelope, p: NodeCommandAck) -> PlanRecord | None:
    """An agent's answer to a node plan's order, kept on the plan's record (the first answer
    counts; a duplicate's ``ignored_duplicate`` does not replace it)."""
    record = state.plans.get(state.node_orders.get(p.command_id, ""))
    if record is None:
        return None
    if p.command_id in record.node_acks:
        state.report(e, f"second answer to node command {p.command_id} ({p.status.value}); kept the first")
        return None
    record.node_acks[p.command_id] = p
    return record


def _verdict(state: PlanLifecycle, e: Envelope, p: PlanVerified | PlanRolledBack) -> PlanRecord | None:
    """The last word on an applied plan: kept (verified) or rolled back, with the throughput
    measured after it. A verdict on a plan that is not applied is reported and ignored."""
    verified = isinstance(p, PlanVerified)
    record = state.plans.get(p.plan_id)
    if record is None or record.status != PlanStatus.APPLIED:
        state.report(e, f"{'verification' if verified else 'roll-back'} of plan {p.plan_id} that is not applied; "
                        "ignored")
        return None
    record.status = PlanStatus.VERIFIED if verified else PlanStatus.ROLLED_BACK
    record.measured_tokens_per_s = p.measured_tokens_per_s
    if isinstance(p, PlanRolledBack):
        record.verdict = p.reason
    return record


def _plan_current(state: PlanLifecycle, e: Envelope, p: PlanCurrent) -> None:
    """The trainer's own word on what runs: authoritative for the running plan (it covers a start
    with no command, and an elastic restart the launcher did by itself). A plan.current of another
    run than the one announced before starts the job afresh: its epochs count from its own start,
    and every plan of the old run still waiting or in flight is superseded (its commands name the
    old run, which no executor obeys now)."""
    if p.run is not None and state.run is not None and p.run != state.run:
        for other in state.plans.values():
            if other.status in WAITING or other.status in IN_FLIGHT:
                other.status = PlanStatus.SUPERSEDED
                other.verdict = f"run {state.run} ended: run {p.run} started"
        state.run = p.run
        state.running_epoch = p.plan.epoch
        state.layouts = {}
        state.plan_runs(p.plan)
        return
    if p.run is not None:
        state.run = p.run
    if p.plan.epoch >= state.running_epoch:
        state.plan_runs(p.plan)
    else:
        state.report(e, f"plan.current for epoch {p.plan.epoch} arrived after epoch {state.running_epoch}; kept")


_HANDLERS: dict[type, Callable[[PlanLifecycle, Envelope, Any], PlanRecord | None]] = {
    PlanProposed: _proposed, PlanDecision: _decision, PolicyChanged: _policy, ReconfigureCommand: _command,
    CommandAck: _ack, PlanVerified: _verdict, PlanRolledBack: _verdict, PlanCurrent: _plan_current,
    NodeCommand: _node_command, NodeCommandAck: _node_ack,
}
