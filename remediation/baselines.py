"""The strategies ours is measured against, all behind one interface: ``plan(cluster, current)``.

* ``do_nothing`` — keep training as is (a dead device stops the job: 0 tokens/s).
* ``drop_replica`` — DP-only fault tolerance as torchft and fault-tolerant HSDP do it: the replica
  holding a bad device leaves, the others split its micro-batches evenly.
* ``elastic_restart`` — stop, restart from the last checkpoint on the nodes without a bad device,
  uniform TP×PP as before with fewer replicas; pays the restart and, on average, half a checkpoint
  interval of lost progress.
* ``oobleck`` — pipeline templates (Oobleck, SOSP'23): on a fail-stop, re-instantiate pipelines of
  whole healthy nodes from templates of different sizes and split the batch by template speed. It
  does not see fail-slow.
* ``tp_only``, ``pp_only``, ``dp_only`` — our planner limited to one dimension (the ablations).
* ``oracle`` — our planner fed the exact faults (the benchmark gives it the truth) with free
  reshapes: the upper bound.
* ``ours`` — the joint planner with reshape costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from collector.plan import PipelinePlan, Plan, StagePlan
from collector.replica_drop import drop_replicas, even_split, surviving_replicas
from remediation.candidates import PlannerOptions
from remediation.cluster import ClusterState
from remediation.costs import max_layers
from remediation.diff import plan_diff
from remediation.model import PlannerModel
from remediation.plan_result import PlanRefused, PlanResult
from remediation.planner import Planner
from remediation.throughput import predict_tokens_per_s


class Strategy(Protocol):
    name: str

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult: ...


def _result(name: str, model: PlannerModel, cluster: ClusterState, current: Plan, new: Plan, cost_s: float,
            horizon_s: float, sources: list[int] | None = None) -> PlanResult:
    tps = predict_tokens_per_s(cluster, model, new)
    cur = predict_tokens_per_s(cluster, model, current)
    changed = new is not current
    return PlanResult(
        plan=new, strategy=name, changed=changed, iteration_s=current.global_microbatches * model.tokens_per_microbatch / tps if tps else float("inf"),
        predicted_tokens_per_s=tps, current_tokens_per_s=cur, reshape_cost_s=cost_s if changed else 0.0,
        horizon_tokens=tps * max(0.0, horizon_s - (cost_s if changed else 0.0)),
        diff=plan_diff(current, new, sources, cluster) if changed and sources is not None else [],
    )


def _next_plan(current: Plan, pipelines: list[tuple[StagePlan, ...]], microbatches: list[int]) -> Plan:
    """The next epoch's plan: these pipelines, with these micro-batches each, as replicas 0, 1, …"""
    return Plan(epoch=current.epoch + 1, schedule=current.schedule, virtual_stages=current.virtual_stages,
                num_layers=current.num_layers,
                pipelines=tuple(PipelinePlan(replica=i, microbatches=m, stages=st)
                                for i, (st, m) in enumerate(zip(pipelines, microbatches))))


@dataclass
class _FixedStrategy:
    """A baseline that is not our planner: each answers with the layout it keeps or the one its rule
    builds, scored by the same throughput model as ours over the same horizon."""

    model: PlannerModel
    name: str
    horizon_s: float = 1800.0

    def _unchanged(self, cluster: ClusterState, current: Plan) -> PlanResult:
        return _result(self.name, self.model, cluster, current, current, 0.0, self.horizon_s)

    def _changed(self, cluster: ClusterState, current: Plan, new: Plan, cost_s: float,
                 sources: list[int] | None = None) -> PlanResult:
        return _result(self.name, self.model, cluster, current, new, cost_s, self.horizon_s, sources)


@dataclass
class DoNothing(_FixedStrategy):
    """Keep training as is."""

    name: str = "do_nothing"

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        return self._unchanged(cluster, current)


