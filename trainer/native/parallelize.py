"""Apply TP, PP and DP to the decoder, one step each (torchtitan's ``parallelize_llama`` shape).

    mesh = build_mesh(layout, ...)                  # this stage's DeviceMesh: (dp, tp), or (tp,) alone
    model = apply_pp(build_model(cfg, seed), role)  # keep this stage's layers
    apply_tp(model, mesh["tp"])                     # DTensor colwise / rowwise plan
    apply_dp(model, mesh["dp"])                     # FSDP2 fully_shard per block, then the root (grid stages)
    stage = pipeline_stage(model, role, ...)        # trainer/native/pipeline.py's MappedStage

Each pipeline stage has its own mesh (trainer/native/layout.py): a stage every replica holds at
one TP degree, cut evenly, is a (dp, tp) grid with FSDP2 over dp; any other stage is one (tp,)
mesh per replica, whose replicas sum full gradients instead (``apply_grad_sum``,
trainer/native/grad_sum.py). Gradients are *summed* across replicas (FSDP's divide factor 1) and
every micro-batch's loss is divided by the global batch's target-token count, so a replica may
run any number of the global batch's micro-batches and the update is the same as one process
running them all. The steps work on any module with the torchtitan Llama layout (``layers`` as a
ModuleDict of blocks with ``attention.wq/wk/wv/wo`` and ``feed_forward.w1/w2/w3``);
``tp_plan_for_block`` is the one place that names those submodules.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from collector.plan import RankRole, stage_peers
from trainer.native.groups import GroupCache
from trainer.native.layout import NativeLayout
from trainer.native.model import LlamaConfig, keep_layers
from trainer.native.pipeline import MappedStage, static_meta

DpMode = Literal["shard", "replicate"]


def build_mesh(layout: NativeLayout, device_type: str, groups: GroupCache, rank_of: dict[int, int],
               device: int) -> DeviceMesh:
    """This device's stage mesh under ``layout``, from groups taken from ``groups`` (created once
    per rank set, by their members only, and reused by later layouts, so DTensor's caches, keyed
    by mesh equality, always meet the groups they were made with): a grid stage's (dp, tp) mesh
    over every replica's TP group, else the (tp,) mesh of this replica's group alone. ``rank_of``
    maps a device to its rank in the job's default group.

    A TP group's mesh lists its ranks in ascending order whatever order the plan names its devices
    in: a mesh coordinate must be the rank's place in its process group, whose collectives order
    their pieces by group rank (a group listed 1, 0 would otherwise gather its shards swapped).
    Only the shard a rank holds follows the mesh; the plan's TP index still routes activations."""
    role, epoch = layout.role(device), layout.plan.epoch
    held = [sorted(rank_of[d] for d in g) for g in layout.stage_groups(role.stage)]
    mine = held[role.replica]
    if layout.grid[role.stage]:
        column = mine.index(rank_of[device])
        ranks = torch.tensor(held)  # (dp, tp)
        slices = {"dp": ranks[:, column].tolist(), "tp": mine}
        dims = [groups.get(name, slices[name], epoch) for name in ("dp", "tp")]
        return DeviceMesh.from_group(dims, device_type, mesh=ranks, mesh_dim_names=("dp", "tp"))
    return DeviceMesh.from_group(groups.get("tp", mine, epoch), device_type, mesh=mine, mesh_dim_names=("tp",))


def stage_group(layout: NativeLayout, groups: GroupCache, rank_of: dict[int, int], device: int
                ) -> dist.ProcessGroup | None:
    """Every device of this device's stage in every replica, when the stage is not a grid and has
    more than one replica: the group its full gradients are summed over (else None)."""
    stage = layout.role(device).stage
    if layout.grid[stage] or layout.dp == 1:
        return None
    return groups.get("stage", [rank_of[d] for g in layout.stage_groups(stage) for d in g], layout.plan.epoch)


