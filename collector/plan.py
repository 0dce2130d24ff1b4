"""The parallel layout of a job, in the contract's pipeline form.

A plan is not three numbers. Each DP replica is a pipeline of stages; each stage is a TP group of
explicit device ids holding a contiguous layer range; each pipeline gets its share of the global
batch's micro-batches. Replicas may therefore differ: a stage that lost a GPU can run at TP 4 with
fewer layers while its siblings keep TP 8, and a slow replica can take fewer micro-batches.

The plan validates itself when it is built (torchtitan's ParallelDims habit): a plan that leaves a
layer unowned or uses a device twice cannot exist, so neither the trainer nor the simulator has to
re-check it. Any TP degree ≥ 1 is a valid plan: whether a degree splits a model (its heads, FFN
width, vocabulary) is the executor's judgement, which it gives before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, field_serializer, field_validator, model_validator

Schedule = Literal["1f1b", "interleaved", "zero_bubble"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zero_bubble")


MAX_RANGE_IDS = 1 << 20  # ids one range list may name: a forged "0-1048575,0-1048575,…" stops here
DEVICE_LISTS = "resihp.device_lists"  # serialization context: a stage's devices as a JSON list (collector/auth.py)


def id_ranges(ids: tuple[int, ...] | list[int]) -> str:
    """Ids (devices, ranks) as a range list, in their order: (8, 9, 10, 11) -> "8-11",
    (0, 1, 5, 7, 8) -> "0-1,5,7-8".

    Why: a plan is written whole into every plan.current, plan.proposed and command.reconfigure,
    and at 100k devices the ids as a JSON list made a plan of 1.2 MB, over the bus's 1 MB record
    limit (Kafka's default); the detector's view of every rank (analytics.rank_health) was 4.6 MB.
    A TP group is almost always a run of consecutive ids, and so are a job's healthy ranks, so they
    take a short string (the plan: 0.75 MB). A run only joins ids that ascend by one: a TP group's
    order is its TP-rank order, and it is kept."""
    a = np.asarray(ids, dtype=np.int64)
    if a.size == 0:
        return ""
    cut = np.flatnonzero(np.diff(a) != 1) + 1  # where a run of consecutive ids ends
    firsts = a[np.concatenate(([0], cut))].tolist()
    lasts = a[np.concatenate((cut, [a.size])) - 1].tolist()
    return ",".join(str(f) if f == g else f"{f}-{g}" for f, g in zip(firsts, lasts))


def parse_id_ranges(text: str) -> list[int]:
    """The ids of a range list (``id_ranges``' form; "" is none). Raises ValueError naming the bad part."""
    if not text:
        return []
    out: list[int] = []
    for part in text.split(","):
        if len(out) > MAX_RANGE_IDS:
            raise ValueError(f"range list names more than {MAX_RANGE_IDS:,} ids")
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"id range {part!r} is not N or N-M (non-negative ids)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"id range {part!r} runs backwards")
        if last - first >= MAX_RANGE_IDS:
            raise ValueError(f"id range {part!r} spans more than {MAX_RANGE_IDS:,} ids")
        out.extend(range(first, last + 1))
    return out


def even_layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges for ``stages`` stages, the first ``num_layers % stages`` one layer
    longer: how a framework that splits layers itself (torchtitan) cuts them, and how a uniform
    plan for it must. Raises ValueError for more stages than layers."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages cannot split {num_layers} layers")
    size, extra = divmod(num_layers, stages)
    out, first = [], 0
    for s in range(stages):
        end = first + size + (1 if s < extra else 0)
        out.append((first, end))
        first = end
    return out


class StagePlan(BaseModel):
    """One pipeline stage: a TP group of devices holding layers [first_layer, end_layer)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: tuple[int, ...] = Field(min_length=1, description="device ids of the TP group, in TP-rank order; "
                                     "in JSON a range list such as \"8-15\" or \"0-3,5,7-9\" (a list of ids is read too)")
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1, description="exclusive")

    @field_validator("devices", mode="before")
    @classmethod
    def _from_ranges(cls, value: object) -> object:
        return parse_id_ranges(value) if isinstance(value, str) else value

    @field_serializer("devices", when_used="json")
    def _as_ranges(self, devices: tuple[int, ...], info: SerializationInfo) -> str | list[int]:
        if isinstance(info.context, dict) and info.context.get(DEVICE_LISTS):
            return list(devices)  # a signature's canonical form: independent of how the wire writes ids
        return id_ranges(devices)

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @model_validator(mode="after")
    def _check(self) -> StagePlan:
        if self.end_layer <= self.first_layer:
            raise ValueError(f"stage layer range [{self.first_layer}, {self.end_layer}) is empty")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"stage lists a device twice: {list(self.devices)}")
        return self


class PipelinePlan(BaseModel):
    """One DP replica: its stages in pipeline order and its share of the global batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replica: int = Field(ge=0)
    microbatches: int = Field(ge=1, description="micro-batches of the global batch this replica runs")
    stages: tuple[StagePlan, ...] = Field(min_length=1)


@dataclass(frozen=True)
class StagePeers:
    """Who one TP rank of a pipeline stage exchanges activations and gradients with (device ids).

    The rule every executor follows when neighbouring stages have different TP degrees: the
    receiver with TP index j takes its input from the previous stage's TP rank j mod tp(previous)
    (activations are replicated across a stage's TP ranks, so any sender is right) and its output
    gradient from the next stage's TP rank j mod tp(next); a sender sends to every neighbour
    whose index maps to it, possibly none (TP 4 → TP 3: the fourth rank's output is not needed)."""

    act_from: int | None
    act_to: tuple[int, ...]
    grad_from: int | None
    grad_to: tuple[int, ...]


def stage_peers(pipe: PipelinePlan, stage: int, tp_rank: int, wrap: bool = False) -> StagePeers:
    """:class:`StagePeers` of ``pipe``'s stage ``stage``, TP rank ``tp_rank``; ``wrap``: the last
    stage feeds the first (interleaved chunks)."""
    S, me = len(pipe.stages), pipe.stages[stage]
    prev = pipe.stages[(stage - 1) % S] if (stage > 0 or wrap) else None
    nxt = pipe.stages[(stage + 1) % S] if (stage + 1 < S or wrap) else None
    return StagePeers(
        act_from=prev.devices[tp_rank % prev.tp] if prev is not None else None,
        act_to=tuple(d for j, d in enumerate(nxt.devices) if j % me.tp == tp_rank) if nxt is not None else (),
        grad_from=nxt.devices[tp_rank % nxt.tp] if nxt is not None else None,
        grad_to=tuple(d for j, d in enumerate(prev.devices) if j % me.tp == tp_rank) if prev is not None else ())


@dataclass(frozen=True)
class RankRole:
    """What one device does under a plan: its coordinates and its work."""

    device: int
    replica: int
    stage: int
    tp_rank: int
    tp_degree: int
    first_layer: int
    end_layer: int
    microbatches: int
    num_stages: int


class Plan(BaseModel):
    """A whole layout; valid by construction. ``epoch`` fences reconfiguration commands."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: int = Field(ge=0)
    schedule: Schedule = "1f1b"
    virtual_stages: int = Field(default=1, ge=1, description="model chunks per stage (interleaved schedule)")
    num_layers: int = Field(ge=1)
    pipelines: tuple[PipelinePlan, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Plan:
        seen: dict[int, str] = {}
        replicas = [p.replica for p in self.pipelines]
        if sorted(replicas) != list(range(len(replicas))):
            raise ValueError(f"replica ids must be 0..{len(replicas) - 1}, got {replicas}")
        for pipe in self.pipelines:
            expected_first = 0
            for s, stage in enumerate(pipe.stages):
                where = f"replica {pipe.replica} stage {s}"
                if stage.first_layer != expected_first:
                    raise ValueError(
                        f"{where} starts at layer {stage.first_layer} but the previous stage ended at "
                        f"{expected_first}: layer ranges must be contiguous"
                    )
                expected_first = stage.end_layer
                for d in stage.devices:
                    if d in seen:
                        raise ValueError(f"device {d} is used by both {seen[d]} and {where}")
                    seen[d] = where
            if expected_first != self.num_layers:
                raise ValueError(
                    f"replica {pipe.replica} covers layers [0, {expected_first}) but the model has "
                    f"{self.num_layers}"
                )
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs the interleaved schedule")
        return self

    # ---- derived views -------------------------------------------------------------------------

    def same_stages(self, other: Plan) -> bool:
        """Whether ``other`` differs from this plan at most in micro-batch counts: the same
        schedule, and replica by replica the same stages (devices and layers). Moving from one to
        the other moves no state and needs no new process group (a DP rebalance)."""
        return (self.schedule == other.schedule and self.virtual_stages == other.virtual_stages
                and self.num_layers == other.num_layers
                and [(p.replica, p.stages) for p in self.pipelines] == [(p.replica, p.stages) for p in other.pipelines])

    def tp_split_problem(self, heads: int) -> str | None:
        """Why a model of ``heads`` attention heads cannot be cut at this plan's TP degrees (None:
        it can). Tensor parallelism gives each TP rank whole heads, so a stage's degree must divide
        them — TP 3 of 12 heads runs, TP 3 of 4 does not. Executors and the simulator refuse such a
        plan with this line before anything starts; an executor may add limits of its own (the
        native one also cuts the FFN width and the vocabulary)."""
        for pipe in self.pipelines:
            for s, stage in enumerate(pipe.stages):
                if heads % stage.tp:
                    fits = [d for d in range(1, heads + 1) if heads % d == 0]
                    return (f"replica {pipe.replica} stage {s}: TP degree {stage.tp} (devices {list(stage.devices)}) "
                            f"does not divide the model's {heads} attention heads; use a degree that does ({fits})")
        return None

    @property
    def global_microbatches(self) -> int:
        return sum(p.microbatches for p in self.pipelines)

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @cached_property
    def roles(self) -> dict[int, RankRole]:
        """device id -> its role; every device of the plan appears once."""
        out: dict[int, RankRole] = {}
        for pipe in self.pipelines:
            for s, stage in enumerate(pipe.stages):
                for t, d in enumerate(stage.devices):
                    out[d] = RankRole(
                        device=d, replica=pipe.replica, stage=s, tp_rank=t, tp_degree=stage.tp,
                        first_layer=stage.first_layer, end_layer=stage.end_layer,
                        microbatches=pipe.microbatches, num_stages=len(pipe.stages),
                    )
        return out

    @property
    def devices(self) -> list[int]:
        return sorted(self.roles)

    def role_of(self, device: int) -> RankRole:
        try:
            return self.roles[device]
        except KeyError:
            raise KeyError(f"device {device} has no role in plan epoch {self.epoch}") from None

    def shape(self) -> str:
        """A short human label: ``TP2·PP2·DP2`` when uniform, otherwise per-replica shapes."""
        shapes = {(tuple(s.tp for s in p.stages), len(p.stages)) for p in self.pipelines}
        if len(shapes) == 1:
            (tps, pp), = shapes
            if len(set(tps)) == 1:
                return f"TP{tps[0]}·PP{pp}·DP{self.dp}"
        parts = ["/".join(str(s.tp) for s in p.stages) for p in self.pipelines]
        return "TP[" + " | ".join(parts) + f"]·DP{self.dp}"

    @classmethod
    def uniform(
        cls,
        *,
        tp: int,
        pp: int,
        dp: int,
        num_layers: int,
        microbatches_per_replica: int,
        schedule: Schedule = "1f1b",
        virtual_stages: int = 1,
        epoch: int = 0,
        first_device: int = 0,
    ) -> Plan:
        """The textbook layout: device = first + (replica·pp + stage)·tp + tp_rank.

        TP groups are consecutive devices, so with tp ≤ 8 they stay inside an 8-GPU node.
        Layers are split as evenly as possible, earlier stages taking the remainder.
        """
        if num_layers < pp:
            raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
        base, extra = divmod(num_layers, pp)
        bounds = [0]
        for s in range(pp):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        pipelines = []
        for r in range(dp):
            stages = []
            for s in range(pp):
                d0 = first_device + (r * pp + s) * tp
                stages.append(StagePlan(devices=tuple(range(d0, d0 + tp)), first_layer=bounds[s], end_layer=bounds[s + 1]))
            pipelines.append(PipelinePlan(replica=r, microbatches=microbatches_per_replica, stages=tuple(stages)))
        return cls(
            epoch=epoch, schedule=schedule, virtual_stages=virtual_stages, num_layers=num_layers,
            pipelines=tuple(pipelines),
        )
