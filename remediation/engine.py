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

What it trusts: control events pass its gate (collector/auth.py) before the fold sees them —
incidents and cost models signed by analytics, decisions and policies by the console (or its own
policy:auto decisions), plans and commands by itself. A refused event changes nothing and is
published as ``control.rejected``, once per event id; its own reactions are signed as the engine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from collector import topics
from collector.auth import Gate, Keyring, Signer, load_keyring, needs_signature
from collector.bus import Bus, TopicPartition
from collector.capabilities import capability_refusal
from collector.events import (
    CommandAck, Envelope, EventFactory, FaultCategory, IncidentOpened, IterationPrediction, IterationSummary, Location,
    PlanDecision, PlanProposed, PlanRolledBack, PlanVerified, PlanWithheld, ReconfigureCommand,
)
from collector.plan import Plan
from collector.plan_lifecycle import decision_refusal
from collector.stream import EventStream
from remediation.baselines import PlannerStrategy, Strategy, make_strategy
from remediation.candidates import PlannerOptions
from remediation.capability_fit import fit_options
from remediation.cluster import ClusterState, DeviceState, Hardware, cluster_from_incidents
from remediation.cost_figures import calibrate_spread, model_from_fits
from remediation.costs import compute_factor_of
from remediation.horizon import HorizonEstimator
from remediation.lifecycle import (
    KEPT_UNVERIFIED, LifecycleState, PlanStatus, Verification, initial_state, reaction_id, reactions, step,
)
from remediation.model import PlannerModel
from remediation.plan_result import PlanRefused
from remediation.throughput import predict_tokens_per_s
from remediation.planning_view import PlanningView, planning_view

OBSERVED_WINDOW = 4096  # healthy iterations per epoch the spread and the tail are fitted on
SPREAD_MIN_ITERATIONS = 100  # fewer healthy iterations of an epoch than this: carry an earlier epoch's spread

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


