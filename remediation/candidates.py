"""The ways one pipeline can be rebuilt around its bad devices (TP × PP, joint), and what each
costs to reach.

For every stage that holds a bad device the options are: keep it as is (only if none of its
devices is dead: a slow member slows the whole TP group); shrink it to the largest power-of-two
group of its good devices; re-form its good devices into several smaller power-of-two groups,
each a stage of its own (7 good GPUs → TP 4 + TP 2 + TP 1), so no healthy device is idle; or
remove it and let the other stages take its layers. The options of all damaged stages are
combined (a product, capped), and for each combination the layers of the whole pipeline are
re-split so that slow or narrow stages get fewer (remediation.partition). Healthy stages keep their
TP groups. Dropping the whole replica is the last candidate.

What can go wrong: a combination whose stages cannot hold the model's state is discarded; if
every combination is, only "drop" is left and the DP allocation absorbs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from collector.plan import PipelinePlan
from remediation.cluster import ClusterState
from remediation.costs import StageLayout, StageTimes, dp_allreduce_s, max_layers, stage_cost, stage_times
from remediation.model import PlannerModel
from remediation.partition import balanced_partition


@dataclass(frozen=True)
class PlannerOptions:
    """Which dimensions the planner may change, and the economics of changing them.

    horizon_s: expected time until the next change (new fault, repair); a reshape is worth it
        only if its gain over that horizon beats its cost.
    pause_s: training pause of a structural reshape (rebuild process groups, move state).
    rebalance_pause_s: pause of a micro-batch-only change (no state moves).
    free_reshape: the oracle's privilege — reshapes cost nothing.
    prefer_rebalance_within: when the best plan re-forms groups or moves layers, the best
        micro-batch-only rebalance is offered beside it (``PlanResult.rebalance``) if it trains
        within this fraction of it over the horizon; the apply rule then takes the rebalance.
    """

    allow_tp: bool = True
    allow_pp: bool = True
    allow_dp: bool = True
    allow_drop: bool = True
    exclude_slow: bool = True
    horizon_s: float = 1800.0
    pause_s: float = 15.0
    rebalance_pause_s: float = 1.0
    checkpoint_restore_s: float = 300.0
    free_reshape: bool = False
    prefer_rebalance_within: float = 0.005
    max_combinations: int = 64
    uniform_only: bool = False  # the executor runs one regular grid: plan among uniform layouts (remediation/uniform.py)
    uniform_tp: bool = True  # with uniform_only: the grid's TP degree may change
    uniform_pp: bool = True  # with uniform_only: the grid's stage count may change


@dataclass(frozen=True)
class PipelineCandidate:
    """One way to run the pipeline that was replica ``source_replica``.

    stages empty means dropped. ``origin[i]`` is the old stage index new stage i came from.
    """

    source_replica: int
    label: str
    stages: tuple[StageLayout, ...]
    origin: tuple[int, ...]
    times: StageTimes | None
    dp_s: float
    move_s: float  # time to move the state this layout needs (stages receive in parallel)
    structural: bool  # any TP group or layer range differs from the current pipeline

    @property
    def dropped(self) -> bool:
        return not self.stages

    @property
    def running_times(self) -> StageTimes:
        """The stage times of a pipeline that runs; a dropped one has none to score."""
        if self.times is None:
            raise ValueError(f"candidate {self.label!r} drops its pipeline: it has no stage times to score")
        return self.times


def _pow2_parts(n: int) -> list[int]:
    """7 → [4, 2, 1]: the binary decomposition, largest first."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def _stage_options(
    cluster: ClusterState, devices: tuple[int, ...], opts: PlannerOptions
) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(label, list of TP groups) options for one damaged stage."""
    alive = tuple(d for d in devices if not cluster.is_dead(d))
    healthy = tuple(d for d in devices if cluster.is_healthy(d))
    out: list[tuple[str, list[tuple[int, ...]]]] = []
    if len(alive) == len(devices):
        out.append(("keep", [devices]))
    if opts.allow_tp:
        pools = []
        if opts.exclude_slow and healthy:
            pools.append(healthy)
        if len(alive) != len(devices) and alive and alive != healthy:
            pools.append(alive)  # a dead member: shrinking around it but keeping the slow ones
        for pool in pools:
            parts = _pow2_parts(len(pool))
            ks = range(1, len(parts) + 1) if opts.allow_pp else range(1, 2)
            for k in ks:
                groups, i = [], 0
                for size in parts[:k]:
                    groups.append(pool[i:i + size])
                    i += size
                if groups == [devices]:
                    continue
                label = f"TP {len(devices)}→{'+'.join(str(len(g)) for g in groups)}"
                out.append((label, groups))
    if opts.allow_pp:
        out.append(("remove stage", []))
    return out


def _move_s(
    cluster: ClusterState, model: PlannerModel, old: PipelinePlan, new: Sequence[StageLayout], opts: PlannerOptions,
    dp: int,
) -> tuple[float, bool]:
    """(seconds to move state into the new stages, structural?). A layer moves when the TP group
    that will hold it is not exactly the one that holds it now; it comes from a DP peer (or from a
    checkpoint when there is none and its old holder is dead)."""
    owner: list[tuple[int, ...]] = [()] * model.num_layers
    for held in old.stages:
        for layer in range(held.first_layer, held.end_layer):
            owner[layer] = held.devices
    worst = 0.0
    structural = len(new) != len(old.stages)
    needs_checkpoint = False
    bw = cluster.hardware.link_bandwidth_Bps
    for st in new:
        moved = 0
        for layer in range(st.first_layer, st.end_layer):
            if owner[layer] != st.devices:
                moved += 1
                if dp == 1 and any(cluster.is_dead(d) for d in owner[layer]):
                    needs_checkpoint = True
        if moved:
            structural = True
            worst = max(worst, moved * model.layer_state_bytes / (len(st.devices) * bw))
    if needs_checkpoint:
        worst += opts.checkpoint_restore_s
    return worst, structural


def build_candidate(
    cluster: ClusterState, model: PlannerModel, old: PipelinePlan, groups: Sequence[tuple[int, ...]],
    origin: Sequence[int], label: str, schedule: str, opts: PlannerOptions, dp: int,
    layer_ranges: Sequence[tuple[int, int]] | None = None,
) -> PipelineCandidate | None:
    """A candidate from TP groups in pipeline order; layers re-split unless ``layer_ranges`` is
    given. None when the groups cannot hold the model."""
    if not groups:
        return None
    if layer_ranges is None:
        bf = model.backward_factor
        costs = [stage_cost(cluster, model, g, last=i == len(groups) - 1) for i, g in enumerate(groups)]
        per_layer = [(1 + bf) * c.per_layer_compute_s + 2 * c.per_layer_fixed_s for c in costs]
        caps = [max_layers(cluster, model, len(g)) for g in groups]
        layer_ranges = balanced_partition(model.num_layers, per_layer, caps, [(1 + bf) * c.head_s for c in costs])
        if layer_ranges is None:
            return None
    else:
        for g, (a, b) in zip(groups, layer_ranges):
            if b - a > max_layers(cluster, model, len(g)):
                return None
    stages = tuple(StageLayout(tuple(g), a, b) for g, (a, b) in zip(groups, layer_ranges))
    move_s, structural = _move_s(cluster, model, old, stages, opts, dp)
    return PipelineCandidate(
        source_replica=old.replica, label=label, stages=stages, origin=tuple(origin),
        times=stage_times(cluster, model, stages, schedule), dp_s=dp_allreduce_s(cluster, model, stages, dp),
        move_s=move_s, structural=structural,
    )


def dropped(old: PipelinePlan) -> PipelineCandidate:
    return PipelineCandidate(old.replica, "drop replica", (), (), None, 0.0, 0.0, True)


def pipeline_candidates(
    cluster: ClusterState, model: PlannerModel, old: PipelinePlan, schedule: str, opts: PlannerOptions, dp: int,
) -> list[PipelineCandidate]:
    """Every candidate for one pipeline (the unchanged one first when it can still run)."""
    bad_stages = [s for s, st in enumerate(old.stages) if any(not cluster.is_healthy(d) for d in st.devices)]
    per_stage = {s: _stage_options(cluster, old.stages[s].devices, opts) for s in bad_stages}
    combos = list(itertools.islice(itertools.product(*(per_stage[s] for s in bad_stages)), opts.max_combinations))
    out: list[PipelineCandidate] = []
    current_ranges = [(st.first_layer, st.end_layer) for st in old.stages]
    for combo in combos:
        choice = dict(zip(bad_stages, combo))
        groups: list[tuple[int, ...]] = []
        origin: list[int] = []
        for s, st in enumerate(old.stages):
            if s in choice:
                for g in choice[s][1]:
                    groups.append(g)
                    origin.append(s)
            else:
                groups.append(st.devices)
                origin.append(s)
        labels = [f"stage {s}: {choice[s][0]}" for s in bad_stages if choice[s][0] != "keep"]
        same_shape = len(groups) == len(old.stages)
        if same_shape and all(choice[s][0] == "keep" for s in bad_stages):
            kept = build_candidate(cluster, model, old, groups, origin, "keep", schedule, opts, dp, current_ranges)
            if kept is not None:
                out.append(kept)
        if opts.allow_pp:
            cand = build_candidate(cluster, model, old, groups, origin, "; ".join(labels + ["re-split layers"]),
                                   schedule, opts, dp)
            if cand is not None:
                out.append(cand)
        elif same_shape and labels:
            cand = build_candidate(cluster, model, old, groups, origin, "; ".join(labels), schedule, opts, dp,
                                   current_ranges)
            if cand is not None:
                out.append(cand)
    if opts.allow_drop or not out:
        out.append(dropped(old))
    return out


def unchanged_candidate(
    cluster: ClusterState, model: PlannerModel, old: PipelinePlan, schedule: str, opts: PlannerOptions, dp: int,
) -> PipelineCandidate | None:
    """The pipeline exactly as it runs now, or None if a device of it is dead."""
    if any(cluster.is_dead(d) for st in old.stages for d in st.devices):
        return None
    groups = [st.devices for st in old.stages]
    return build_candidate(cluster, model, old, groups, range(len(groups)), "keep", schedule, opts, dp,
                           [(st.first_layer, st.end_layer) for st in old.stages])


def regrow_candidate(
    cluster: ClusterState, model: PlannerModel, old: PipelinePlan, idle: dict[int, tuple[int, ...]], schedule: str,
    opts: PlannerOptions, dp: int, tp: int | None = None,
) -> PipelineCandidate | None:
    """Re-form this pipeline's TP groups with healthy idle devices of their nodes (devices an
    earlier reshape excluded, now repaired): consecutive stages on one node and the node's idle
    devices become the largest power-of-two groups again (TP 4+2+1 and a repaired GPU → TP 8),
    or, with ``tp``, groups of that size first (the job's own degree: TP 1 + TP 2 and a repaired
    GPU → TP 2 + TP 2, where the largest groups would make one TP 4 stage).
    None when nothing would change or the result cannot hold the model. ``idle`` maps a node to
    the idle healthy devices given to this pipeline there (the planner gives each to one pipeline)."""
    per = cluster.hardware.devices_per_node
    runs: list[tuple[int | None, list[int]]] = []  # (node or None, old stage indices)
    for s, st in enumerate(old.stages):
        nodes = {d // per for d in st.devices}
        node = next(iter(nodes)) if len(nodes) == 1 else None
        if node is not None and runs and runs[-1][0] == node:
            runs[-1][1].append(s)
        else:
            runs.append((node, [s]))
    groups: list[tuple[int, ...]] = []
    origin: list[int] = []
    grew = []
    for node, stages in runs:
        extra = idle.get(node, ()) if node is not None else ()
        current = [old.stages[s].devices for s in stages]
        if not extra or any(not cluster.is_healthy(d) for g in current for d in g):
            groups.extend(current)
            origin.extend(stages)
            continue
        pool = tuple(sorted({d for g in current for d in g} | set(extra)))
        parts = [tp] * (len(pool) // tp) + _pow2_parts(len(pool) % tp) if tp else _pow2_parts(len(pool))
        parts = parts if opts.allow_pp else parts[: len(stages)]
        new, i = [], 0
        for size in parts:
            new.append(pool[i:i + size])
            i += size
        if [len(g) for g in new] == [len(g) for g in current] and sum(map(len, new)) == sum(map(len, current)):
            groups.extend(current)
            origin.extend(stages)
            continue
        grew.append(f"stages {stages[0]}–{stages[-1]}: TP {'+'.join(str(len(g)) for g in current)}→"
                    f"{'+'.join(str(len(g)) for g in new)}")
        groups.extend(new)
        origin.extend([stages[0]] * len(new))
    if not grew:
        return None
    label = "; ".join(grew) + " (re-grow on repaired devices)"
    if not opts.allow_pp and len(groups) != len(old.stages):
        return None
    ranges = None if opts.allow_pp else [(st.first_layer, st.end_layer) for st in old.stages]
    return build_candidate(cluster, model, old, groups, origin, label, schedule, opts, dp, ranges)