def apply_pp(model: Any, role: RankRole) -> Any:
    """Keep only this device's stage of the model (its layers; embedding on the first stage,
    norm and output on the last)."""
    return keep_layers(model, role.first_layer, role.end_layer)


def tp_plan_for_block() -> dict[str, ParallelStyle]:
    """Megatron's split of one decoder block: q/k/v and the SwiGLU gates column-parallel (each TP
    rank holds whole heads / a slice of the hidden width), wo and w2 row-parallel (one all-reduce
    each on the way out). The gates' outputs stay DTensors into w2: a plain local tensor would be
    taken back as an even shard (``from_local``), which a width that does not divide by the TP
    degree (100 over TP 3: 34/34/32) is not."""
    return {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(use_local_output=False),
        "feed_forward.w3": ColwiseParallel(use_local_output=False),
        "feed_forward.w2": RowwiseParallel(),
    }


def apply_tp(model: Any, tp_mesh: DeviceMesh) -> None:
    """DTensor tensor parallelism over ``tp_mesh`` (skipped at TP 1: plain tensors train the same).
    Each rank cuts its shard from its own copy (``src_data_rank=None``): every rank built the same
    seeded model, so scattering rank 0's copy (one collective per parameter) would only cost time."""
    if tp_mesh.size() == 1:
        return
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top, src_data_rank=None)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, tp_plan_for_block(), src_data_rank=None)


def apply_dp(model: Any, dp_mesh: DeviceMesh, mode: DpMode = "shard") -> None:
    """Data parallelism over ``dp_mesh``, each block, then the root, with gradients summed (not
    averaged) across replicas. ``shard``: FSDP2 ``fully_shard``; parameters stay gathered from the
    first micro-batch's forward to the iteration's last backward (``reshard_after_forward=False``,
    ZeRO-2-like), so the collectives are one all-gather and one reduce-scatter per module per
    iteration whatever the micro-batch count, and replicas running different shares of the
    global batch (a DP migration) still issue the same collectives. ``replicate``: FSDP2's
    ``replicate`` (DDP on the same machinery: one all-reduce per module per iteration); every
    replica holds the whole stage and its AdamW state, so a replica that dies loses nothing its
    peers do not hold. Skipped at DP 1."""
    if dp_mesh.size() == 1:
        return
    for block in model.layers.values():
        _data_parallel(block, dp_mesh, mode)
    _data_parallel(model, dp_mesh, mode)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def _data_parallel(module: nn.Module, dp_mesh: DeviceMesh, mode: DpMode) -> None:
    if mode == "replicate":
        replicate(module, mesh=dp_mesh)
    else:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)


def pipeline_stage(model: nn.Module, cfg: LlamaConfig, layout: NativeLayout, device: int, torch_device: torch.device,
                   groups: GroupCache, rank_of: dict[int, int], world: dist.ProcessGroup, block: int) -> MappedStage:
    """torch's ``PipelineStage`` with this rank's peers by the contract's rule (neighbouring
    stages may run at other TP degrees) and its shapes given up front (no shape inference)."""
    role = layout.role(device)
    pipe = layout.plan.pipelines[role.replica]
    example = static_meta(role, cfg.dim, cfg.vocab_size, block, cfg.torch_dtype, torch_device)
    solo = groups.get("solo", [rank_of[device]], layout.plan.epoch)
    return MappedStage(model, role, torch_device, stage_peers(pipe, role.stage, role.tp_rank), rank_of, world, solo,
                       example)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, warmup_iterations: int
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """torch's AdamW over the (DTensor) parameters and a linear-warmup, cosine-to-10 % schedule
    stepped once per iteration; both are part of the state a reshape moves."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: warmup_then_cosine(it, warmup_iterations))
    return opt, sched


def warmup_then_cosine(iteration: int, warmup: int, horizon: int = 1000) -> float:
    if iteration < warmup:
        return (iteration + 1) / warmup
    progress = min(1.0, (iteration - warmup) / max(1, horizon - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
