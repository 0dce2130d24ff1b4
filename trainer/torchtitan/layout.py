"""A torchtitan job's layout in the contract's words, and back: flags ⇄ ``Plan``.

torchtitan lays its world out as one grid, ``(pp, dp_replicate · dp_shard, cp, tp)`` in row-major
order (``ParallelDims``): world rank ``((p · B + b) · CP + c) · TP + t``. In a ``Plan`` that grid is
``B`` pipelines (replicas: torchtitan's batch dimension, FSDP shards and replicas alike) of ``PP``
stages, each stage a TP group of ``TP`` devices. Devices are the ids plans name; a job started with
N ranks owns devices 0..N-1 (its first world ranks) and keeps those ids across restarts, so a
restart that leaves device 1 out runs world rank r on ``devices[r]``.

What a torchtitan job can run (:data:`TORCHTITAN_CAPABILITIES`) is a *uniform* layout: one TP degree
for every stage, the same layer ranges in every replica, the same micro-batch count in every
replica (torchtitan builds one mesh and one schedule). A plan that is not uniform is refused with
the rule it breaks (:func:`layout_of`), the same words the planner's capability check uses.

Pure: no torch, no torchtitan; the agent (which never imports torchtitan) and the ranks share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collector.capabilities import capability_refusal
from collector.events import ExecutorCapabilities
from collector.plan import PipelinePlan, Plan, StagePlan, even_layer_ranges

TORCHTITAN_CAPABILITIES = ExecutorCapabilities(
    executor="torchtitan",
    tp_shrink="uniform",
    tp_exclusion=False,
    pp_repartition="uniform",
    dp_drop=True,
    dp_microbatch_migration=False,
    spares=True,
    schedules=["1f1b", "gpipe"],
    notes={
        "tp_shrink": "uniform only: torchtitan builds one DeviceMesh, so every stage of every replica runs one TP degree",
        "tp_exclusion": "one stage at a smaller TP degree than the rest is not a torchtitan layout",
        "pp_repartition": "torchtitan splits layers evenly itself; the same ranges in every replica",
        "dp_drop": "yes: a restart at fewer replicas, the global batch kept by gradient accumulation",
        "dp_microbatch_migration": "every replica runs the same local batch",
        "spares": "devices left out of the plan idle; a restart can take them back",
        "state_transfer": "a DCP checkpoint at a step boundary, resharded on load (trainer/torchtitan/)",
    },
)

# Flags the platform sets on a restart; a value given on the job's command line is replaced.
LAYOUT_FLAGS = ("--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree",
                "--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree",
                "--parallelism.context_parallel_degree", "--parallelism.pipeline_parallel_microbatch_size",
                "--training.local_batch_size", "--training.global_batch_size")


JOB_KEY = "resihp/relayout/job"  # in the ranks' store: what the job's rank 0 runs, for its agent to announce


class NotUniform(ValueError):
    """A plan a torchtitan job cannot run, with the rule it breaks."""


@dataclass(frozen=True)
class TitanLayout:
    """One torchtitan grid: the degrees ``ParallelDims`` takes (``dp_shard`` resolved, never -1)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def batch(self) -> int:
        """Replicas in the contract's sense: torchtitan's batch dimension."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.batch * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, pp, dp) of world rank ``rank``, the contract's ``Coords`` order."""
        if self.cp != 1:
            raise NotUniform("context parallelism is not expressed in plans yet; run with cp 1")
        t = rank % self.tp
        b = (rank // self.tp) % self.batch
        p = rank // (self.tp * self.batch)
        return t, p, b

    def rank_of(self, t: int, p: int, b: int) -> int:
        return (p * self.batch + b) * self.tp + t

    def flags(self, microbatches: int, samples_per_microbatch: int) -> list[str]:
        """The CLI flags that make torchtitan build this layout with ``microbatches`` micro-batches
        of ``samples_per_microbatch`` samples per replica and step (the global batch is their
        product times the replicas). Without pipelining a micro-batch is one gradient-accumulation
        step of ``local_batch_size`` samples; with it, one schedule micro-batch of
        ``pipeline_parallel_microbatch_size`` samples, the local batch holding all of them."""
        per_step = microbatches * samples_per_microbatch
        local = per_step if self.pp > 1 else samples_per_microbatch
        return ["--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
                "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
                "--parallelism.tensor_parallel_degree", str(self.tp),
                "--parallelism.pipeline_parallel_degree", str(self.pp),
                "--parallelism.context_parallel_degree", str(self.cp),
                "--parallelism.pipeline_parallel_microbatch_size", str(samples_per_microbatch),
                "--training.local_batch_size", str(local),
                "--training.global_batch_size", str(per_step * self.batch)]


def layout_flags(flags: Sequence[str]) -> list[str]:
    """``flags`` when they are only :data:`LAYOUT_FLAGS`, each with a positive integer (what
    :meth:`TitanLayout.flags` writes); ValueError otherwise. An order to restart at a new layout
    carries flags to every node's command line: it may change the layout and nothing else."""
    if len(flags) % 2:
        raise ValueError("layout flags come as name, value pairs")
    for name, value in zip(flags[::2], flags[1::2]):
        if name not in LAYOUT_FLAGS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name} {value!r} is not a layout flag with a positive integer")
    return list(flags)


