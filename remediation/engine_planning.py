"""The remediation engine's planning: when to plan, around what, with which cost figures.

:class:`EnginePlanning` is the part of the engine that turns the fold's open incidents into a
proposal: it reads which incidents can be planned around now (remediation.planning_view), builds
the cluster they imply, keeps the cost figures fresh (the analytics fits of the running epoch, the
tokens per micro-batch and the replicas' spread measured from ``analytics.prediction``, else the
model the engine was started with), and proposes only what pays over the horizon and what the
job's executor can run. When the incidents blame a whole node it scores the node's exclusion
against the in-job reshape and may propose a node plan (remediation/node_plans.py). It plans only
when what it knows changed, and never raises: an error is
reported (``plan.withheld``) and planning is tried again on the next change. A plan whose
verification failed is answered by proposing the layout before it (:meth:`rollback_proposal`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from collector.capabilities import capability_refusal
from collector.events import (
    Envelope, FaultCategory, IncidentOpened, IterationPrediction, Location, NodeOrder, PlanProposed,
)
from collector.plan import Plan
from remediation.baselines import PlannerStrategy, Strategy, make_strategy
from remediation.capability_fit import fit_options
from remediation.cluster import ClusterState, DeviceState, cluster_from_incidents
from remediation.cost_figures import calibrate_spread, model_from_fits
from remediation.costs import compute_factor_of
from remediation.engine_output import EngineClock, EngineOutput
from remediation.horizon import HorizonEstimator
from remediation.lifecycle import LifecycleState, PlanStatus
from remediation.model import PlannerModel
from remediation.node_plans import (blamed_nodes, choose, join_orders, node_devices, order_line, stop_orders,
                                    without_nodes)
from remediation.plan_result import PlanRefused, PlanResult
from remediation.planning_view import PlanningView, planning_view
from remediation.throughput import predict_tokens_per_s

if TYPE_CHECKING:
    from remediation.engine import EngineConfig

OBSERVED_WINDOW = 4096  # healthy iterations per epoch the spread and the tail are fitted on
SPREAD_MIN_ITERATIONS = 100  # fewer healthy iterations of an epoch than this: carry an earlier epoch's spread

log = logging.getLogger("resihp.remediation")


class EnginePlanning:
    """One job's planning, over the engine's fold (``state``), clock and output."""

    def __init__(self, config: EngineConfig, state: LifecycleState, clock: EngineClock, output: EngineOutput,
                 model: PlannerModel | None, initial_plan: Plan | None, strategy: Strategy | None) -> None:
        self.config, self.state, self.clock, self.output = config, state, clock, output
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
        self._planned_key: tuple = (0, (), 0)
        self.waiting: dict[str, str] = {}  # incident id -> why the planner leaves it out for now

    def observe(self, event: Envelope, faults_changed: bool) -> None:
        """Learn from one folded event what planning needs beyond the fold: when the set of faults
        last changed (the horizon), tokens per micro-batch, and healthy iterations for the spread."""
        if faults_changed:
            faults = frozenset(i.incident_id for i in self.state.open_incidents())
            if faults != self._faults:  # a fault came or went; a confirmation or update is the same fault
                self._faults = faults
                self.horizon.change(event.time_s)
        p = event.payload
        if isinstance(p, IterationPrediction) and p.tokens > 0 and self.state.running_plan is not None:
            total, n = self._tokens_per_mb.get(p.epoch, (0.0, 0))
            plan = self.epoch_plan(p.epoch) or self.state.running_plan
            self._tokens_per_mb[p.epoch] = (total + p.tokens / plan.global_microbatches, n + 1)
            if not self.state.open_incidents():  # a slow replica's times would pass for spread
                self._observed_s.setdefault(p.epoch, deque(maxlen=OBSERVED_WINDOW)).append((p.iteration, p.observed_s))
        elif isinstance(p, IncidentOpened):  # iterations from its detection on may have reached us first
            observed = self._observed_s.get(self.state.running_epoch)
            while observed and observed[-1][0] >= p.iteration:
                observed.pop()

    def num_devices(self) -> int:
        n = self.config.num_devices
        if n is None:
            plan = self.state.running_plan
            per = self.config.hardware.devices_per_node
            n = -(-(max(plan.devices) + 1) // per) * per if plan is not None else 0
        return n

    def view(self) -> PlanningView:
        """Which open incidents can be planned around now (remediation.planning_view), each without
        the ranks a spare took over after it opened (``LifecycleState.current_incidents``)."""
        return planning_view(self.state.current_incidents(), self.clock.signed_s, self.config.localisation_wait_s)

    def cluster(self, view: PlanningView | None = None) -> ClusterState:
        """The cluster implied by the open incidents the planner can locate; locations it cannot
        apply (a device outside the cluster) are reported and left out."""
        view = view or self.view()
        skipped: list[tuple[Location, str]] = []
        cluster = cluster_from_incidents(self.num_devices(), view.incidents, self.config.hardware, skipped)
        for loc, reason in skipped:
            self.output.refuse(f"location {loc.model_dump(exclude_defaults=True)} left out: {reason}")
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

    def maybe_plan(self) -> Envelope | None:
        """Plan when what the planner knows changed; never raises: an error is reported and the
        engine plans again on the next change."""
        s = self.state
        if s.blocking_plan() is not None or s.running_plan is None:
            return None
        try:
            view = self.view()
        except Exception as exc:  # an incident must never stop the engine
            log.exception("remediation job=%s: cannot read the open incidents", s.job)
            self.output.refuse(f"cannot read the open incidents: {exc!r}")
            return None
        # A failed apply is a reason to plan again, and so is a horizon that doubled in a calm: a
        # reshape declined over a burst's pace may pay over the longer one.
        key = (s.incident_version, view.key, len(s.failed()), self.horizon.band(self.clock.read_s))
        if key == self._planned_key:
            return None
        self._planned_key = key
        self.waiting = {w.incident_id: w.reason for w in view.waiting}
        for w in view.waiting:
            self.output.refuse(w.reason, key=f"wait/{w.incident_id}/{s.incident_version}/{w.reason}", waiting=True)
        if view.waiting and not view.incidents:
            return None  # every open incident waits to be located: planning now would answer none of them
        if view.probing and not any(FaultCategory(c) == FaultCategory.FAIL_STOP for c, _ in view.incidents):
            return None  # a re-probe's answer is due: a plan now might keep a member it names slow
        for incident_id in view.grouped:
            self.output.refuse(f"incident {incident_id}: planning around its whole TP group (the member is not named)",
                         key=f"group/{incident_id}/{s.incident_version}")
        try:
            return self._propose(view)
        except Exception as exc:  # an incident must never stop the engine
            log.exception("remediation job=%s epoch=%s: planning failed", s.job, s.running_epoch)
            self.output.refuse(f"planning failed for incidents {[i.incident_id for i in s.open_incidents()]}: {exc!r}",
                         key=f"error/{key}")
            return None

    def _propose(self, view: PlanningView) -> Envelope | None:
        s = self.state
        strategy = self._current_strategy()
        if strategy is None:
            self.output.refuse("no cost figures yet: no analytics.cost_model fits and no --model", key="no-figures")
            return None
        if s.running_plan is None:  # the caller plans only while a plan runs
            return None
        cluster = self.cluster(view)
        try:
            result = strategy.plan(cluster, s.running_plan)
        except PlanRefused as exc:
            self.output.refuse(f"plan refused: {exc.reason}", key=f"refused/{s.running_epoch}/{s.incident_version}")
            return None
        horizon_s = getattr(strategy, "options", self.config.options).horizon_s
        chosen = result.to_apply(horizon_s, self.config.min_gain_fraction)
        blamed = blamed_nodes(cluster, s.running_plan, self.config.nodes.min_bad_devices)
        node_plan = self._node_plan(strategy, cluster, blamed, chosen, horizon_s)
        if node_plan is not None:
            chosen = node_plan
        if chosen is None:
            return None
        result = chosen
        _, not_offered = fit_options(self.config.options, s.capabilities)
        if s.capabilities is not None:
            cannot = capability_refusal(result.plan, s.running_plan, s.capabilities)
            if cannot is not None:  # a strategy that ignores the options (a baseline) chose what the job cannot run
                self.output.refuse(f"the best plan ({result.strategy}) is one the job cannot run: {cannot}",
                             key=f"incapable/{s.running_epoch}/{s.incident_version}")
                return None
            stopping = {d for node in (blamed if node_plan is not None else {}) for d in node_devices(cluster, node)}
            kept_out = set(s.running_plan.devices) - set(result.plan.devices) - stopping - s.known_dead
            if s.capabilities.leaves_by_node_stop and kept_out:
                self.output.refuse(f"the best plan ({result.strategy}) leaves devices {sorted(kept_out)} out, but the "
                                   "job's devices leave only with their node, and no node of theirs is stopped",
                                   key=f"node-only/{s.running_epoch}/{s.incident_version}")
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
            self.output.refuse(f"the best plan is {undone.plan_id}'s layout, {how} ({undone.verdict}); waiting for a change",
                         key=f"{undone.status.value}-again/{undone.plan_id}")
            return None
        # after a failed apply the id must be new; the run's bits make it one no other run's decision names,
        # and a replay of this log re-derives it
        plan_id = (f"p{s.running_epoch}-{s.incident_version}" + (f"-g{len(view.grouped)}" if view.grouped else "")
                   + (f"-f{len(failed)}" if failed else "") + (f"-r{s.run[:8]}" if s.run else ""))
        orders: list[NodeOrder] = []
        if node_plan is not None:
            round_ = self.config.nodes.round if s.node_round is None else s.node_round
            orders = stop_orders(plan_id, blamed, cluster, self.config.nodes, round_)
            spares = s.waiting_spares(self.config.nodes.run, cluster.hardware.devices_per_node, self.clock.signed_s)
            orders += join_orders(plan_id, orders, spares)
            if s.capabilities is not None and s.capabilities.leaves_by_node_stop:  # the stop is how the layout changes
                orders = [o.model_copy(update={"with_command": True}) for o in orders]
        payload = PlanProposed(
            plan_id=plan_id, incident_ids=[i.incident_id for i in s.open_incidents()],
            strategy=result.strategy, base_epoch=s.running_epoch, plan=result.plan,
            current_tokens_per_s=result.current_tokens_per_s, predicted_tokens_per_s=result.predicted_tokens_per_s,
            reshape_cost_s=result.reshape_cost_s, diff=[order_line(o) for o in orders] + result.diff,
            severity=s.max_severity(),
            fraction_of_before=self._fraction_of_before(result, view) if result.current_tokens_per_s <= 0 else None,
            not_offered=not_offered, node_orders=orders,
        )
        return self.output.make(f"proposal/{plan_id}", payload)

    def _node_plan(self, strategy: Strategy, cluster: ClusterState, blamed: dict[int, str],
                   in_job: PlanResult | None, horizon_s: float) -> PlanResult | None:
        """The plan to propose with stop orders for the ``blamed`` nodes, or None for the in-job
        answer (remediation/node_plans.py's ``choose``): the exclusion is the same strategy's
        answer on the cluster without those nodes, scored by the same cost model."""
        if not blamed:
            return None
        s = self.state
        if self.config.nodes.run is None:
            for node, why in blamed.items():
                self.output.refuse(f"node {node} is blamed ({why}), but the engine orders no node: it was started "
                                   "without the job's rendezvous id (resihp remediate --node-run RDZV_ID)",
                                   key=f"node-blamed/{node}/{s.incident_version}")
            return None
        devices = {d for node in blamed for d in node_devices(cluster, node)}
        try:
            excluded = strategy.plan(without_nodes(cluster, blamed), s.running_plan).to_apply(
                horizon_s, self.config.min_gain_fraction) if s.running_plan is not None else None
        except PlanRefused as exc:
            self.output.refuse(f"no plan without node(s) {sorted(blamed)}: {exc.reason}",
                               key=f"node-refused/{s.running_epoch}/{s.incident_version}")
            excluded = None
        chosen = choose(in_job, excluded, devices)
        if chosen is None and in_job is not None:
            self.output.refuse(f"node(s) {sorted(blamed)} blamed, but a reshape that keeps some of their devices "
                               "trains more over the horizon: no node is stopped",
                               key=f"node-kept/{s.running_epoch}/{s.incident_version}")
        return chosen

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
                                   replace(options, horizon_s=self.horizon.horizon_s(self.clock.read_s)))
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
            ran = plan if e == epoch else self.epoch_plan(e)
            if len(observed) >= SPREAD_MIN_ITERATIONS and ran is not None:
                return calibrate_spread(model, ran, healthy, [t for _, t in observed])
        return model

    def rollback_proposal(self, plan_id: str) -> Envelope | None:
        """Propose the layout that ran before ``plan_id`` if it is still usable and was faster."""
        record = self.state.plans[plan_id]
        previous = self._previous_plan(record.proposal.base_epoch)
        if previous is None:
            return None
        cluster = self.cluster()
        dead = sorted(d for d in previous.devices if cluster.is_dead(d) or d in self.state.known_dead)
        if dead or record.proposal.current_tokens_per_s <= 0:
            self.output.refuse(f"no roll-back of {plan_id}: the layout of epoch {previous.epoch} uses dead device(s) "
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
        return self.output.make(f"proposal/{rid}", payload)

    def epoch_plan(self, epoch: int) -> Plan | None:
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
