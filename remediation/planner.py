"""The joint TP/PP/DP planner: the plan that trains the most tokens from now on.

The global batch (micro-batches per iteration) is fixed, so tokens per iteration are fixed and the
best plan is the one with the shortest iteration, net of what reshaping costs over the expected
time until the next change. The search is joint and exact for its candidate set:

1. Every pipeline holding a bad device gets its candidates (remediation.candidates: TP shrink or
   re-form × PP re-split, or drop). Healthy pipelines with identical shapes share one template,
   scored once — that is what keeps 100,000 GPUs fast.
2. For a target iteration time T, each pipeline (each candidate) can absorb m(T) micro-batches —
   the most whose makespan under the schedule model is ≤ T. Bisection finds the smallest T at which
   the pipelines, each using its best candidate, absorb the whole global batch. Choosing a
   candidate and the micro-batch split at once is what makes TP, PP and DP joint rather than one
   dimension after another.
3. The surplus micro-batches at T* are taken from the pipelines that finish last. (Steps 2 and 3
   are remediation/microbatch_split.py.)
4. The joint plan, the micro-batch-only rebalance and "change nothing" are compared on tokens over
   the horizon: throughput × (horizon − reshape cost).

What can go wrong: :class:`PlanRefused` when no pipeline can hold the model any more (too few
devices or too little memory), with the numbers; the caller keeps the old plan.
"""

from __future__ import annotations

from dataclasses import replace

from collector.plan import PipelinePlan, Plan, StagePlan
from remediation.candidates import (
    PipelineCandidate, PlannerOptions, build_candidate, dropped, pipeline_candidates, regrow_candidate,
    unchanged_candidate,
)
from remediation.cluster import ClusterState
from remediation.costs import PipelineScorer, ScheduleModelScorer
from remediation.diff import plan_diff
from remediation.microbatch_split import Chosen, MicrobatchSplit, Slot
from remediation.model import PlannerModel
from remediation.plan_result import PlanRefused, PlanResult
from remediation.throughput import pipeline_signature, predict_tokens_per_s
from remediation.uniform import is_uniform, uniform_plans