def with_flags(args: Sequence[str], extra: Sequence[str], replaced: Sequence[str] = LAYOUT_FLAGS) -> list[str]:
    """``args`` without any of ``replaced`` (and their values), then ``extra``."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in replaced:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out + list(extra)


def plan_of(layout: TitanLayout, devices: Sequence[int], num_layers: int, microbatches: int, epoch: int,
            schedule: str = "1f1b") -> Plan:
    """The plan of ``layout`` with world rank r on ``devices[r]``; ``microbatches`` per replica."""
    if len(devices) != layout.world:
        raise NotUniform(f"{len(devices)} devices for a layout of {layout.world} ranks")
    ranges = even_layer_ranges(num_layers, layout.pp)
    pipelines = tuple(
        PipelinePlan(replica=b, microbatches=microbatches, stages=tuple(
            StagePlan(devices=tuple(devices[layout.rank_of(t, p, b)] for t in range(layout.tp)),
                      first_layer=ranges[p][0], end_layer=ranges[p][1])
            for p in range(layout.pp)))
        for b in range(layout.batch))
    return Plan.model_validate({"epoch": epoch, "schedule": schedule if layout.pp > 1 else "1f1b",
                                "num_layers": num_layers, "pipelines": pipelines})


def layout_of(plan: Plan, running: TitanLayout, running_plan: Plan | None = None) -> tuple[TitanLayout, list[int]]:
    """The torchtitan layout that runs ``plan`` and the device of each new world rank; raises
    :class:`NotUniform` naming the rule a non-uniform plan breaks. The batch dimension keeps the
    running job's kind: FSDP shards when it sharded, replicas when it only replicated."""
    refusal = capability_refusal(plan, running_plan, TORCHTITAN_CAPABILITIES)
    if refusal:
        raise NotUniform(refusal)
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    pps = {len(p.stages) for p in plan.pipelines}
    counts = {p.microbatches for p in plan.pipelines}
    if len(tps) != 1 or len(pps) != 1 or len(counts) != 1:
        raise NotUniform(f"plan epoch {plan.epoch} is not one grid: TP {sorted(tps)}, PP {sorted(pps)}, "
                         f"micro-batches {sorted(counts)}")
    batch, tp, pp = len(plan.pipelines), tps.pop(), pps.pop()
    ranges = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in plan.pipelines}
    if ranges != {tuple(even_layer_ranges(plan.num_layers, pp))}:
        raise NotUniform(f"plan epoch {plan.epoch} splits layers {sorted(ranges)}; torchtitan splits them evenly")
    if running.dp_shard > 1 or running.dp_replicate == 1:
        layout = TitanLayout(pp=pp, dp_replicate=1, dp_shard=batch, tp=tp)
    else:
        layout = TitanLayout(pp=pp, dp_replicate=batch, dp_shard=1, tp=tp)
    devices = [0] * layout.world
    for pipe in sorted(plan.pipelines, key=lambda p: p.replica):
        for p, stage in enumerate(pipe.stages):
            for t, device in enumerate(stage.devices):
                devices[layout.rank_of(t, p, pipe.replica)] = device
    return layout, devices


