"""What the reference launcher tells every rank process: one validated, JSON-serialisable run spec."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.fault_spec import FaultSpec
from trainer.reference.model import GPTConfig
from trainer.spec import BusSpec


class RunSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str = "resihp"
    model: dict = Field(default_factory=dict, description="GPTConfig fields")
    seed: int = 0
    iterations: int = Field(default=10, ge=1)
    lr: float = 3e-3
    weight_decay: float = 0.01
    store_host: str = "127.0.0.1"
    store_port: int = 0
    pg_timeout_s: float = Field(default=30.0, gt=0, description="collective timeout: how long a survivor "
                                "not next to a dead rank waits before it notices")
    rendezvous_timeout_s: float = Field(default=120.0, gt=0, description=(
        "how long the ranks wait for a new world to gather and meet; a rank dead inside the rendezvous holds the "
        "others this long"))
    recovery_timeout_s: float = Field(default=300.0, gt=0, description="how long survivors wait for a new plan")
    heartbeat_s: float = Field(default=1.0, gt=0)
    faults: list[FaultSpec] = Field(default_factory=list)
    bus: BusSpec = Field(default_factory=BusSpec)
    telemetry: bool = True
    save_dir: str | None = Field(default=None, description="final checkpoint here; periodic ones in step-N/ below")
    resume_dir: str | None = None
    checkpoint_every: int | None = Field(default=None, ge=1, description=(
        "write a checkpoint to <save_dir>/step-<iteration> every K iterations: the fallback when no live "
        "copy of some layer survives a failure"))
    run_id: str = Field(default="", description="set by the launcher; periodic checkpoints of other runs are ignored")
    threads: int = Field(default=1, ge=1)
    pace_s_per_layer_token: float = Field(default=0.0, ge=0, description=(
        "emulate devices: pad each forward chunk to layers × (p·tokens + p/32·Σl²) / tp seconds (backward: 2×; "
        "tp: the stage's TP degree, which splits a layer's work), so ranks sharing few CPU cores behave like "
        "devices of a set speed; 0 = off"))

    @model_validator(mode="after")
    def _faults_the_trainer_injects(self) -> RunSpec:
        for fault in self.faults:
            fault.check_runs_on("trainer")
        return self

    @model_validator(mode="after")
    def _rendezvous_outlasts_a_collective(self) -> RunSpec:
        if self.rendezvous_timeout_s <= self.pg_timeout_s:
            raise ValueError(f"rendezvous timeout {self.rendezvous_timeout_s:g} s must exceed the collective timeout "
                             f"{self.pg_timeout_s:g} s: a survivor may spend a whole collective timeout noticing a "
                             "death before it arrives at the next world; raise --rendezvous-timeout or lower "
                             "--pg-timeout")
        return self

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(**self.model)