class Planner:
    """Plans against one cluster/model/current plan. ``scorer`` is the schedule model adapter."""

    def __init__(
        self,
        model: PlannerModel,
        options: PlannerOptions | None = None,
        scorer: PipelineScorer | None = None,
        strategy: str = "ours",
    ) -> None:
        self.model = model
        self.options = options or PlannerOptions()
        self._scorer = scorer
        self.strategy = strategy
        self._interleaved = False

    def scorer_for(self, plan: Plan) -> PipelineScorer:
        if self._scorer is None or getattr(self._scorer, "schedule", plan.schedule) != plan.schedule:
            self._scorer = ScheduleModelScorer(plan.schedule, plan.virtual_stages, self.model.microbatch_cv)
        return self._scorer

    # ---- public --------------------------------------------------------------------------------

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        """The best plan from now on (see the module docstring). Raises PlanRefused."""
        if current.num_layers != self.model.num_layers:
            raise ValueError(
                f"the plan has {current.num_layers} layers but the model spec has {self.model.num_layers}; "
                "give the planner the model the job trains"
            )
        scorer = self.scorer_for(current)
        self._interleaved = current.schedule == "interleaved" and current.virtual_stages > 1
        current_tps = self._current_tokens_per_s(cluster, current, scorer)
        options: list[PlanResult] = []
        for opts in self._variants():
            options.extend(self._search(cluster, current, opts, scorer, current_tps))
        if self.options.uniform_only:  # the executor runs one grid: only uniform plans, every uniform layout
            options = [r for r in options if is_uniform(r.plan)] + self._uniform(cluster, current, scorer, current_tps)
        if current_tps > 0:
            options.append(self._unchanged_result(current, current_tps, cluster))
        if not options:
            raise PlanRefused(self._refusal(cluster, current))
        best = max(options, key=lambda r: (r.horizon_tokens, not r.changed, -r.reshape_cost_s))
        if not best.changed and current_tps > 0:
            return options[-1]  # the unchanged plan itself (epoch kept), not an identical copy
        return self._offer_rebalance(best, options, current)

    def _offer_rebalance(self, best: PlanResult, options: list[PlanResult], current: Plan) -> PlanResult:
        """``best`` with the best micro-batch-only rebalance attached when ``best`` re-forms groups
        or moves layers and the rebalance trains within ``prefer_rebalance_within`` of it over the
        horizon (why: ``PlanResult.to_apply``). Not for the oracle: it reshapes for free and knows."""
        margin = self.options.prefer_rebalance_within
        if margin <= 0 or self.options.free_reshape or best.plan.same_stages(current):
            return best
        light = [r for r in options if r.changed and r.plan.same_stages(current)]
        if not light:
            return best
        rebalance = max(light, key=lambda r: r.horizon_tokens)
        if rebalance.horizon_tokens < best.horizon_tokens * (1 - margin):
            return best
        return replace(best, rebalance=rebalance)

    def _variants(self) -> list[PlannerOptions]:
        """The joint search and every single-dimension one it allows: the joint search's candidate
        set contains theirs, but its DP allocation is a bisection and its reshape cost is paid by
        every structural change, so comparing the results makes "ours" never worse, under its own
        scorer, than a one-dimension adaptation (or doing nothing)."""
        o = self.options
        out = [o]
        for tp, pp, dp in ((True, False, False), (False, True, False), (False, False, True)):
            v = replace(o, allow_tp=tp and o.allow_tp, allow_pp=pp and o.allow_pp, allow_dp=dp and o.allow_dp)
            if (v.allow_tp, v.allow_pp, v.allow_dp) != (False, False, False) and v not in out:
                out.append(v)
        return out

    def _search(self, cluster: ClusterState, current: Plan, opts: PlannerOptions, scorer: PipelineScorer,
                current_tps: float) -> list[PlanResult]:
        """The joint plan under ``opts`` and, when DP may change, the micro-batch-only rebalance."""
        M = current.global_microbatches
        dp = current.dp
        bad = cluster.bad_devices()
        joint_slots: list[Slot] = []
        keep_slots: list[Slot] = []
        classes: dict[tuple, Slot] = {}
        class_keep: dict[tuple, Slot] = {}
        idle = self._idle_healthy(cluster, current) if opts.allow_tp else {}
        tps = [st.tp for p in current.pipelines for st in p.stages]
        job_tp = max(set(tps), key=lambda t: (tps.count(t), t))  # the layout's own TP degree
        for pipe in current.pipelines:
            mine = idle.get(pipe.replica) if idle else None
            regrow: list[PipelineCandidate] = []
            for tp in (None, job_tp):
                c = (regrow_candidate(cluster, self.model, pipe, mine, current.schedule, opts, dp, tp)
                     if mine else None)  # no idle healthy device near this pipeline: nothing to regrow with
                if c is not None and all(c.stages != r.stages for r in regrow):
                    regrow.append(c)
            if (bad and any(d in bad for st in pipe.stages for d in st.devices)) or regrow:
                cands = pipeline_candidates(cluster, self.model, pipe, current.schedule, opts, dp)
                cands[:0] = regrow
                joint_slots.append(Slot([pipe], cands))
                kept = unchanged_candidate(cluster, self.model, pipe, current.schedule, opts, dp)
                keep_slots.append(Slot([pipe], [kept] if kept else [dropped(pipe)]))
                continue
            sig = pipeline_signature(pipe)
            if sig in classes:
                classes[sig].members.append(pipe)
                class_keep[sig].members.append(pipe)
                continue
            keep = unchanged_candidate(cluster, self.model, pipe, current.schedule, opts, dp)
            assert keep is not None  # healthy pipelines have no dead device
            cands = [keep]
            if opts.allow_pp:
                groups = [st.devices for st in pipe.stages]
                resplit = build_candidate(cluster, self.model, pipe, groups, range(len(groups)), "re-split layers",
                                          current.schedule, opts, dp)
                if resplit is not None and resplit.stages != keep.stages:
                    cands.append(resplit)
            classes[sig] = Slot([pipe], cands)
            class_keep[sig] = Slot([pipe], [keep])
        joint_slots.extend(classes.values())
        keep_slots.extend(class_keep.values())

        out: list[PlanResult] = []
        split = MicrobatchSplit(self.model, scorer, cluster, self._interleaved)
        joint = split.solve(joint_slots, M, opts.allow_dp)
        if joint is not None:
            out.append(self._result(joint, current, current_tps, split))
        if opts.allow_dp:
            rebalance = split.solve(keep_slots, M, opts.allow_dp)
            if rebalance is not None:
                out.append(self._result(rebalance, current, current_tps, split))
        return out

    def _idle_healthy(self, cluster: ClusterState, current: Plan) -> dict[int, dict[int, tuple[int, ...]]]:
        """Per pipeline (replica), per node: the healthy devices the plan does not use that this
        pipeline may re-grow onto — devices an earlier reshape excluded whose fault has since been
        resolved. On a node several pipelines share (TP below the node size), each such device
        goes to exactly one of them: the one holding the device nearest to it (TP groups are
        blocks of consecutive devices, so that is the group it was excluded from), then the one
        with the fewest devices on the node. No device is offered twice, so the joint search
        cannot give one device to two pipelines."""
        per = cluster.hardware.devices_per_node
        on_node: dict[int, dict[int, list[int]]] = {}  # node -> replica -> devices it uses there
        used: set[int] = set()
        for pipe in current.pipelines:
            for st in pipe.stages:
                for d in st.devices:
                    used.add(d)
                    on_node.setdefault(d // per, {}).setdefault(pipe.replica, []).append(d)
        out: dict[int, dict[int, tuple[int, ...]]] = {}
        for n, holders in on_node.items():
            if sum(map(len, holders.values())) >= per:
                continue  # the plan uses the whole node
            free = [d for d in range(n * per, min((n + 1) * per, cluster.num_devices))
                    if d not in used and cluster.is_healthy(d)]
            given: dict[int, list[int]] = {}
            for d in free:
                replica = min(holders, key=lambda r: (min(abs(d - x) for x in holders[r]),
                                                      len(holders[r]) + len(given.get(r, [])), r))
                given.setdefault(replica, []).append(d)
            for replica, devices in given.items():
                out.setdefault(replica, {})[n] = tuple(devices)
        return out

    # ---- results -------------------------------------------------------------------------------

    def _result(self, chosen: Chosen, current: Plan, current_tps: float, split: MicrobatchSplit) -> PlanResult:
        pipelines = []
        structural = False
        move_s = 0.0
        changed_mb = False
        choices: dict[int, str] = {}
        chosen = sorted(chosen, key=lambda x: x[0].replica)
        for pipe, cand, m in chosen:
            choices[pipe.replica] = cand.label if m > 0 else "drop replica"
            if m != pipe.microbatches:
                changed_mb = True
            if m == 0:
                structural = True
                continue
            if cand.structural:
                structural = True
                move_s = max(move_s, cand.move_s)
            stages = self._stages_for(pipe, cand)
            pipelines.append((pipe.replica, m, stages))
        plan = Plan(
            epoch=current.epoch + 1, schedule=current.schedule, virtual_stages=current.virtual_stages,
            num_layers=current.num_layers,
            pipelines=tuple(PipelinePlan(replica=i, microbatches=m, stages=st) for i, (_, m, st) in enumerate(pipelines)),
        )
        iteration_s = split.iteration_s(chosen)
        tps = current.global_microbatches * self.model.tokens_per_microbatch / iteration_s
        cost = (move_s + self.options.pause_s) if structural else (self.options.rebalance_pause_s if changed_mb else 0.0)
        if self.options.free_reshape:
            cost = 0.0
        return PlanResult(
            plan=plan, strategy=self.strategy, changed=structural or changed_mb, iteration_s=iteration_s,
            predicted_tokens_per_s=tps, current_tokens_per_s=current_tps, reshape_cost_s=cost,
            horizon_tokens=tps * max(0.0, self.options.horizon_s - cost),
            diff=plan_diff(current, plan, [p.replica for p, _, m in chosen if m > 0], split.cluster),
            choices=choices,
        )

    @staticmethod
    def _stages_for(pipe: PipelinePlan, cand: PipelineCandidate) -> tuple[StagePlan, ...]:
        """The candidate's stages for ``pipe`` (a class template applies to every member's own devices)."""
        if cand.source_replica == pipe.replica:
            return tuple(StagePlan(devices=s.devices, first_layer=s.first_layer, end_layer=s.end_layer) for s in cand.stages)
        return tuple(StagePlan(devices=old.devices, first_layer=s.first_layer, end_layer=s.end_layer)
                     for old, s in zip(pipe.stages, cand.stages))

    def _unchanged_result(self, current: Plan, current_tps: float, cluster: ClusterState) -> PlanResult:
        iteration_s = current.global_microbatches * self.model.tokens_per_microbatch / current_tps
        return PlanResult(
            plan=current, strategy=self.strategy, changed=False, iteration_s=iteration_s,
            predicted_tokens_per_s=current_tps, current_tokens_per_s=current_tps, reshape_cost_s=0.0,
            horizon_tokens=current_tps * self.options.horizon_s, diff=[], choices={},
        )

    def _uniform(self, cluster: ClusterState, current: Plan, scorer: PipelineScorer,
                 current_tps: float) -> list[PlanResult]:
        """Every uniform layout the executor may run (remediation/uniform.py), each a restart-sized reshape."""
        out = []
        cost = 0.0 if self.options.free_reshape else self.options.pause_s
        for plan in uniform_plans(cluster, self.model, current, change_tp=self.options.uniform_tp,
                                  change_pp=self.options.uniform_pp):
            tps = predict_tokens_per_s(cluster, self.model, plan, scorer)
            if tps <= 0:
                continue
            out.append(PlanResult(
                plan=plan, strategy=self.strategy, changed=True,
                iteration_s=plan.global_microbatches * self.model.tokens_per_microbatch / tps,
                predicted_tokens_per_s=tps, current_tokens_per_s=current_tps, reshape_cost_s=cost,
                horizon_tokens=tps * max(0.0, self.options.horizon_s - cost),
                diff=plan_diff(current, plan, None, cluster),
                choices={p.replica: f"uniform {plan.shape()}" for p in plan.pipelines}))
        return out

    def _current_tokens_per_s(self, cluster: ClusterState, current: Plan, scorer: PipelineScorer) -> float:
        """What the current plan trains on this cluster: 0 if it uses a dead device."""
        return predict_tokens_per_s(cluster, self.model, current, scorer)

    def _refusal(self, cluster: ClusterState, current: Plan) -> str:
        state_gib = self.model.num_layers * self.model.layer_state_bytes / 2**30
        per_dev_gib = cluster.hardware.state_capacity_bytes / 2**30
        alive = sum(1 for d in current.devices if not cluster.is_dead(d))
        return (
            f"no pipeline can hold the model any more: {self.model.num_layers} layers need {state_gib:.0f} GiB of "
            f"state, a device holds {per_dev_gib:.0f} GiB, and {alive} of the plan's {len(current.devices)} devices "
            "are alive with no replica able to re-form around its dead devices; restore from a checkpoint on "
            "replacement nodes (elastic restart) or add devices"
        )