@dataclass(frozen=True)
class JobShape:
    """What rank 0 of a torchtitan world reports at start (``JOB_KEY``, signed as a rank)."""

    layout: TitanLayout
    devices: tuple[int, ...]
    epoch: int
    num_layers: int
    microbatches: int  # per replica per step: gradient accumulation x pipeline micro-batches
    samples_per_microbatch: int
    tokens_per_microbatch: int
    layer_state_bytes: int
    model: str

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
                "cp": lay.cp, "devices": list(self.devices), "epoch": self.epoch, "num_layers": self.num_layers,
                "microbatches": self.microbatches,
                "samples_per_microbatch": self.samples_per_microbatch, "tokens_per_microbatch": self.tokens_per_microbatch, "layer_state_bytes": self.layer_state_bytes,
                "model": self.model}

    @classmethod
    def parse(cls, body: Any) -> JobShape:
        if not isinstance(body, dict):
            raise ValueError("a job shape is an object")
        ints = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "epoch", "num_layers", "microbatches",
                "samples_per_microbatch", "tokens_per_microbatch", "layer_state_bytes")
        if not all(isinstance(body.get(k), int) and body[k] >= 0 for k in ints):
            raise ValueError(f"a job shape needs non-negative integers {', '.join(ints)}")
        devices = body.get("devices")
        if not isinstance(devices, list) or not all(isinstance(d, int) and d >= 0 for d in devices):
            raise ValueError("a job shape's devices are non-negative integers")
        layout = TitanLayout(pp=body["pp"], dp_replicate=body["dp_replicate"], dp_shard=body["dp_shard"],
                             tp=body["tp"], cp=body["cp"])
        if layout.world != len(devices):
            raise ValueError(f"a job shape of {layout.world} ranks names {len(devices)} devices")
        return cls(layout=layout, devices=tuple(devices), epoch=body["epoch"], num_layers=body["num_layers"],
                   microbatches=body["microbatches"],
                   samples_per_microbatch=body["samples_per_microbatch"], tokens_per_microbatch=body["tokens_per_microbatch"],
                   layer_state_bytes=body["layer_state_bytes"], model=str(body.get("model", ""))[:200])

    def plan(self) -> Plan:
        return plan_of(self.layout, self.devices, self.num_layers, self.microbatches, self.epoch)


def fallback_layout(running: TitanLayout, healthy: int, global_microbatches: int, num_layers: int,
                    exact: bool = False) -> TitanLayout | None:
    """The uniform layout a job restarts at when devices are gone and no plan says where, among
    those on at most ``healthy`` devices that keep the global batch (``global_microbatches`` split
    evenly over the replicas, at least one per stage), a TP degree dividing the running one (so it
    divides the heads and widths) and the batch dimension's kind (FSDP shards or replicas).

    Chosen by the step time a schedule gives with every device as fast as the others: a replica
    runs its ``m`` micro-batches over ``pp`` stages in ``m + pp - 1`` stage-slots of ``1 / (pp · tp)``
    of the model each. Ties keep the running TP, then PP, then use fewer devices. Memory is not
    weighed (the agent does not know the devices' capacity) and neither are the links: the engine,
    which knows both, can move the job on from here. ``exact``: only layouts of exactly ``healthy``
    ranks (a rendezvous round across nodes has already fixed the world's size). None when no
    uniform layout fits."""
    best: tuple[tuple[float, bool, bool, int], TitanLayout] | None = None
    sharded = running.dp_shard > 1 or running.dp_replicate == 1
    for tp in (t for t in range(1, running.tp + 1) if running.tp % t == 0):
        for pp in range(1, min(num_layers, healthy // tp) + 1):
            for dp in range(1, healthy // (tp * pp) + 1):
                if global_microbatches % dp or global_microbatches // dp < pp:
                    continue
                layout = TitanLayout(pp=pp, dp_replicate=1 if sharded else dp, dp_shard=dp if sharded else 1, tp=tp)
                if exact and layout.world != healthy:
                    continue
                step = (global_microbatches // dp + pp - 1) / (pp * tp)
                score = (-step, tp == running.tp, pp == running.pp, -layout.world)
                if best is None or score > best[0]:
                    best = (score, layout)
    return best[1] if best is not None else None