@dataclass
class DropReplica(_FixedStrategy):
    """DP-only fault tolerance as torchft and fault-tolerant HSDP do it: the replicas holding a bad
    device leave, the others split the batch evenly."""

    name: str = "drop_replica"
    pause_s: float = 15.0

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        bad = cluster.bad_devices()
        keep = surviving_replicas(current, bad)
        if len(keep) == len(current.pipelines):
            return self._unchanged(cluster, current)
        try:
            new = drop_replicas(current, bad)
        except ValueError as e:
            raise PlanRefused(f"every replica holds a bad device or too few are left ({len(bad)} bad devices): {e}") from e
        return self._changed(cluster, current, new, self.pause_s, [p.replica for p in keep])


def _pipelines_from_nodes(
    cluster: ClusterState, model: PlannerModel, node_groups: list[list[int]], tp: int, num_layers: int,
    pp: int | None = None,
) -> list[tuple[StagePlan, ...]]:
    """Pipelines on groups of nodes: TP groups of ``tp`` consecutive devices, layers split evenly.
    Without ``pp`` a group is one pipeline of as many stages as it has TP groups (a template);
    with it, every ``tp × pp`` consecutive devices of a group are a pipeline of ``pp`` stages, so a
    node holding two TP 2 · PP 2 pipelines gives two."""
    per = cluster.hardware.devices_per_node
    out = []
    for nodes in node_groups:
        devices = [d for n in nodes for d in range(n * per, min((n + 1) * per, cluster.num_devices))]
        size = tp * pp if pp else len(devices)
        for start in range(0, len(devices) - size + 1, size):
            block = devices[start:start + size]
            groups = [tuple(block[i:i + tp]) for i in range(0, len(block) - tp + 1, tp)]
            S = min(len(groups), num_layers)
            if S == 0 or num_layers > S * max_layers(cluster, model, tp):
                continue
            base, extra = divmod(num_layers, S)
            stages, first = [], 0
            for s in range(S):
                end = first + base + (1 if s < extra else 0)
                stages.append(StagePlan(devices=groups[s], first_layer=first, end_layer=end))
                first = end
            out.append(tuple(stages))
    return out


