"""Plans for jobs that run one regular grid: every uniform layout on the healthy devices, scored.

Some executors run only uniform layouts — one TP degree for every stage, the same layer ranges and
micro-batch count in every replica (torchtitan builds one DeviceMesh and one schedule; a restart
is how it changes layout). The joint planner's candidates re-form one pipeline at a time, which
such a job cannot run, and a uniform job is small in choices anyway: every (TP, PP, DP) whose
product fits the healthy devices, whose DP divides the global batch's micro-batches (the global
batch is kept), whose TP degree divides the running one (so it divides the model's heads and widths
as the running one does) and whose stages hold the model's state. Each is scored with the same schedule
model as every plan (``predict_tokens_per_s`` on the cluster as it is, slow devices included),
paid for with the reshape's pause, and compared with the others and with changing nothing.

Devices: the running plan's healthy devices first, in their order (a new layout keeps its
neighbours), then the cluster's other healthy devices (spares, devices back from a repair).
"""

from __future__ import annotations

from collector.plan import PipelinePlan, Plan, StagePlan, even_layer_ranges
from remediation.cluster import ClusterState
from remediation.model import PlannerModel


def is_uniform(plan: Plan) -> bool:
    """One TP degree, one stage count, one layer split and one micro-batch count for the whole plan."""
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    splits = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in plan.pipelines}
    counts = {p.microbatches for p in plan.pipelines}
    return len(tps) == 1 and len(splits) == 1 and len(counts) == 1


def grid_plan(devices: list[int], tp: int, pp: int, dp: int, microbatches: int, num_layers: int, epoch: int,
              schedule: str) -> Plan:
    """The grid's plan, devices taken in order: replica-major, then stage, then TP rank."""
    ranges = even_layer_ranges(num_layers, pp)
    it = iter(devices)
    pipelines = tuple(PipelinePlan(replica=r, microbatches=microbatches, stages=tuple(
        StagePlan(devices=tuple(next(it) for _ in range(tp)), first_layer=ranges[s][0], end_layer=ranges[s][1])
        for s in range(pp))) for r in range(dp))
    return Plan.model_validate({"epoch": epoch, "schedule": schedule if pp > 1 else "1f1b", "num_layers": num_layers,
                                "pipelines": pipelines})


def uniform_plans(cluster: ClusterState, model: PlannerModel, current: Plan, *, change_tp: bool = True,
                  change_pp: bool = True) -> list[Plan]:
    """Every uniform layout on the healthy devices that keeps the global batch and fits in memory,
    except the running one (``change_tp`` / ``change_pp`` False: that degree stays as it runs)."""
    healthy = [d for d in current.devices if cluster.is_healthy(d)]
    healthy += [d for d in range(cluster.num_devices) if d not in healthy and d not in current.devices
                and cluster.is_healthy(d)]
    tps = {s.tp for p in current.pipelines for s in p.stages}
    run_tp, run_pp = max(tps), max(len(p.stages) for p in current.pipelines)
    M = current.global_microbatches
    capacity = cluster.hardware.state_capacity_bytes
    out: list[Plan] = []
    for pp in range(1, min(model.num_layers, len(healthy)) + 1):
        if not change_pp and pp != run_pp:
            continue
        for tp in range(1, len(healthy) // pp + 1):
            if run_tp % tp or (not change_tp and tp != run_tp):
                continue  # a divisor of the running degree: it divides the heads and widths the running one did
            stage_layers = -(-model.num_layers // pp)
            if stage_layers * model.layer_state_bytes / tp > capacity:
                continue
            for dp in range(1, len(healthy) // (pp * tp) + 1):
                if M % dp or M // dp < pp:
                    continue  # the global batch kept, split evenly; a pipeline needs a micro-batch per stage
                plan = grid_plan(healthy[:tp * pp * dp], tp, pp, dp, M // dp, model.num_layers, current.epoch + 1,
                                 current.schedule)
                if plan.pipelines != current.pipelines:
                    out.append(plan)
    return out
