"""TP, PP and DP applied as separate steps from a ``collector.plan.Plan`` (torchtitan's habit).

* ``PlanWorld``: one epoch's world — the plan plus the live devices in world-rank order.
* ``build_groups``: every process group the plan needs (TP groups, DP reduction groups), created by
  every world member in one deterministic order, as c10d requires.
* ``apply_pp`` + ``apply_tp``: build the stage this device runs (its layer range) with its TP
  context; ``init_stage`` (trainer/reference/model.py) fills it with its slice of the canonical model.
* ``apply_dp``: a ``GradReducer`` that makes every replica's gradient the global-batch gradient.

DP across replicas that may differ in TP degree and layer ranges: each model *unit* (embeddings,
one layer, the head) is owned by one TP group per replica. If every replica's owner group has the
same TP degree, the devices holding the same shard all-reduce that shard ("shard" mode). If not,
each owner group all-gathers its unit's gradient to full size, TP rank 0 of every owner group
contributes it and the other members zeros (exact for any degree, 3 included), the owners of all
replicas all-reduce full gradients, and each takes its shard back ("full" mode). Units with the same reducing devices share one flat bucket, so
a uniform layout costs one all-reduce per TP rank per stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist

from collector.plan import Plan, RankRole, StagePlan
from trainer.reference.chunks import all_units, role_chunks, stage_chunks, units_of_chunks
from trainer.agent.wake import wait
from trainer.reference.model import GPTConfig, GPTStage, TPContext, shard_rule, unit_of, unshard


def owner_stage(plan: Plan, replica_index: int, unit: str) -> StagePlan:
    """The stage of one replica (by position in ``plan.pipelines``) that owns ``unit`` (under the
    interleaved schedule a stage owns the union of its chunks, see trainer/reference/chunks.py)."""
    for s, st in enumerate(plan.pipelines[replica_index].stages):
        if unit in units_of_chunks(plan.num_layers, stage_chunks(plan, replica_index, s)):
            return st
    raise KeyError(f"unit {unit} has no owner in replica {replica_index} of plan epoch {plan.epoch}")


@dataclass(frozen=True)
class Bucket:
    """Units whose gradients one set of devices all-reduces together."""

    devices: tuple[int, ...]
    units: tuple[str, ...]
    full: tuple[bool, ...]  # per unit: reduce full gradients (mixed TP degrees) or shards


@dataclass
class PlanWorld:
    """One epoch: the plan and the world (live devices, world rank = position)."""

    plan: Plan
    world: tuple[int, ...]

    def rank(self, device: int) -> int:
        return self.world.index(device)

    @cached_property
    def buckets(self) -> list[Bucket]:
        by_devices: dict[tuple[int, ...], list[tuple[str, bool]]] = {}
        for unit in all_units(self.plan.num_layers):
            owners = [owner_stage(self.plan, r, unit).devices for r in range(self.plan.dp)]
            if len(owners) == 1:
                continue
            if len({len(g) for g in owners}) == 1:
                for t in range(len(owners[0])):
                    by_devices.setdefault(tuple(sorted(g[t] for g in owners)), []).append((unit, False))
            else:
                by_devices.setdefault(tuple(sorted(d for g in owners for d in g)), []).append((unit, True))
        return [Bucket(k, tuple(u for u, _ in v), tuple(f for _, f in v)) for k, v in sorted(by_devices.items())]

    def group_keys(self) -> list[tuple[int, ...]]:
        keys = {tuple(sorted(st.devices)) for p in self.plan.pipelines for st in p.stages if st.tp > 1}
        keys |= {b.devices for b in self.buckets}
        return sorted(keys)


def keeps_groups(running: PlanWorld, plan: Plan, world: tuple[int, ...]) -> bool:
    """``plan`` on ``world`` changes only how many micro-batches each replica runs: the same world,
    schedule and stages, replica by replica. Every process group and every shard stays valid, so
    the ranks can switch at an iteration boundary without re-forming the world or moving state.
    A pure function of the two plans and the world, so every rank decides alike."""
    return world == running.world and running.plan.same_stages(plan)


@dataclass
class Groups:
    """The process groups this device belongs to, by their sorted device tuple."""

    by_devices: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    def get(self, devices: tuple[int, ...]) -> dist.ProcessGroup:
        key = tuple(sorted(devices))
        if key not in self.by_devices:
            raise KeyError(f"this device is not in the group of devices {key}; only members run its collectives")
        return self.by_devices[key]


def build_groups(layout: PlanWorld, timeout_s: float) -> Groups:
    """Create every group the layout needs. Every world member must call this (same order), also
    for the groups it is not in: torch hands it a placeholder for those, which is not kept."""
    groups = Groups()
    for key in layout.group_keys():
        group = dist.new_group([layout.rank(d) for d in key], timeout=timedelta(seconds=timeout_s))
        if isinstance(group, dist.ProcessGroup):
            groups.by_devices[key] = group
    return groups


def build_world_group(layout: PlanWorld, timeout_s: float) -> dist.ProcessGroup:
    """The group of the whole world, for the commit all-reduce and the barriers, with the
    training timeout rather than the rendezvous one of the default group."""
    group = dist.new_group(list(range(len(layout.world))), timeout=timedelta(seconds=timeout_s))
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"this process is not in the world {layout.world} it joined; join_world before building")
    return group


def apply_pp(cfg: GPTConfig, plan: Plan, role: RankRole, tp: TPContext) -> GPTStage:
    """The pipeline step: this device builds only its stage's layers — one chunk, or V chunks
    under the interleaved schedule — plus the embeddings / head where its chunks hold them."""
    return GPTStage(cfg, role_chunks(plan, role), tp)


def apply_tp(plan: Plan, role: RankRole, groups: Groups) -> TPContext:
    """The TP step: the context whose collectives Attention and MLP call (f and g of Megatron)."""
    if role.tp_degree == 1:
        return TPContext()
    devices = plan.pipelines[_replica_index(plan, role.replica)].stages[role.stage].devices
    return TPContext(groups.get(devices), role.tp_degree, role.tp_rank)


def _replica_index(plan: Plan, replica: int) -> int:
    return next(i for i, p in enumerate(plan.pipelines) if p.replica == replica)


def gather_tp(pieces_local: torch.Tensor, tp: TPContext, tp_devices: tuple[int, ...], layout: PlanWorld) -> list[torch.Tensor]:
    """All-gather a flat tensor inside the TP group; returns the pieces in TP-rank order."""
    out = [torch.empty_like(pieces_local) for _ in tp_devices]
    wait(dist.all_gather(out, pieces_local.contiguous(), group=tp.group, async_op=True), "tp all_gather (gradients)")
    by_rank = sorted(tp_devices, key=layout.rank)  # group rank order is world-rank order
    return [out[by_rank.index(d)] for d in tp_devices]


class GradReducer:
    """The DP step: turn this replica's gradient into the global-batch gradient, in place."""

    def __init__(self, stage: GPTStage, layout: PlanWorld, role: RankRole, groups: Groups, timer=None) -> None:
        self.stage, self.layout, self.role, self.groups = stage, layout, role, groups
        self.params = dict(stage.named_parameters())
        self.tp_devices = layout.plan.pipelines[_replica_index(layout.plan, role.replica)].stages[role.stage].devices
        self.timer = timer

    def unit_params(self, unit: str) -> list[tuple[str, torch.nn.Parameter]]:
        return sorted((n, p) for n, p in self.params.items() if unit_of(n) == unit)

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def reduce(self) -> None:
        my = self.role.device
        mine = [b for b in self.layout.buckets if my in b.devices]
        tp = self.stage.tp
        # Phase 1 (inside the TP group): full gradients of the units reduced in "full" mode.
        full: dict[str, list[torch.Tensor]] = {}
        for b in mine:
            for unit, is_full in zip(b.units, b.full):
                if not is_full:
                    continue
                named = self.unit_params(unit)
                flat = torch.cat([self._grad(p).reshape(-1) for _, p in named])
                pieces = [flat] if tp.degree == 1 else gather_tp(flat, tp, self.tp_devices, self.layout)
                grads = []
                for i, (name, p) in enumerate(named):
                    at = sum(q.numel() for _, q in named[:i])
                    parts = [pc[at:at + p.numel()].view_as(p) for pc in pieces]
                    whole = unshard(parts, shard_rule(name))
                    # every member holds the same full gradient; one copy per owner group enters the sum
                    grads.append(whole if tp.rank == 0 else torch.zeros_like(whole))
                full[unit] = grads
        # Phase 2 (across replicas): one flat all-reduce per bucket, in the layout's global order.
        for b in mine:
            chunks = []
            for unit, is_full in zip(b.units, b.full):
                tensors = full[unit] if is_full else [self._grad(p) for _, p in self.unit_params(unit)]
                chunks += [t.reshape(-1) for t in tensors]
            flat = torch.cat(chunks)
            with self.timer() if self.timer else contextlib.nullcontext():
                wait(dist.all_reduce(flat, group=self.groups.get(b.devices), async_op=True), "dp all_reduce (gradients)")
            at = 0
            for unit, is_full in zip(b.units, b.full):
                for i, (name, p) in enumerate(self.unit_params(unit)):
                    if is_full:
                        shape = full[unit][i].shape
                        n = full[unit][i].numel()
                        whole = flat[at:at + n].view(shape)
                        rule = shard_rule(name)
                        piece = whole if rule == "rep" or tp.degree == 1 else whole.chunk(tp.degree, 0 if rule == "col" else 1)[tp.rank]
                        self._grad(p).copy_(piece)
                    else:
                        n = p.numel()
                        self._grad(p).copy_(flat[at:at + n].view_as(p))
                    at += n


def apply_dp(stage: GPTStage, layout: PlanWorld, role: RankRole, groups: Groups, timer=None) -> GradReducer:
    return GradReducer(stage, layout, role, groups, timer)
