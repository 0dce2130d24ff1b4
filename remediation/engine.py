"""The remediation engine: fold the log, plan when the faults change, publish what follows.

It reads the analytics topic (incidents, and per-iteration observations for verification), the
control topic (its own and everyone's lifecycle events) and, with ``verify_from_telemetry``, the
telemetry topic (``telemetry.summary``), always from the beginning: the state is a fold, so a
restarted engine rebuilds it by replaying and re-derives the same reactions, whose deterministic
event ids make any re-publication a no-op for every reader.

Planning happens when the set of open incidents changed since the last plan, no plan is in
flight and no probe's answer is due (remediation.planning_view); the proposal's id is derived
from (base epoch, incident version) so two engines — or one restarted — propose the same plan
id. The id also carries the run incarnation the executor announced (``-r`` and its first 8 hex
digits), so a decision written in another run of the same job name never names a plan of this one;
and a decision applies only when it names the live proposal's event id and plan digest
(collector/plan_lifecycle.py), else it is refused and published as ``control.rejected``. A plan
whose verification fails is rolled back by proposing the previous layout (when none of its
devices is known dead), through the same approval path.

What it plans with: the running plan is the trainer's latest ``plan.current`` (or, before one
arrives, the plan it was started with); the cost figures are built from the analytics consumer's
latest ``analytics.cost_model`` fits of the running epoch's stages (remediation.cost_figures) with
the mean tokens per micro-batch measured from ``analytics.prediction``; until fits arrive (or
when they cannot describe the model) it uses the model it was started with.
It searches only what the job's executor declared it can run (``plan.capabilities``,
remediation.capability_fit) and names in each proposal what it left out and why (``not_offered``);
a strategy that returns a plan the executor cannot run anyway is withheld with the reason.
When the incidents blame a whole node and ``nodes.run`` names the job's rendezvous id, it may
propose a node plan (remediation/node_plans.py): the layout without the node, and the node's stop,
issued as ``command.node`` once the layout is applied; an agent's answer that is not ``applied`` is
published as ``plan.withheld``.

The engine is three parts: this loop (read, gate, fold, react until quiet), its planning
(remediation/engine_planning.py: when to plan, around what, with which cost figures) and its output
(remediation/engine_output.py: the clock, signing and stamping reactions, the refusals).

What it trusts: control events pass its gate (collector/auth.py) before the fold sees them —
incidents and cost models signed by analytics, decisions and policies by the console (or its own
policy:auto decisions), plans and commands by itself. A refused event changes nothing and is
published as ``control.rejected``, once per event id; its own reactions are signed as the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from collector import topics
from collector.auth import Gate, Keyring, Signer, load_keyring
from collector.bus import Bus, TopicPartition
from collector.events import (
    AckStatus, CommandAck, Envelope, EventFactory, IterationSummary, NodeCommandAck, PlanDecision, PlanRolledBack,
    PlanVerified,
)
from collector.plan import Plan
from collector.plan_lifecycle import decision_refusal
from collector.stream import EventStream
from remediation.baselines import Strategy
from remediation.candidates import PlannerOptions
from remediation.cluster import ClusterState, Hardware
from remediation.engine_output import EngineClock, EngineOutput
from remediation.engine_planning import EnginePlanning
from remediation.horizon import HorizonEstimator
from remediation.lifecycle import KEPT_UNVERIFIED, LifecycleState, Verification, initial_state, reactions, step
from remediation.model import PlannerModel
from remediation.node_plans import NodeSettings
from remediation.planning_view import PlanningView

log = logging.getLogger("resihp.remediation")


@dataclass
class EngineConfig:
    job: str
    num_devices: int | None = None  # None: the running plan's highest device id + 1, rounded up to whole nodes
    hardware: Hardware = field(default_factory=Hardware)
    options: PlannerOptions = field(default_factory=PlannerOptions)
    verification: Verification = field(default_factory=Verification)
    min_gain_fraction: float = 0.02  # propose only if the plan trains this much more over the horizon
    verify_from_telemetry: bool = False
    group: str = "remediation"
    strategy: str = "ours"  # rebuilt with fresh cost figures when fits arrive (unless a Strategy is given)
    mean_document_tokens: float = 1024.0  # for Σlᵢ² when only fits are known (see cost_figures)
    localisation_wait_s: float = 30.0  # how long a TP-group-level fail-slow waits to be narrowed to a rank
    # The engine's clock is the newest *signed* event time it read (so a replay decides as the run did),
    # never more than this past the host's wall clock: a signer whose clock runs ahead cannot skip waits.
    clock_skew_s: float = 300.0
    nodes: NodeSettings = field(default_factory=NodeSettings)  # node plans: off until the job's rendezvous id is given


class RemediationEngine:
    """One job's engine over a bus. ``poll_once`` is one step of the loop (tests drive it)."""

    def __init__(self, bus: Bus, config: EngineConfig, model: PlannerModel | None = None,
                 initial_plan: Plan | None = None, strategy: Strategy | None = None,
                 keyring: Keyring | None = None) -> None:
        self.bus = bus
        self.config = config
        self.keyring = keyring or load_keyring()
        self.state: LifecycleState = initial_state(config.job, initial_plan)
        self.state.keyring = self.keyring
        self.gate = Gate("remediation", self.keyring)
        self.clock = EngineClock(config.clock_skew_s)
        self.output = EngineOutput(config.job, Signer(EventFactory(config.job, "remediation"), "engine", self.keyring),
                                   self.clock, self.state)
        self.planning = EnginePlanning(config, self.state, self.clock, self.output, model, initial_plan, strategy)
        wanted = [topics.ANALYTICS, topics.CONTROL] + ([topics.TELEMETRY] if config.verify_from_telemetry else [])
        self.stream = EventStream(bus, config.group, wanted, on_assign=self._from_start, job=config.job)

    @staticmethod
    def _from_start(parts: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 0 for tp in parts}

    # ---- what the parts know, for operators and tests ------------------------------------------

    @property
    def clock_s(self) -> float:
        """The newest signed event time the engine has read (-inf before the first)."""
        return self.clock.signed_s

    @property
    def refusals(self) -> list[str]:
        """Why something could not be planned, in order."""
        return self.output.refusals

    @property
    def waiting(self) -> dict[str, str]:
        """Incident id -> why the planner leaves it out for now."""
        return self.planning.waiting

    @property
    def model(self) -> PlannerModel | None:
        """The cost figures the engine plans with now."""
        return self.planning.model

    @property
    def horizon(self) -> HorizonEstimator:
        return self.planning.horizon

    def view(self) -> PlanningView:
        return self.planning.view()

    def cluster(self, view: PlanningView | None = None) -> ClusterState:
        return self.planning.cluster(view)

    # ---- the loop -------------------------------------------------------------------------------

    def poll_once(self, timeout_s: float = 0.2) -> int:
        """Read what is new, fold it, react; returns how many events were read."""
        deliveries = self.stream.poll(timeout_s=timeout_s)
        for d in deliveries:
            self._fold(d.event)
        self._react_until_quiet()
        if deliveries:
            self.stream.commit()
        return len(deliveries)

    def _fold(self, event: Envelope) -> None:
        """Gate one event, move the clock, fold it, and tell planning what it learns."""
        self.gate.note(event)
        if not self.gate.admit(event, time_s=self.clock.signed):
            return  # refused before its time can move the engine's clock
        self.clock.advance(event)
        if isinstance(event.payload, PlanDecision):
            refusal = decision_refusal(self.state, event.payload)
            if refusal is not None:  # the fold ignores it too; the bus hears why
                self.gate.refuse(event, refusal, time_s=self.clock.signed)
        version = self.state.incident_version
        if self.config.verify_from_telemetry or not isinstance(event.payload, IterationSummary):
            step(self.state, event)
        self.planning.observe(event, faults_changed=self.state.incident_version != version)
        p = event.payload
        if isinstance(p, CommandAck):
            log.info("remediation job=%s: trainer %s %s as epoch %s (%s)", self.config.job, p.status.value,
                     p.plan_id, p.epoch, p.detail)
        elif isinstance(p, NodeCommandAck):
            log.info("remediation job=%s: node %s %s %s in round %s (%s)", self.config.job, p.node, p.status.value,
                     p.command_id, p.running_round, p.detail)
            plan_id = self.state.node_orders.get(p.command_id)
            if plan_id is not None and p.status != AckStatus.APPLIED:
                self.output.refuse(f"plan {plan_id}'s {p.action} of node {p.node} was not obeyed ({p.status.value}: "
                                   f"{p.detail}); the plan's layout runs without the node's devices, which stay idle",
                                   key=f"node-ack/{p.command_id}")

    def _react_until_quiet(self) -> None:
        """React until quiet: a proposal under the auto policy is decided, and a decision commanded,
        in this same call rather than one poll apart (a trainer hung on a dead rank waits for it).
        Every reaction's id is deterministic and folded at once, so no reaction repeats."""
        rejected = self.gate.take()
        if rejected:
            self.bus.publish(rejected)
        out = self._react()
        while out:
            self.bus.publish(out)
            for e in out:  # fold our own output at once; reading it back later is deduplicated
                self.output.logged(e)
                step(self.state, e)
            out = self._react()

    def run(self, idle_exit_s: float | None = None) -> None:
        idle_since = time.monotonic()
        while True:
            if self.poll_once(timeout_s=0.5):
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                return

    def close(self) -> None:
        self.stream.close()

    def _react(self) -> list[Envelope]:
        """What the fold says to publish now (decisions, commands, verdicts), a roll-back proposal
        for each plan rolled back, a new proposal when planning finds one, and the refusals."""
        issued_s = self.clock.read if self.clock.read is not None else time.time()  # as EngineOutput.make stamps it
        out = [self.output.make(key, payload)
               for key, payload in reactions(self.state, self.config.verification, issued_s)]
        for e in out:
            p = e.payload
            reason = (p.reason or "") if isinstance(p, PlanVerified) else ""
            if isinstance(p, PlanVerified) and reason.endswith(KEPT_UNVERIFIED) and e.id not in self.state.seen:
                why = reason.removesuffix(KEPT_UNVERIFIED).rstrip("; ")
                self.output.refuse(f"plan {p.plan_id} fell short ({why}) but is kept: the layout before it "
                                   "cannot run again (it used a dead device)", key=f"kept/{p.plan_id}")
        for e in out:
            if isinstance(e.payload, PlanRolledBack):
                try:
                    rollback = self.planning.rollback_proposal(e.payload.plan_id)
                except Exception as exc:  # a failed roll-back plan must not stop the engine
                    log.exception("remediation job=%s: no roll-back proposal for %s", self.config.job, e.payload.plan_id)
                    self.output.refuse(f"no roll-back proposal for {e.payload.plan_id}: {exc!r}")
                    rollback = None
                if rollback is not None:
                    out.append(rollback)
        proposal = self.planning.maybe_plan()
        if proposal is not None:
            out.append(proposal)
        out += self.output.take_withheld()
        return [e for e in out if e.id not in self.state.seen]