class RemediationEngine:
    """One job's engine over a bus. ``poll_once`` is one step of the loop (tests drive it)."""

    def __init__(self, bus: Bus, config: EngineConfig, model: PlannerModel | None = None,
                 initial_plan: Plan | None = None, strategy: Strategy | None = None,
                 keyring: Keyring | None = None) -> None:
        self.bus = bus
        self.config = config
        self.fallback_model = model
        self.model = model
        self._fixed_strategy = strategy
        self.strategy: Strategy | None = strategy  # built over the freshest cost figures when first needed
        self._model_key: tuple | None = None
        self._tokens_per_mb: dict[int, tuple[float, int]] = {}  # epoch -> (sum of per-mb tokens, count)
        # epoch -> (iteration, observed seconds) of its latest iterations while no incident was open,
        # for the replicas' spread and the stalls' tail
        self._observed_s: dict[int, deque[tuple[int, float]]] = {}
        self.horizon = HorizonEstimator(default_s=config.options.horizon_s)
        self._faults: frozenset[str] = frozenset()  # open incident ids when the horizon last saw a change
        self.initial_plan = initial_plan
        self.keyring = keyring or load_keyring()
        self.state: LifecycleState = initial_state(config.job, initial_plan)
        self.state.keyring = self.keyring
        self.factory = Signer(EventFactory(config.job, "remediation"), "engine", self.keyring)
        self.gate = Gate("remediation", self.keyring)
        self._planned_key: tuple = (0, (), 0)
        self._clock_s = float("-inf")  # the newest signed event time read: the engine's clock (_advance_clock)
        self._read_clock_s = float("-inf")  # the newest event time read, signed or not (_advance_clock)
        self.refusals: list[str] = []  # why something could not be planned, in order (also logged)
        self._reported: set[str] = set()
        self._withheld: list[Envelope] = []  # plan.withheld events due with the next reactions
        self.waiting: dict[str, str] = {}  # incident id -> why the planner leaves it out for now
        wanted = [topics.ANALYTICS, topics.CONTROL] + ([topics.TELEMETRY] if config.verify_from_telemetry else [])
        self.stream = EventStream(bus, config.group, wanted, on_assign=self._from_start, job=config.job)

    @staticmethod
    def _from_start(parts: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 0 for tp in parts}

    # ---- the loop -------------------------------------------------------------------------------

    def poll_once(self, timeout_s: float = 0.2) -> int:
        """Read what is new, fold it, react; returns how many events were read."""
        deliveries = self.stream.poll(timeout_s=timeout_s)
        for d in deliveries:
            self.gate.note(d.event)
            if not self.gate.admit(d.event, time_s=self._clock_s if self._clock_s != float("-inf") else None):
                continue  # refused before its time can move the engine's clock
            self._advance_clock(d.event)
            if isinstance(d.event.payload, PlanDecision):
                refusal = decision_refusal(self.state, d.event.payload)
                if refusal is not None:  # the fold ignores it too; the bus hears why
                    self.gate.refuse(d.event, refusal, time_s=self._clock_s if self._clock_s != float("-inf") else None)
            version = self.state.incident_version
            if self.config.verify_from_telemetry or not isinstance(d.event.payload, IterationSummary):
                step(self.state, d.event)
            if self.state.incident_version != version:
                faults = frozenset(i.incident_id for i in self.state.open_incidents())
                if faults != self._faults:  # a fault came or went; a confirmation or update is the same fault
                    self._faults = faults
                    self.horizon.change(d.event.time_s)
            p = d.event.payload
            if isinstance(p, IterationPrediction) and p.tokens > 0 and self.state.running_plan is not None:
                total, n = self._tokens_per_mb.get(p.epoch, (0.0, 0))
                plan = self._epoch_plan(p.epoch) or self.state.running_plan
                self._tokens_per_mb[p.epoch] = (total + p.tokens / plan.global_microbatches, n + 1)
                if not self.state.open_incidents():  # a slow replica's times would pass for spread
                    self._observed_s.setdefault(p.epoch, deque(maxlen=OBSERVED_WINDOW)).append((p.iteration, p.observed_s))
            elif isinstance(p, CommandAck):
                log.info("remediation job=%s: trainer %s %s as epoch %s (%s)", self.config.job, p.status.value,
                         p.plan_id, p.epoch, p.detail)
            elif isinstance(p, IncidentOpened):  # iterations from its detection on may have reached us first
                observed = self._observed_s.get(self.state.running_epoch)
                while observed and observed[-1][0] >= p.iteration:
                    observed.pop()
        # React until quiet: a proposal under the auto policy is decided, and a decision commanded,
        # in this same call rather than one poll apart (a trainer hung on a dead rank waits for it).
        # Every reaction's id is deterministic and folded at once, so no reaction repeats.
        rejected = self.gate.take()
        if rejected:
            self.bus.publish(rejected)
        out = self._react()
        while out:
            self.bus.publish(out)
            for e in out:  # fold our own output at once; reading it back later is deduplicated
                if not isinstance(e.payload, PlanWithheld):  # refusals are logged where they are made
                    log.info("remediation job=%s epoch=%s: %s", self.config.job, self.state.running_epoch, _said(e))
                step(self.state, e)
            out = self._react()
        if deliveries:
            self.stream.commit()
        return len(deliveries)

    @property
    def clock_s(self) -> float:
        """The newest signed event time the engine has read (-inf before the first)."""
        return self._clock_s

    def _advance_clock(self, event: Envelope) -> None:
        """Move the clock to a verified control event's time, at most ``clock_skew_s`` past this
        host's wall clock. Unsigned events (telemetry, predictions) are anyone's: one stamped a year
        ahead would otherwise end every wait (for a location, for a probe's answer) from then on.

        Every event, signed or not, moves the read clock, clamped the same way and never behind the
        clock: it measures how long the job has gone without a change (the horizon: whether a
        reshape pays) and stamps reactions, so a command issued after a long calm is not born
        expired on the executors' clocks. An unsigned writer moves it at most ``clock_skew_s`` past
        the wall clock."""
        time_s = min(event.time_s, time.time() + self.config.clock_skew_s)
        if needs_signature(event.kind):  # admitted, so its signature verified
            self._clock_s = max(self._clock_s, time_s)
        self._read_clock_s = max(self._read_clock_s, self._clock_s, time_s)

    def run(self, idle_exit_s: float | None = None) -> None:
        idle_since = time.monotonic()
        while True:
            if self.poll_once(timeout_s=0.5):
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                return

    def close(self) -> None:
        self.stream.close()

    # ---- reactions ------------------------------------------------------------------------------

    def _make(self, key: str, payload) -> Envelope:
        """A reaction, stamped with the engine's read clock (the newest event time it read): a reaction
        happens at the time of what caused it, so a replay re-derives the same event, and a job on
        a simulated clock gets reactions on that clock, not the wall's."""
        time_s = self._read_clock_s if self._read_clock_s != float("-inf") else None
        return self.factory.make(payload, event_id=reaction_id(self.config.job, key), time_s=time_s)

    def _react(self) -> list[Envelope]:
        issued_s = self._read_clock_s if self._read_clock_s != float("-inf") else time.time()  # as _make stamps it
        out = [self._make(key, payload)
               for key, payload in reactions(self.state, self.config.verification, issued_s)]
        for e in out:
            p = e.payload
            reason = (p.reason or "") if isinstance(p, PlanVerified) else ""
            if isinstance(p, PlanVerified) and reason.endswith(KEPT_UNVERIFIED) and e.id not in self.state.seen:
                why = reason.removesuffix(KEPT_UNVERIFIED).rstrip("; ")
                self._refuse(f"plan {p.plan_id} fell short ({why}) but is kept: the layout before it "
                             "cannot run again (it used a dead device)", key=f"kept/{p.plan_id}")
        for e in out:
            if isinstance(e.payload, PlanRolledBack):
                try:
                    rollback = self._rollback_proposal(e.payload.plan_id)
                except Exception as exc:  # noqa: BLE001 - a failed roll-back plan must not stop the engine
                    log.exception("remediation job=%s: no roll-back proposal for %s", self.config.job, e.payload.plan_id)
                    self._refuse(f"no roll-back proposal for {e.payload.plan_id}: {exc!r}")
                    rollback = None
                if rollback is not None:
                    out.append(rollback)
        proposal = self._maybe_plan()
        if proposal is not None:
            out.append(proposal)
        out += self._withheld
        self._withheld = []
        return [e for e in out if e.id not in self.state.seen]

    def num_devices(self) -> int:
        n = self.config.num_devices
        if n is None:
            plan = self.state.running_plan
            per = self.config.hardware.devices_per_node
            n = -(-(max(plan.devices) + 1) // per) * per if plan is not None else 0
        return n

    def view(self) -> PlanningView:
        """Which open incidents can be planned around now (remediation.planning_view)."""
        return planning_view(self.state.open_incidents(), self._clock_s, self.config.localisation_wait_s)

    def cluster(self, view: PlanningView | None = None) -> ClusterState:
        """The cluster implied by the open incidents the planner can locate; locations it cannot
        apply (a device outside the cluster) are reported and left out."""
        view = view or self.view()
        skipped: list[tuple[Location, str]] = []
        cluster = cluster_from_incidents(self.num_devices(), view.incidents, self.config.hardware, skipped)
        for loc, reason in skipped:
            self._refuse(f"location {loc.model_dump(exclude_defaults=True)} left out: {reason}")
        # A fail-stop's incident is resolved once a plan leaves its device out, but the device is
        # still dead until a running plan uses it again (the fold's known_dead): never plan on it.
        for d in sorted(self.state.known_dead):
            if d < cluster.num_devices and not cluster.is_dead(d):
                cluster = cluster.with_device(d, DeviceState(dead=True))
        # Telemetry measures chunk slowdowns; the planner's compute factor slows compute alone. A
        # probe's size (a rank nobody traces) is a compute slowdown already (Location.measure).
        plan, model = self.state.running_plan, self.model or self.fallback_model
        probed = {loc.rank for _, locs in view.incidents for loc in locs if loc.measure == "compute"}
        if plan is not None and model is not None:
            for d, st in sorted(cluster.damaged.items()):
                if not st.dead and st.compute_factor > 1.0:
                    cf = compute_factor_of(cluster, model, plan, d, st.compute_factor,
                                           "compute" if d in probed else "chunks")
                    cluster = cluster.with_device(d, DeviceState(compute_factor=cf))
        return cluster

    def _refuse(self, reason: str, key: str | None = None, waiting: bool = False) -> None:
        """Report why something is not planned (once per key): logged, kept in ``refusals``, and
        published as ``plan.withheld`` with the next reactions (its id derives from the key, so a
        replaying engine re-derives the same event and every reader keeps one)."""
        key = key or reason
        if key in self._reported:
            return
        self._reported.add(key)
        self.refusals.append(reason)
        log.warning("remediation job=%s epoch=%s: %s", self.config.job, self.state.running_epoch, reason)
        s = self.state
        self._withheld.append(self._make(f"withheld/{key}", PlanWithheld(
            reason=reason, base_epoch=s.running_epoch, incident_ids=[i.incident_id for i in s.open_incidents()],
            waiting=waiting)))

    def _maybe_plan(self) -> Envelope | None:
        """Plan when what the planner knows changed; never raises: an error is reported and the
        engine plans again on the next change."""
        s = self.state
        if s.blocking_plan() is not None or s.running_plan is None:
            return None
        try:
            view = self.view()
        except Exception as exc:  # noqa: BLE001 - an incident must never stop the engine
            log.exception("remediation job=%s: cannot read the open incidents", s.job)
            self._refuse(f"cannot read the open incidents: {exc!r}")
            return None
        # A failed apply is a reason to plan again, and so is a horizon that doubled in a calm: a
        # reshape declined over a burst's pace may pay over the longer one.
        key = (s.incident_version, view.key, len(s.failed()), self.horizon.band(self._read_clock_s))
        if key == self._planned_key:
            return None
        self._planned_key = key
        self.waiting = {w.incident_id: w.reason for w in view.waiting}
        for w in view.waiting:
            self._refuse(w.reason, key=f"wait/{w.incident_id}/{s.incident_version}/{w.reason}", waiting=True)
        if view.waiting and not view.incidents:
            return None  # every open incident waits to be located: planning now would answer none of them
        if view.probing and not any(FaultCategory(c) == FaultCategory.FAIL_STOP for c, _ in view.incidents):
            return None  # a re-probe's answer is due: a plan now might keep a member it names slow
        for incident_id in view.grouped:
            self._refuse(f"incident {incident_id}: planning around its whole TP group (the member is not named)",
                         key=f"group/{incident_id}/{s.incident_version}")
        try:
            return self._propose(view)
        except Exception as exc:  # noqa: BLE001 - an incident must never stop the engine
            log.exception("remediation job=%s epoch=%s: planning failed", s.job, s.running_epoch)
            self._refuse(f"planning failed for incidents {[i.incident_id for i in s.open_incidents()]}: {exc!r}",
                         key=f"error/{key}")
            return None

    def _propose(self, view: PlanningView) -> Envelope | None:
        s = self.state
        strategy = self._current_strategy()
        if strategy is None:
            self._refuse("no cost figures yet: no analytics.cost_model fits and no --model", key="no-figures")
            return None
        if s.running_plan is None:  # the caller plans only while a plan runs
            return None
        try:
            result = strategy.plan(self.cluster(view), s.running_plan)
        except PlanRefused as exc:
            self._refuse(f"plan refused: {exc.reason}", key=f"refused/{s.running_epoch}/{s.incident_version}")
            return None
        horizon_s = getattr(strategy, "options", self.config.options).horizon_s
        chosen = result.to_apply(horizon_s, self.config.min_gain_fraction)
        if chosen is None:
            return None
        result = chosen
        _, not_offered = fit_options(self.config.options, s.capabilities)
        if s.capabilities is not None:
            cannot = capability_refusal(result.plan, s.running_plan, s.capabilities)
            if cannot is not None:  # a strategy that ignores the options (a baseline) chose what the job cannot run
                self._refuse(f"the best plan ({result.strategy}) is one the job cannot run: {cannot}",
                             key=f"incapable/{s.running_epoch}/{s.incident_version}")
                return None
        failed = s.failed()
        open_ids = {i.incident_id for i in s.open_incidents()}
        # A layout the trainer failed to apply would fail again; one rolled back for these same
        # incidents would roll back again (a re-plan because the horizon grew finds it anew). One
        # whose command went stale on the way is proposed again for the epoch that runs now.
        undone = next((r for r in s.plans.values() if r.proposal.plan.pipelines == result.plan.pipelines and (
            r.trainer_could_not_apply
            or (r.status == PlanStatus.ROLLED_BACK and set(r.proposal.incident_ids) == open_ids))), None)
        if undone is not None:  # say so and wait for something to change
            how = ("which the trainer failed to apply" if undone.status == PlanStatus.FAILED
                   else "rolled back for these incidents")
            self._refuse(f"the best plan is {undone.plan_id}'s layout, {how} ({undone.verdict}); waiting for a change",
                         key=f"{undone.status.value}-again/{undone.plan_id}")
            return None
        # after a failed apply the id must be new; the run's bits make it one no other run's decision names,
        # and a replay of this log re-derives it
        plan_id = (f"p{s.running_epoch}-{s.incident_version}" + (f"-g{len(view.grouped)}" if view.grouped else "")
                   + (f"-f{len(failed)}" if failed else "") + (f"-r{s.run[:8]}" if s.run else ""))
        payload = PlanProposed(
            plan_id=plan_id, incident_ids=[i.incident_id for i in s.open_incidents()],
            strategy=result.strategy, base_epoch=s.running_epoch, plan=result.plan,
            current_tokens_per_s=result.current_tokens_per_s, predicted_tokens_per_s=result.predicted_tokens_per_s,
            reshape_cost_s=result.reshape_cost_s, diff=result.diff, severity=s.max_severity(),
            fraction_of_before=self._fraction_of_before(result, view) if result.current_tokens_per_s <= 0 else None,
            not_offered=not_offered,
        )
        return self._make(f"proposal/{plan_id}", payload)

    def _fraction_of_before(self, result, view: PlanningView) -> float | None:
        """For a plan that resumes a job hung on a dead device: its predicted throughput over the
        prediction for the old layout with the dead devices alive again (what ran before the
        fail-stop), so verification can compare with what was measured then."""
        model = self.model
        if model is None or self.state.running_plan is None:
            return None
        alive = [(c, locs) for c, locs in view.incidents if FaultCategory(c) != FaultCategory.FAIL_STOP]
        before = cluster_from_incidents(self.num_devices(), alive, self.config.hardware, [])
        reference = predict_tokens_per_s(before, model, self.state.running_plan)
        fraction = result.predicted_tokens_per_s / reference if reference > 0 else 0.0
        return fraction if fraction > 0 else None

    def _current_strategy(self) -> Strategy | None:
        """The strategy over the freshest cost figures: fits of the latest epoch the trainer
        announced, else the fallback model."""
        s = self.state
        model = self.fallback_model
        key: tuple[object, ...] = ("fallback",)
        for epoch in sorted(set(s.cost_fits) & set(s.announced), reverse=True):
            fitted, current = s.cost_fits[epoch], s.announced[epoch]
            total, n = self._tokens_per_mb.get(epoch, (0.0, 0))
            key = ("fits", epoch, fitted.iteration, n)
            if key == self._model_key and self.model is not None:
                model = self.model
                break
            try:
                model = model_from_fits(fitted.fits, current, self.config.hardware,
                                        tokens_per_microbatch=total / n if n else None,
                                        mean_document_tokens=self.config.mean_document_tokens)
                model = self._with_spread(model, epoch, current.plan)
            except ValueError as exc:
                log.warning("cost fits of epoch %s unusable (%s); using the fallback model", epoch, exc)
                model, key = self.fallback_model, ("fallback",)
            break
        if model is not None and s.running_plan is not None and model.num_layers != s.running_plan.num_layers:
            log.warning("model has %s layers, the running plan %s; not planning with it",
                        model.num_layers, s.running_plan.num_layers)
            return None
        if self._fixed_strategy is not None:
            return self._fixed_strategy
        if model is None:
            return None
        if key != self._model_key or self.strategy is None:
            self.model, self._model_key = model, key
            self.strategy = make_strategy(self.config.strategy, model, self.config.options.horizon_s,
                                          self.config.options)
        if isinstance(self.strategy, PlannerStrategy):  # weigh reshapes against the expected time to the next change
            # and search only what the job's executor declared it can run
            options, _ = fit_options(self.strategy.options, s.capabilities)
            return PlannerStrategy(self.strategy.model, self.strategy.name,
                                   replace(options, horizon_s=self.horizon.horizon_s(self._read_clock_s)))
        return self.strategy

    def _with_spread(self, model: PlannerModel, epoch: int, plan: Plan) -> PlannerModel:
        """``model`` with the replicas' spread and the stalls' tail (``calibrate_spread``), fitted on
        the iterations observed while no incident was open — on a healthy cluster, since that is
        what ran them — of this epoch, or of the newest earlier one with enough of them when this
        one has too few (a fault came soon after a reshape). Without a spread the planner sees every
        slow replica as the job's bottleneck and overrates fixing it: a ×1.5 GPU in one of eight
        replicas was predicted to cost 6.7 % of the job's throughput where it costs 3 %."""
        healthy = ClusterState(self.num_devices(), self.config.hardware)
        for e in sorted((e for e in self._observed_s if e <= epoch), reverse=True):
            observed = self._observed_s[e]
            ran = plan if e == epoch else self._epoch_plan(e)
            if len(observed) >= SPREAD_MIN_ITERATIONS and ran is not None:
                return calibrate_spread(model, ran, healthy, [t for _, t in observed])
        return model

    def _rollback_proposal(self, plan_id: str) -> Envelope | None:
        """Propose the layout that ran before ``plan_id`` if it is still usable and was faster."""
        record = self.state.plans[plan_id]
        previous = self._previous_plan(record.proposal.base_epoch)
        if previous is None:
            return None
        cluster = self.cluster()
        dead = sorted(d for d in previous.devices if cluster.is_dead(d) or d in self.state.known_dead)
        if dead or record.proposal.current_tokens_per_s <= 0:
            self._refuse(f"no roll-back of {plan_id}: the layout of epoch {previous.epoch} uses dead device(s) "
                         f"{dead or 'it hung on'}; keeping the plan", key=f"no-rollback/{plan_id}")
            return None
        back = previous.model_copy(update={"epoch": self.state.running_epoch + 1})
        back = Plan.model_validate(back.model_dump())
        rid = f"{plan_id}-rollback"
        payload = PlanProposed(
            plan_id=rid, incident_ids=list(record.proposal.incident_ids), strategy="rollback",
            base_epoch=self.state.running_epoch, plan=back,
            # what the planner predicted for the layout that runs now: verification compares ratios
            current_tokens_per_s=record.proposal.predicted_tokens_per_s,
            predicted_tokens_per_s=record.proposal.current_tokens_per_s, reshape_cost_s=record.proposal.reshape_cost_s,
            diff=[f"roll back to the layout of epoch {previous.epoch}"], severity=record.proposal.severity,
        )
        return self._make(f"proposal/{rid}", payload)

    def _epoch_plan(self, epoch: int) -> Plan | None:
        announced = self.state.announced.get(epoch)
        if announced is not None:
            return announced.plan
        running = self.state.running_plan
        return running if running is not None and running.epoch == epoch else None

    def _previous_plan(self, epoch: int) -> Plan | None:
        if epoch in self.state.layouts:
            return self.state.layouts[epoch]
        for r in self.state.plans.values():
            if r.status in (PlanStatus.APPLIED, PlanStatus.VERIFIED, PlanStatus.ROLLED_BACK) and r.epoch == epoch:
                return r.proposal.plan
        announced = self.state.announced.get(epoch)
        if announced is not None:
            return announced.plan
        return self.initial_plan if self.initial_plan is not None and self.initial_plan.epoch == epoch else None


def _said(e: Envelope) -> str:
    """One log line for a reaction the engine published: what an operator tailing the engine's
    log needs to follow a plan from proposal to verdict (the full event is on the control topic)."""
    p = e.payload
    if isinstance(p, PlanProposed):
        return (f"proposed {p.plan_id} ({p.strategy}, epoch {p.base_epoch}→{p.plan.epoch}, "
                f"{p.current_tokens_per_s:,.0f} → {p.predicted_tokens_per_s:,.0f} tokens/s): {'; '.join(p.diff)}")
    if isinstance(p, ReconfigureCommand):
        return f"commanded {p.plan_id} as epoch {p.plan.epoch} ({p.command_id})"
    if isinstance(p, PlanDecision):
        return f"{'approved' if p.approve else 'rejected'} {p.plan_id} ({p.actor})"
    if isinstance(p, PlanVerified):
        return (f"verified {p.plan_id}: {p.measured_tokens_per_s:,.0f} tokens/s measured, "
                f"{p.predicted_tokens_per_s:,.0f} predicted")
    if isinstance(p, PlanRolledBack):
        return f"rolled back {p.plan_id}: {p.reason}"
    return e.kind
