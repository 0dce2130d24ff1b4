"""The native layout: a contract ``Plan`` checked against what per-stage DeviceMeshes can express.

torchtitan's ``ParallelDims`` habit: one small object, validated when it is built, that every
later step trusts. Each pipeline stage has its own mesh rather than the job one (dp, pp, tp)
grid, so a stage may run at its own TP degree and, within a stage, replicas may too (a stage
that excluded a bad device runs at TP 3 beside its replicas' TP 4):

* a stage whose replicas all hold it at one TP degree, cut evenly, is a regular (dp, tp) grid:
  TP over the tp dimension, FSDP2 over the dp dimension (``grid``);
* any other stage gives each replica's TP group a 1-D ``tp`` mesh of its own, and its replicas
  sum full gradients over the stage's devices (trainer/native/grad_sum.py) instead of FSDP.

Every replica must still hold the same layers per stage (FSDP and the gradient sum reduce
matching parameters stage by stage); replicas may differ in micro-batch counts. Activations and
gradients cross stages of different TP degrees by the contract's rule
(``collector.plan.stage_peers``, trainer/native/pipeline.py). ``NativeLayout.of(plan)`` raises
:class:`MeshRuleBroken` naming the first rule a plan breaks and what to propose instead — before
any rank stops training.
"""

from __future__ import annotations

from dataclasses import dataclass

from collector.plan import Plan, RankRole
from trainer.native.model import LlamaConfig


class MeshRuleBroken(ValueError):
    """The native executor cannot run this plan; the message says why and what it can run."""


def chunk_sizes(n: int, tp: int) -> list[int]:
    """How DTensor's ``Shard`` cuts ``n`` rows over ``tp`` ranks, as ``torch.chunk`` does:
    ceil-sized pieces, the last ones smaller (or empty)."""
    size = -(-n // tp)
    return [max(0, min(size, n - i * size)) for i in range(tp)]


def tp_fit_problem(cfg: LlamaConfig, tp: int) -> str | None:
    """Why TP degree ``tp`` cannot cut ``cfg``'s model (None: it can). Attention needs the same
    whole number of heads on every rank (its output goes back to ``wo`` as an even shard), so
    ``tp`` must divide the heads; the FFN width and the vocabulary may divide unevenly (DTensor
    cuts them as ``torch.chunk`` does and pads and unpads inside its collectives), as long as
    every rank gets a piece."""
    if cfg.n_heads % tp:
        fits = [d for d in range(1, cfg.n_heads + 1) if cfg.n_heads % d == 0]
        return (f"TP {tp} does not divide the model's attention heads ({cfg.n_heads}); choose a TP degree that "
                f"divides the heads ({fits}); the FFN width and vocabulary may divide unevenly")
    for what, n in (("FFN width", cfg.ffn_hidden), ("vocabulary", cfg.vocab_size)):
        if 0 in chunk_sizes(n, tp):
            return f"TP {tp} leaves a rank without a piece of the model's {what} ({n}); choose a degree of at most {n}"
    return None


@dataclass(frozen=True)
class NativeLayout:
    plan: Plan
    pp: int
    world: tuple[int, ...]  # device ids; a device's process-group rank is its index here
    grid: tuple[bool, ...]  # per stage: a regular (dp, tp) grid of even TP shards (FSDP runs on it)

    @classmethod
    def of(cls, plan: Plan, cfg: LlamaConfig) -> NativeLayout:
        ranges = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in plan.pipelines}
        if len(ranges) != 1:
            raise MeshRuleBroken(f"plan epoch {plan.epoch} gives replicas different stage layer ranges {sorted(ranges)}: "
                                 "replicas reduce gradients stage by stage, so every replica must hold the same "
                                 "layers per stage; repartition all replicas alike")
        for tp in sorted({s.tp for p in plan.pipelines for s in p.stages}):
            if problem := tp_fit_problem(cfg, tp):
                raise MeshRuleBroken(problem)
        if plan.schedule != "1f1b" or plan.virtual_stages != 1:
            raise MeshRuleBroken(f"schedule {plan.schedule!r} with {plan.virtual_stages} virtual stages is not run by the "
                                 "native executor yet; it runs 1f1b with one model chunk per stage")
        pp = len(plan.pipelines[0].stages)
        short = [p.replica for p in plan.pipelines if p.microbatches < pp]
        if short:
            raise MeshRuleBroken(f"replicas {short} run fewer micro-batches than the {pp} pipeline stages; 1F1B needs at "
                                 f"least {pp} per replica")
        grid = tuple(len(tps := {p.stages[s].tp for p in plan.pipelines}) == 1
                     and all(n % next(iter(tps)) == 0 for n in (cfg.dim, cfg.ffn_hidden, cfg.vocab_size))
                     for s in range(pp))
        return cls(plan=plan, pp=pp, world=tuple(plan.devices), grid=grid)

    @property
    def dp(self) -> int:
        return self.plan.dp

    def rank(self, device: int) -> int:
        return self.world.index(device)

    def stage_groups(self, stage: int) -> list[tuple[int, ...]]:
        """The TP groups (device ids) holding ``stage``, one per replica in replica order."""
        return [p.stages[stage].devices for p in self.plan.pipelines]

    def role(self, device: int) -> RankRole:
        return self.plan.role_of(device)

    def same_stages(self, other: NativeLayout) -> bool:
        """True when ``other`` puts every device at the same (replica, stage, TP rank) with the same
        layers: only micro-batch counts differ, so a reshape keeps every group, stage and optimizer."""
        def shape(layout: NativeLayout) -> tuple:
            return tuple((p.replica, tuple((s.devices, s.first_layer, s.end_layer) for s in p.stages))
                         for p in layout.plan.pipelines)
        return shape(self) == shape(other)
