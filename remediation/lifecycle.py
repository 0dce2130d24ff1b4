"""The remediation lifecycle as a fold over events (event sourcing: state = fold(events)).

    incident.opened/confirmed/updated/resolved → plan.proposed → plan.decision (operator or
    policy:auto) → command.reconfigure (epoch e+1) → command.ack → plan.verified | plan.rolled_back
    (a node plan: command.node once applied → command.node_ack)

:func:`step` applies one event to a :class:`LifecycleState` and does no I/O, so the same log
always folds to the same state. The plan half is collector/plan_lifecycle.py's fold and the
incident half collector/incident_lifecycle.py's, the ones every reader of those streams imports
(their states, records and reports are re-exported here); :class:`LifecycleState` extends both with
what the engine alone needs: the devices known dead, a version of the set of faults, the samples a
verification judges, the rendezvous round node agents run. Anything that must not take effect is
*reported*, never applied; events are deduplicated on their id. A node stop an agent acknowledges
``applied`` makes the ranks it stopped known dead (the layouts that used them cannot run again), and
a join acknowledged ``applied`` makes the ranks it started alive again, whoever ordered either.

:func:`reactions` is the other half: what the engine should publish given the state (auto
decisions, commands for approved plans, verification verdicts). It is pure too, and every
reaction has a deterministic event id, so publishing one twice is harmless.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from collector import incident_lifecycle, plan_lifecycle
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import (
    AckStatus, CostModelFitted, Envelope, ExecutorCapabilities, FaultCategory, IterationPrediction, IterationSummary,
    Location, NodeCommand, NodeCommandAck, NodeSpare, Payload, PlanCurrent, PlanProposed, PlanRolledBack, PlanVerified, PlanWithheld,
    PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import Plan
# the folds' names, re-exported: the engine's readers (resihp plans, the closed loop, the planner) import them from here
from collector.incident_lifecycle import IncidentLifecycle, IncidentRecord, IncidentStatus  # noqa: F401
from collector.plan_lifecycle import IN_FLIGHT, WAITING, PlanLifecycle, PlanRecord, PlanStatus, Report  # noqa: F401
from remediation.verification import Verification, verdict

_NAMESPACE = uuid.UUID("3b0d7c52-8f7e-4d3a-9c61-5a2e7f1b9d04")


_SEVERITY_ORDER = {s: i for i, s in enumerate([Severity.LOW, Severity.MEDIUM, Severity.HIGH, Severity.CRITICAL])}


@dataclass
class LifecycleState(PlanLifecycle, IncidentLifecycle):
    """The plan lifecycle's fold (running plan, plans, commands, policy, reports), the incidents'
    fold, and the engine's own state around them."""

    incident_version: int = 0  # bumps whenever the set of faults changes (a cue to re-plan)
    announced: dict[int, PlanCurrent] = field(default_factory=dict)  # epoch -> the trainer's plan.current
    cost_fits: dict[int, CostModelFitted] = field(default_factory=dict)  # epoch -> latest analytics.cost_model
    epoch_samples: dict[int, dict[int, tuple[int, float]]] = field(default_factory=dict)  # epoch -> it -> (tokens, s)
    # devices a fail-stop incident named, until a plan the trainer runs uses them again (repaired): a
    # fail-stop incident is *resolved* once the new plan leaves its device out, but the device stays dead
    known_dead: set[int] = field(default_factory=set)
    withheld: list[PlanWithheld] = field(default_factory=list)  # why the engine did not plan, in order
    capabilities: ExecutorCapabilities | None = None  # the executor's latest plan.capabilities (None: runs all)
    node_round: int | None = None  # the newest rendezvous round a node agent said it runs (command.node_ack)
    spares: dict[str, NodeSpare] = field(default_factory=dict)  # spare id -> its newest claim that it waits
    # rank -> when a spare's join took it over (the join ack's time): an incident opened before that
    # names the machine that left, not the one that runs the rank now
    replaced_at: dict[int, float] = field(default_factory=dict)
    node_replaced_at: dict[int, float] = field(default_factory=dict)  # node (group rank) -> the same, for node locations

    def current_incidents(self) -> list[IncidentRecord]:
        """The open incidents as they bear on the machines running now: a location on a rank a spare
        took over after the incident opened is dropped, and an incident left with none is not
        current (the detector resolves it once it measures the new machine healthy, or opens a new
        one if it is not)."""
        out = []
        for record in self.open_incidents():
            kept = [loc for loc in record.locations
                    if self.replaced_at.get(loc.rank if loc.rank is not None else -1, -math.inf) <= record.opened_at_s
                    and (loc.target != "node" or loc.node is None
                         or self.node_replaced_at.get(loc.node, -math.inf) <= record.opened_at_s)]
            if len(kept) == len(record.locations):
                out.append(record)
            elif kept:
                out.append(replace(record, locations=kept))
        return out

    def waiting_spares(self, run: str | None, ranks: int, now_s: float | None) -> list[str]:
        """The spares that wait for a place of ``ranks`` ranks in ``run`` and that no plan's join
        order has named yet, oldest claim first; a claim past its expiry (at ``now_s``) is stale."""
        named = {o.spare for r in self.plans.values() for o in r.proposal.node_orders if o.spare is not None}
        return [sid for sid, p in self.spares.items()
                if p.run == run and p.ranks == ranks and sid not in named
                and (now_s is None or p.expires_at_s is None or p.expires_at_s > now_s)]

    def plan_runs(self, plan: Plan) -> None:
        """``plan`` runs now: its devices are alive again, and plans left behind close."""
        super().plan_runs(plan)
        self.known_dead.difference_update(plan.devices)

    def plan_applied(self, record: PlanRecord) -> None:
        """Iterations of the new epoch folded before the ack (they travel on other topics, so a
        replay or a lagging control consumer can read them first) are this plan's samples too."""
        for iteration, sample in self.epoch_samples.get(record.epoch, {}).items():
            record.samples.setdefault(iteration, sample)

    def faults_changed(self, record: IncidentRecord) -> None:
        """The set of faults changed: a cue to re-plan; the devices an open fail-stop names are dead."""
        if record.is_open:
            _note_dead(self, record.category, record.locations)
        self.incident_version += 1

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


