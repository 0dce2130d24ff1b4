"""The native layout: a contract ``Plan`` checked against what a DeviceMesh can express.

torchtitan's ``ParallelDims`` habit: one small object, validated when it is built, that every
later step trusts. A DeviceMesh is a regular (dp, pp, tp) grid, so the native executor runs the
subset of plans that are grids: every stage at the same TP degree, every replica with the same
stages (the same layer ranges, so FSDP reduces matching parameters across replicas); replicas may
still differ in micro-batch counts. ``NativeLayout.of(plan)`` raises :class:`MeshRuleBroken` naming
the first rule a plan breaks and what to propose instead — before any rank stops training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collector.plan import Plan, RankRole
from trainer.native.model import LlamaConfig

class MeshRuleBroken(ValueError):
    """The native executor cannot run this plan; the message says why and what it can run."""


@dataclass(frozen=True)
class NativeLayout:
    plan: Plan
    dp: int
    pp: int
    tp: int
    world: tuple[int, ...]  # device ids; a device's process-group rank is its index here

    @classmethod
    def of(cls, plan: Plan, cfg: LlamaConfig) -> NativeLayout:
        tps = {s.tp for p in plan.pipelines for s in p.stages}
        if len(tps) != 1:
            raise MeshRuleBroken(f"plan epoch {plan.epoch} mixes TP degrees {sorted(tps)}: a DeviceMesh is a regular "
                              "grid, so the native executor runs one TP degree for the whole job; propose a uniform "
                              "TP shrink instead of excluding one device from one stage")
        ranges = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in plan.pipelines}
        if len(ranges) != 1:
            raise MeshRuleBroken(f"plan epoch {plan.epoch} gives replicas different stage layer ranges {sorted(ranges)}: "
                              "FSDP reduces gradients across replicas stage by stage, so every replica must hold the "
                              "same layers per stage; repartition all replicas alike")
        tp = tps.pop()
        dims = (("attention heads", cfg.n_heads), ("FFN width", cfg.ffn_hidden), ("vocabulary", cfg.vocab_size))
        for what, n in dims:
            if n % tp:
                fits = [d for d in range(1, cfg.n_heads + 1) if all(m % d == 0 for _, m in dims)]
                raise MeshRuleBroken(f"TP {tp} does not divide the model's {what} ({n}); choose a TP degree that "
                                  f"divides the heads, FFN width and vocabulary ({fits})")
        if plan.schedule == "1f1b" and plan.virtual_stages == 1:
            pass
        else:
            raise MeshRuleBroken(f"schedule {plan.schedule!r} with {plan.virtual_stages} virtual stages is not run by the "
                              "native executor yet; it runs 1f1b with one model chunk per stage")
        pp = len(plan.pipelines[0].stages)
        short = [p.replica for p in plan.pipelines if p.microbatches < pp]
        if short:
            raise MeshRuleBroken(f"replicas {short} run fewer micro-batches than the {pp} pipeline stages; 1F1B needs at "
                              f"least {pp} per replica")
        return cls(plan=plan, dp=plan.dp, pp=pp, tp=tp, world=tuple(plan.devices))

    def rank(self, device: int) -> int:
        return self.world.index(device)

    def mesh_ranks(self, rank_of: dict[int, int] | None = None) -> torch.Tensor:
        """(dp, pp, tp) process-group ranks: [r][s][t] is replica r's stage s, TP rank t. Ranks
        are ``rank_of[device]`` (the job's default group) or, without it, indices in this world."""
        rank = rank_of.__getitem__ if rank_of is not None else self.rank
        return torch.tensor([[[rank(d) for d in s.devices] for s in p.stages] for p in self.plan.pipelines])

    def role(self, device: int) -> RankRole:
        return self.plan.role_of(device)

    def same_stages(self, other: NativeLayout) -> bool:
        """True when ``other`` puts every device at the same (replica, stage, TP rank) with the same
        layers: only micro-batch counts differ, so a reshape keeps every group, stage and optimizer."""
        def shape(layout: NativeLayout) -> tuple:
            return tuple((p.replica, tuple((s.devices, s.first_layer, s.end_layer) for s in p.stages))
                         for p in layout.plan.pipelines)
        return shape(self) == shape(other)