@dataclass
class ElasticRestart(_FixedStrategy):
    """Restart from the checkpoint on nodes without a bad device (same TP and PP, fewer replicas)."""

    name: str = "elastic_restart"
    restart_s: float = 180.0
    checkpoint_interval_s: float = 1800.0

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        bad = cluster.bad_devices()
        if not any(d in bad for d in current.devices):
            return self._unchanged(cluster, current)
        first = current.pipelines[0]
        tp, pp = first.stages[0].tp, len(first.stages)
        per = cluster.hardware.devices_per_node
        nodes_per_pipe = max(1, (tp * pp + per - 1) // per)
        used_nodes = sorted({cluster.node_of(d) for d in current.devices})
        bad_nodes = {cluster.node_of(d) for d in bad}
        good = [n for n in used_nodes if n not in bad_nodes]
        groups = [good[i:i + nodes_per_pipe] for i in range(0, len(good) - nodes_per_pipe + 1, nodes_per_pipe)]
        pipes = _pipelines_from_nodes(cluster, self.model, groups, tp, current.num_layers, pp)
        pipes = [p for p in pipes if len(p) == pp][: current.global_microbatches]
        if not pipes:
            raise PlanRefused(f"elastic restart needs {nodes_per_pipe} healthy nodes per replica; {len(good)} are left")
        new = _next_plan(current, pipes, even_split(current.global_microbatches, len(pipes)))
        res = self._changed(cluster, current, new, self.restart_s + self.checkpoint_interval_s / 2)
        return replace(res, diff=[f"restart from checkpoint on {len(pipes)} replicas of TP{tp}·PP{pp} "
                                  f"(nodes {', '.join(map(str, sorted(bad_nodes)))} left out)"])


@dataclass
class Oobleck(_FixedStrategy):
    """Oobleck (SOSP'23): re-instantiate pipelines from templates over whole nodes that have no
    dead device, and split the batch by template speed. It does not see fail-slow."""

    name: str = "oobleck"
    pause_s: float = 15.0

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        dead = cluster.dead_devices()
        if not any(d in dead for d in current.devices):  # fail-slow is invisible to it
            return self._unchanged(cluster, current)
        first = current.pipelines[0]
        tp, pp = first.stages[0].tp, len(first.stages)
        per = cluster.hardware.devices_per_node
        nodes_per_pipe = max(1, (tp * pp + per - 1) // per)
        dead_nodes = {cluster.node_of(d) for d in dead}
        keep = []
        lost_nodes: set[int] = set()
        for p in current.pipelines:
            nodes = sorted({cluster.node_of(d) for st in p.stages for d in st.devices})
            if any(n in dead_nodes for n in nodes):
                lost_nodes.update(n for n in nodes if n not in dead_nodes)
            else:
                keep.append(p.stages)
        # The healthy nodes of broken pipelines form new pipelines from smaller templates, or join
        # the last pipeline when too few for any template.
        spare = sorted(lost_nodes)
        new_pipes = list(keep)
        while spare:
            take = spare[:nodes_per_pipe]
            spare = spare[nodes_per_pipe:]
            built = _pipelines_from_nodes(cluster, self.model, [take], tp, current.num_layers)
            new_pipes.extend(built)
        if not new_pipes:
            raise PlanRefused("oobleck: no template fits the nodes that are left")
        # Batch split by template speed (stage count), blind to slow devices.
        weights = [len(p) for p in new_pipes]
        M = current.global_microbatches
        split = [max(1, round(M * w / sum(weights))) for w in weights]
        split[-1] += M - sum(split)
        if split[-1] < 1:
            return DropReplica(self.model, name=self.name, horizon_s=self.horizon_s).plan(cluster, current)
        new = _next_plan(current, new_pipes, split)
        move_s = self.model.num_layers * self.model.layer_state_bytes / max(1, pp * tp) / cluster.hardware.link_bandwidth_Bps
        res = self._changed(cluster, current, new, self.pause_s + move_s)
        return replace(res, diff=[f"re-instantiate {len(new_pipes)} pipelines from templates ({len(keep)} kept)"])


@dataclass
class PlannerStrategy:
    """Our planner, or a restriction of it (the ablations), or the oracle."""

    model: PlannerModel
    name: str
    options: PlannerOptions

    def __post_init__(self) -> None:
        self._planner = Planner(self.model, self.options, strategy=self.name)

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        return self._planner.plan(cluster, current)


def make_strategy(name: str, model: PlannerModel, horizon_s: float = 1800.0,
                  options: PlannerOptions | None = None) -> Strategy:
    """A strategy by name (see STRATEGY_NAMES); ``options`` (pauses, horizon) for the planner-based ones."""
    base = options or PlannerOptions(horizon_s=horizon_s)
    planners: dict[str, PlannerOptions] = {
        "ours": base,
        "oracle": replace(base, free_reshape=True),
        "tp_only": replace(base, allow_pp=False, allow_dp=False),
        "pp_only": replace(base, allow_tp=False, allow_dp=False),
        "dp_only": replace(base, allow_tp=False, allow_pp=False),
    }
    if name in planners:
        return PlannerStrategy(model, name, planners[name])
    others: dict[str, Callable[[], Strategy]] = {
        "do_nothing": lambda: DoNothing(model, horizon_s=horizon_s),
        "drop_replica": lambda: DropReplica(model, horizon_s=horizon_s),
        "elastic_restart": lambda: ElasticRestart(model, horizon_s=horizon_s),
        "oobleck": lambda: Oobleck(model, horizon_s=horizon_s),
    }
    if name not in others:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    return others[name]()


STRATEGY_NAMES: tuple[str, ...] = (
    "ours", "oracle", "do_nothing", "drop_replica", "elastic_restart", "oobleck", "tp_only", "pp_only", "dp_only",
)