def step(state: LifecycleState, event: Envelope) -> LifecycleState:
    """Fold one event into ``state`` (updated in place and returned). Events of other jobs and
    events already seen are ignored."""
    if not plan_lifecycle.admit(state, event):
        return state
    p = event.payload
    handler = _HANDLERS.get(type(p))
    if handler is not None:
        handler(state, event, p)
    elif isinstance(p, incident_lifecycle.PAYLOADS):
        incident_lifecycle.transition(state, event)
    else:
        plan_lifecycle.transition(state, event)
    return state


def fold(events: list[Envelope] | tuple[Envelope, ...], state: LifecycleState | None = None) -> LifecycleState:
    state = state or initial_state()
    for e in events:
        step(state, e)
    return state


# ---- handlers ------------------------------------------------------------------------------------


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


def _plan_current(state: LifecycleState, e: Envelope, p: PlanCurrent) -> None:
    """The trainer's own word on what runs: authoritative for the running plan (it covers a start
    with no command, and an elastic restart the launcher did by itself)."""
    state.announced[p.plan.epoch] = p
    plan_lifecycle.transition(state, e)


def _capabilities(state: LifecycleState, e: Envelope, p: ExecutorCapabilities) -> None:
    """The executor's word on what it can run: the latest declaration holds (a restarted job with
    another executor declares again)."""
    state.capabilities = p


def _cost_model(state: LifecycleState, e: Envelope, p: CostModelFitted) -> None:
    old = state.cost_fits.get(p.epoch)
    if old is None or p.iteration >= old.iteration:
        state.cost_fits[p.epoch] = p


def _withheld(state: LifecycleState, e: Envelope, p: PlanWithheld) -> None:
    state.withheld.append(p)


def _node_ack(state: LifecycleState, e: Envelope, p: NodeCommandAck) -> None:
    """A node agent's answer: the round it runs, and the ranks a stop ended (known dead) or a
    join started (alive again). Then the plan fold keeps it on its node plan, if one ordered it."""
    state.node_round = max(state.node_round or 0, p.running_round)
    if p.status == AckStatus.APPLIED and p.action == "stop":
        state.known_dead.update(p.ranks)
        state.incident_version += 1  # the cluster changed: a cue to plan again
    elif p.status == AckStatus.APPLIED and p.action == "join":
        state.known_dead.difference_update(p.ranks)
        state.replaced_at.update({rank: e.time_s for rank in p.ranks})
        state.node_replaced_at[p.node] = e.time_s
        state.spares.pop(e.source, None)  # the spare that took the place waits no more
        state.incident_version += 1
    plan_lifecycle.transition(state, e)


def _spare(state: LifecycleState, e: Envelope, p: NodeSpare) -> None:
    """A spare agent's word that it waits for a place (kept, newest claim per spare) or no more."""
    if p.waiting:
        state.spares.pop(p.spare, None)  # re-inserted: the dict keeps claims in the order they came
        state.spares[p.spare] = p
    else:
        state.spares.pop(p.spare, None)


