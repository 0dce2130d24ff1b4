"""One device's part of a native job under one plan: mesh, stage model, schedule, optimizer.

``NativeRole.build`` runs the parallelisation steps in order; ``train_step`` runs one iteration:
this replica's share of the global batch's micro-batches through torch's 1F1B schedule, the sum
of gradients across replicas (FSDP's reduce-scatter on a grid stage, ``FullGradSum`` on any other),
then AdamW and the LR scheduler. The same global batch and the
same loss scaling in every layout: micro-batch ids come from trainer/data.py by the plan's
per-replica counts, and each micro-batch's loss is divided by the global batch's target tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from collector.plan import RankRole
from trainer.data import IGNORE, MicroBatch, global_targets, microbatch, replica_microbatch_ids
from trainer.native.dtensor_rules import install_stage_build_shortcuts
from trainer.native.groups import GroupCache
from trainer.native.layout import NativeLayout
from trainer.native.model import LlamaConfig, ModelFactory, build_model
from trainer.native.grad_sum import FullGradSum
from trainer.native.parallelize import (DpMode, apply_dp, apply_pp, apply_tp, build_mesh, build_optimizer,
                                        pipeline_stage, stage_group)
from trainer.native.telemetry import ScheduleWatcher
from trainer.telemetry import IterationRecorder


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    block_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_iterations: int = 4
    dp_mode: DpMode = "shard"  # how replicas hold a stage: FSDP shards, or whole copies (parallelize.apply_dp)


class GlobalTokenLoss:
    """Cross-entropy summed over a micro-batch's targets, divided by the *global* batch's target
    count (set per iteration): micro-batch losses then add up to the global mean loss wherever
    they ran."""

    def __init__(self) -> None:
        self.denominator = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=IGNORE, reduction="sum") / self.denominator


@dataclass
class NativeRole:
    layout: NativeLayout
    role: RankRole
    mesh: DeviceMesh
    model: nn.Module
    stage: PipelineStage
    schedule: PipelineScheduleSingle
    loss: GlobalTokenLoss
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    watcher: ScheduleWatcher
    world: dist.ProcessGroup  # this layout's world: the iteration's commit all-reduce, DCP
    params: tuple[tuple[str, nn.Parameter], ...]  # the managed (sharded) parameters by name, as built: what moves
    grad_sum: FullGradSum | None  # a non-grid stage's replicas: their gradient sum (grad_sum.py); FSDP's otherwise
    last_recorder: IterationRecorder | None = None

    @classmethod
    def build(cls, layout: NativeLayout, device: int, cfg: LlamaConfig, settings: TrainSettings,
              torch_device: torch.device, groups: GroupCache, rank_of: dict[int, int],
              model_factory: ModelFactory = build_model, mesh: DeviceMesh | None = None) -> NativeRole:
        """Every world rank calls this together (a group new to this rank set is created by its
        members). The weights are the seed's initial ones; a reshape then loads the moved state
        over them. No collective runs on the parameters: each rank cuts its own shards. ``mesh``:
        the layout's mesh when the caller built it already (a reshape's new_mesh phase)."""
        install_stage_build_shortcuts()
        role = layout.role(device)
        world = groups.get("world", [rank_of[d] for d in layout.world], layout.plan.epoch)
        mesh = mesh or build_mesh(layout, torch_device.type, groups, rank_of, device)
        model = apply_pp(model_factory(cfg, settings.seed), role).to(torch_device)
        apply_tp(model, mesh["tp"])
        if "dp" in (mesh.mesh_dim_names or ()):
            apply_dp(model, mesh["dp"], settings.dp_mode)
        stage = pipeline_stage(model, cfg, layout, device, torch_device, groups, rank_of, world, settings.block_size)
        loss = GlobalTokenLoss()
        schedule = Schedule1F1B(stage, n_microbatches=role.microbatches, loss_fn=loss, scale_grads=False)
        opt, sched = build_optimizer(model, settings.lr, settings.weight_decay, settings.warmup_iterations)
        params = tuple(model.named_parameters())
        summed = stage_group(layout, groups, rank_of, device)
        grad_sum = FullGradSum(params, role.tp_rank, summed) if summed is not None else None
        return cls(layout, role, mesh, model, stage, schedule, loss, opt, sched, ScheduleWatcher(stage), world,
                   params, grad_sum)

    def with_counts(self, layout: NativeLayout, device: int) -> NativeRole:
        """This role under ``layout``, a plan that changes only micro-batch counts: the mesh,
        model, stage and optimizer stay; only the schedule is made for the new count."""
        role = layout.role(device)
        schedule = Schedule1F1B(self.stage, n_microbatches=role.microbatches, loss_fn=self.loss, scale_grads=False)
        return dataclasses.replace(self, layout=layout, role=role, schedule=schedule, last_recorder=None)

    def microbatches(self, iteration: int, cfg: LlamaConfig, settings: TrainSettings) -> list[MicroBatch]:
        ids = replica_microbatch_ids(self.layout.plan, self.role.replica)
        return [microbatch(settings.seed, iteration, m, cfg.vocab_size, settings.block_size) for m in ids]

    def train_step(self, iteration: int, cfg: LlamaConfig, settings: TrainSettings,
                   on_commit: Callable[[], None] | None = None) -> float:
        """One iteration; returns the global loss (the sum over every replica's last stage),
        known to every rank. Raises if a peer died (nothing is stepped then). ``on_commit`` is
        called once every rank got to the commit: what is left is this rank's own work."""
        plan = self.layout.plan
        mbs = self.microbatches(iteration, cfg, settings)
        self.loss.denominator = global_targets(settings.seed, iteration, plan.global_microbatches, settings.block_size)
        dev = self.stage.device
        # the replica's micro-batches stacked on the batch dimension: the schedule splits them back
        # into one row each (the public step() of every torch release since pipelining landed)
        tokens = torch.stack([mb.tokens for mb in mbs]).to(dev)  # (M, T)
        positions = torch.stack([mb.positions for mb in mbs]).to(dev)  # (M, T)
        targets = torch.stack([mb.targets for mb in mbs]).to(dev)  # (M, T)
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.watcher.begin(mbs)
        try:
            inputs = (tokens,) if self.role.stage == 0 else ()
            self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False, positions=positions)
        finally:
            self.last_recorder = self.watcher.end()
        total = torch.zeros(1, dtype=torch.float64, device=dev)
        if self.stage.is_last and self.role.tp_rank == 0:
            total += sum(float(x.detach()) for x in losses)
        if self.grad_sum is not None:
            self.grad_sum()
        dist.all_reduce(total, group=self.world)  # the commit: nothing is stepped unless every rank got here
        if on_commit is not None:
            on_commit()
        self.opt.step()
        self.sched.step()
        return float(total)


def reference_losses(cfg: LlamaConfig, settings: TrainSettings, global_microbatches_per_iteration: list[int],
                     model_factory: ModelFactory = build_model) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no parallelism: the losses per iteration and the final parameters, for the
    same global batches (iteration i runs micro-batches 0..n_i-1). What every layout must equal."""
    model = model_factory(cfg, settings.seed)
    opt, sched = build_optimizer(model, settings.lr, settings.weight_decay, settings.warmup_iterations)
    loss_fn = GlobalTokenLoss()
    out = []
    for it, n in enumerate(global_microbatches_per_iteration):
        loss_fn.denominator = global_targets(settings.seed, it, n, settings.block_size)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(n):
            mb = microbatch(settings.seed, it, m, cfg.vocab_size, settings.block_size)
            loss = loss_fn(model(mb.tokens[None], positions=mb.positions[None]), mb.targets[None])
            loss.backward()
            total += float(loss.detach())
        opt.step()
        sched.step()
        out.append(total)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}
