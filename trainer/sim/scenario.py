"""Scenario files: a job, its faults and how long to run it, as YAML (see docs/scenarios.md).

Presets by name (``model: 7b``, ``workload: pretrain``, ``noise: off``) or full mappings; the plan
as the textbook layout (``tp``, ``pp``, ``dp``, ``microbatches_per_replica``, ``schedule``,
``virtual_stages``) or a full contract Plan under ``plan.explicit``. ``periodic_faults`` expands to
one fault every ``every_s`` seconds on devices drawn with the scenario's seed (e.g. one failure
every 30 minutes). ``dialect`` says how the ranks record (ours, megatron, profiler, sampled; see
docs/dialects.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from collector.plan import Plan, Schedule
from trainer.sim.engine import NOISE_OFF, NoiseSpec, SimConfig
from trainer.fault_spec import KINDS_BY_RUNTIME, FaultKind, FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec, ModelSpec
from trainer.sim.telemetry import Dialect
from trainer.sim.workload import WORKLOAD_PRESETS, WorkloadSpec


class PlanSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    microbatches_per_replica: int = Field(default=8, ge=1)
    schedule: Schedule = "1f1b"
    virtual_stages: int = Field(default=1, ge=1)
    layers_per_stage: list[int] | None = Field(default=None, description="uneven split (same for every replica)")
    explicit: Plan | None = None


class PeriodicFaults(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    every_s: float = Field(gt=0)
    first_at_s: float | None = Field(default=None, ge=0, description="default: every_s")
    count: int = Field(ge=1)
    kinds: list[FaultKind] = Field(min_length=1)
    factor_range: tuple[float, float] = (1.5, 4.0)
    duration_s: float | None = Field(default=None, gt=0, description="fail-slow duration; None: lasts")


class Scenario(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    job: str | None = None
    seed: int = 0
    model: str | ModelSpec = "7b"
    cluster: ClusterSpec
    plan: PlanSpec = PlanSpec()
    workload: str | WorkloadSpec = "pretrain"
    noise: Literal["default", "off"] | NoiseSpec = "default"
    iterations: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0, description="stop once simulated time passes this")
    heartbeat_interval_s: float = Field(default=10.0, gt=0)
    reshape_pause_s: float = Field(default=20.0, ge=0)
    rebalance_pause_s: float = Field(default=1.0, ge=0)
    restart_after_s: float | None = Field(default=None, ge=0)
    telemetry: Literal["all", "none"] | list[int] = "all"
    dialect: Dialect = Field(default="ours", description="how the ranks record: ours, megatron, profiler, sampled")
    declares_waits: bool = Field(default=True, description=(
        "false: megatron / profiler p2p timers that hold waits are recorded without saying so (no fused_p2p)"))
    faults: list[FaultSpec] = Field(default_factory=list)
    periodic_faults: PeriodicFaults | None = None

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if self.iterations is None and self.duration_s is None:
            raise ValueError("a scenario needs 'iterations' or 'duration_s' (or both: whichever comes first)")
        if isinstance(self.model, str) and self.model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose one of {sorted(MODEL_PRESETS)} or give a mapping")
        if isinstance(self.workload, str) and self.workload not in WORKLOAD_PRESETS:
            raise ValueError(f"unknown workload preset {self.workload!r}; choose one of {sorted(WORKLOAD_PRESETS)}")
        for fault in self.faults:
            fault.check_runs_on("simulator")
        simulated = KINDS_BY_RUNTIME["simulator"]
        for kind in self.periodic_faults.kinds if self.periodic_faults is not None else []:
            if kind not in simulated:
                raise ValueError(f"periodic_faults: the simulator cannot inject {kind}; it injects {', '.join(simulated)}")
        return self

    # ---- to an engine ------------------------------------------------------------------------

    def model_spec(self) -> ModelSpec:
        return MODEL_PRESETS[self.model] if isinstance(self.model, str) else self.model

    def build_plan(self) -> Plan:
        p = self.plan
        if p.explicit is not None:
            return p.explicit
        if p.layers_per_stage is not None:
            return _uneven_plan(p, self.model_spec().layers)
        return Plan.uniform(tp=p.tp, pp=p.pp, dp=p.dp, num_layers=self.model_spec().layers,
                            microbatches_per_replica=p.microbatches_per_replica, schedule=p.schedule,
                            virtual_stages=p.virtual_stages)

    def sim_config(self, **overrides: Any) -> SimConfig:
        noise = NoiseSpec() if self.noise == "default" else NOISE_OFF if self.noise == "off" else self.noise
        workload = WORKLOAD_PRESETS[self.workload] if isinstance(self.workload, str) else self.workload
        fields: dict[str, Any] = dict(
            model=self.model_spec(), cluster=self.cluster, workload=workload, noise=noise, plan=self.build_plan(),
            job=self.job or self.name, seed=self.seed, heartbeat_interval_s=self.heartbeat_interval_s,
            reshape_pause_s=self.reshape_pause_s, rebalance_pause_s=self.rebalance_pause_s,
            restart_after_s=self.restart_after_s, telemetry=self.telemetry, dialect=self.dialect,
            declares_waits=self.declares_waits,
        )
        fields.update(overrides)
        return SimConfig(**fields)

    def all_faults(self) -> list[FaultSpec]:
        """The scripted faults plus the periodic ones, expanded deterministically from the seed."""
        out = list(self.faults)
        pf = self.periodic_faults
        if pf is None:
            return out
        rng = np.random.default_rng([self.seed, 77])
        devices = self.build_plan().devices
        stopped: set[int] = set()
        first = pf.every_s if pf.first_at_s is None else pf.first_at_s
        for i in range(pf.count):
            kind = pf.kinds[i % len(pf.kinds)]
            candidates = [d for d in devices if d not in stopped]
            d = int(candidates[rng.integers(len(candidates))])
            factor = float(rng.uniform(*pf.factor_range))
            at = first + i * pf.every_s
            fid = f"periodic-{i}"
            if kind == "stop_device":
                stopped.add(d)
                out.append(FaultSpec(kind=kind, device=d, at_s=at, id=fid))
            elif kind == "stop_node":
                node = self.cluster.node_of(d)
                stopped |= {x for x in devices if self.cluster.node_of(x) == node}
                out.append(FaultSpec(kind=kind, node=node, at_s=at, id=fid))
            elif kind == "slow_link":
                peer = int(candidates[rng.integers(len(candidates))])
                out.append(FaultSpec(kind=kind, link=(d, peer), factor=factor, at_s=at, duration_s=pf.duration_s, id=fid))
            else:
                out.append(FaultSpec(kind=kind, device=d, factor=factor, at_s=at, duration_s=pf.duration_s, id=fid))
        return out


def _uneven_plan(p: PlanSpec, num_layers: int) -> Plan:
    split = p.layers_per_stage or []
    if len(split) != p.pp or sum(split) != num_layers:
        raise ValueError(f"layers_per_stage {split} must have {p.pp} entries summing to {num_layers}")
    base = Plan.uniform(tp=p.tp, pp=p.pp, dp=p.dp, num_layers=num_layers,
                        microbatches_per_replica=p.microbatches_per_replica, schedule=p.schedule,
                        virtual_stages=p.virtual_stages)
    bounds = np.concatenate([[0], np.cumsum(split)]).tolist()
    pipes = [pipe.model_copy(update={"stages": tuple(
        st.model_copy(update={"first_layer": bounds[s], "end_layer": bounds[s + 1]}) for s, st in enumerate(pipe.stages))})
        for pipe in base.pipelines]
    return Plan.model_validate(base.model_copy(update={"pipelines": tuple(pipes)}).model_dump())


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file; a name without a path is looked up in scenarios/."""
    p = Path(path)
    if not p.exists():
        lib = Path(__file__).resolve().parents[2] / "scenarios"
        for cand in (lib / p.name, lib / f"{p.name}.yaml"):
            if cand.exists():
                p = cand
                break
        else:
            known = sorted(x.stem for x in lib.glob("*.yaml")) if lib.exists() else []
            raise FileNotFoundError(f"no scenario file {path!s}; the library has: {', '.join(known) or 'nothing'}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a scenario is a YAML mapping, got {type(data).__name__}")
    data.setdefault("name", p.stem)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{p}: invalid scenario: {exc}") from None