_HANDLERS: dict[type, Callable[[LifecycleState, Envelope, Any], None]] = {
    PlanCurrent: _plan_current, CostModelFitted: _cost_model, ExecutorCapabilities: _capabilities,
    IterationSummary: _summary, IterationPrediction: _prediction,
    PlanWithheld: _withheld, NodeCommandAck: _node_ack, NodeSpare: _spare,
}  # the plan lifecycle's and the incidents' events go to their folds' transitions


# ---- reactions -----------------------------------------------------------------------------------


def can_roll_back(state: LifecycleState, record: PlanRecord) -> bool:
    """Whether the layout ``record`` replaced could run again: known, and using no device known dead
    nor one of a node the plan ordered to stop (a plan that resumed a job hung on a dead device has
    nothing to roll back to: it is kept)."""
    previous = state.layouts.get(record.proposal.base_epoch)
    if record.proposal.current_tokens_per_s <= 0 or previous is None:
        return False
    # a node plan's stop, once ordered, takes the node's devices away whether or not its ack came yet
    stopping = {d for o in record.proposal.node_orders if o.action == "stop" and o.command_id in record.node_commands
                for d in o.devices}
    return not any(d in state.known_dead or d in stopping for d in previous.devices)


def auto_applies(state: LifecycleState, prop: PlanProposed) -> str | None:
    """Why the job's policy applies ``prop`` without an operator, or None when it does not: auto
    mode, the plan's severity in the policy's set, and, when the policy sets ``auto_min_p_real``,
    every incident the plan answers calibrated and at least that sure to be real (an incident the
    fold does not hold, or one with no calibrated p_real, is not). A severe plan on a doubtful
    incident waits for an operator: reshaping a job around a fault that is not there costs the
    reshape and the throughput of the device left out."""
    if state.policy_mode != PolicyMode.AUTO or prop.severity not in state.auto_severities:
        return None
    why = f"severity {prop.severity.value} is in the policy's auto set"
    bar = state.auto_min_p_real
    if bar is None:
        return why
    records = [state.incidents.get(i) for i in prop.incident_ids]
    if any(r is None or not r.calibrated or r.p_real < bar for r in records):
        return None
    least = min((r.p_real for r in records if r is not None), default=1.0)
    return f"{why}, and its incidents are real with p ≥ {least:.2f} (the policy's bar {bar:.2f})"


def reaction_id(job: str, what: str) -> str:
    """Deterministic event id of a reaction, so re-publishing it is deduplicated by every fold."""
    return uuid.uuid5(_NAMESPACE, f"{job}/{what}").hex


def reactions(state: LifecycleState, verification: Verification = Verification(),
              now_s: float | None = None) -> list[tuple[str, Payload]]:
    """(event id key, payload) the engine should publish now. A decision is bound to its proposal;
    a command names the run the executor announced and expires :data:`COMMAND_TTL_S` after
    ``now_s`` (the engine's clock: the time the command is issued; None: no expiry, which every
    executor refuses)."""
    out: list[tuple[str, Payload]] = []
    for record in state.plans.values():
        prop = record.proposal
        if record.status == PlanStatus.PROPOSED and (why := auto_applies(state, prop)) is not None:
            out.append((f"decision/{record.plan_id}", record.decision(approve=True, actor="policy:auto",
                                                                      comment=f"auto-applied: {why}")))
        elif record.status == PlanStatus.APPROVED and prop.base_epoch == state.running_epoch:
            out.append((f"command/{record.plan_id}", ReconfigureCommand(
                command_id=f"cmd-{record.plan_id}", plan_id=record.plan_id, plan=prop.plan, run=state.run,
                expires_at_s=None if now_s is None else now_s + COMMAND_TTL_S)))
        elif record.status == PlanStatus.COMMANDED:
            out += _node_orders(state, record, now_s, with_command=True)
        elif record.status == PlanStatus.APPLIED:
            out += _node_orders(state, record, now_s)
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
        elif record.status == PlanStatus.VERIFIED:
            out += _node_orders(state, record, now_s)
    return out


def _node_orders(state: LifecycleState, record: PlanRecord, now_s: float | None,
                 with_command: bool = False) -> list[tuple[str, Payload]]:
    """A node plan's orders not issued yet, once its layout runs: the node holds nothing of the
    plan then, so stopping it loses no work. ``with_command``: only the orders that go out with the
    plan's command (a job whose devices leave only with their node: its stop drains the node's
    ranks at a step boundary, and that is how the layout changes)."""
    return [(f"node/{order.command_id}", NodeCommand(
        command_id=order.command_id, node=order.node, action=order.action, round=order.round,
        reason=f"plan {record.plan_id}: {order.reason}"[:2000], run=order.run, spare=order.spare,
        expires_at_s=None if now_s is None else now_s + COMMAND_TTL_S))
        for order in record.proposal.node_orders if order.command_id not in record.node_commands
        and (order.with_command or not with_command)]
