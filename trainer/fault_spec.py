"""One fault vocabulary for the torch trainer and the cluster simulator.

A scenario's ``faults:`` list is read by both: ``resihp simulate`` and ``resihp train --faults``
take the same file. Each entry names a kind, where it strikes (``device``, ``link`` or ``node``),
when (``at_iteration``, or for the simulator ``at_s``) and for how long (``duration_iterations`` /
``duration_s``; neither: it lasts). The kinds each runtime can inject differ — the simulator models
links, NICs and whole nodes; the trainer can delay a real send and kill a process at a chosen step
of a reshape — so a file is checked against the runtime that runs it (``check_runs_on``), and a kind
the runtime cannot inject is refused up front with the list it can.

Older fault files of the trainer are read as they are: ``rank`` is ``device``, ``start_iteration``
is ``at_iteration``, ``end_iteration`` (exclusive) becomes a duration, and ``kill`` is
``stop_device``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from collector.events import FaultCategory

FaultKind = Literal["slow_compute", "slow_send", "slow_link", "slow_nic", "stop_device", "stop_node",
                    "kill_in_reshape", "kill_in_rendezvous", "kill_in_transfer"]
Runtime = Literal["trainer", "simulator"]

KINDS_BY_RUNTIME: dict[Runtime, tuple[str, ...]] = {
    "simulator": ("slow_compute", "slow_link", "slow_nic", "stop_device", "stop_node"),
    "trainer": ("slow_compute", "slow_send", "stop_device", "kill_in_reshape", "kill_in_rendezvous",
                "kill_in_transfer"),
}
KIND_ALIASES = {"kill": "stop_device"}
_WHERE = {"slow_link": "link", "stop_node": "node"}  # every other kind strikes one device


class FaultSpec(BaseModel):
    """One injected fault: what, where, from when, for how long."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    kind: FaultKind
    device: int | None = Field(default=None, ge=0, validation_alias=AliasChoices("device", "rank"))
    link: tuple[int, int] | None = None
    node: int | None = Field(default=None, ge=0)
    factor: float = Field(default=2.0, ge=1.0, description="slowdown; 2.0 takes twice as long")
    delay_s: float = Field(default=0.0, ge=0.0, description="slow_send: added before every pipeline send")
    at_iteration: int | None = Field(default=None, ge=0,
                                     validation_alias=AliasChoices("at_iteration", "start_iteration"))
    at_s: float | None = Field(default=None, ge=0, description="onset in seconds since the job started")
    duration_iterations: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        """``kill`` and an exclusive ``end_iteration`` are the trainer's older spellings; a fault with
        no onset acts from the first iteration."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("kind"), str):
            data["kind"] = KIND_ALIASES.get(data["kind"], data["kind"])
        if not {"at_iteration", "start_iteration", "at_s"} & data.keys():
            data["at_iteration"] = 0  # no onset given: there from the first iteration
        end = data.pop("end_iteration", None)
        if end is not None:
            start = data.get("at_iteration", data.get("start_iteration", 0)) or 0
            if end <= start:
                raise ValueError(f"end_iteration {end} must come after the start ({start}); it is exclusive")
            data["duration_iterations"] = end - start
        return data

    @model_validator(mode="after")
    def _check(self) -> FaultSpec:
        need = _WHERE.get(self.kind, "device")
        if getattr(self, need) is None:
            raise ValueError(f"a {self.kind} fault needs '{need}'")
        if self.at_iteration is not None and self.at_s is not None:
            raise ValueError(f"{self.kind} fault: give one of at_iteration or at_s, not both")
        if self.duration_iterations is not None and self.duration_s is not None:
            raise ValueError(f"{self.kind} fault: give at most one of duration_iterations or duration_s")
        return self

    @property
    def category(self) -> FaultCategory:
        return FaultCategory.FAIL_SLOW if self.kind.startswith("slow") else FaultCategory.FAIL_STOP

    @property
    def end_iteration(self) -> int | None:
        """The first iteration it no longer acts on, when both ends are counted in iterations."""
        if self.at_iteration is None or self.duration_iterations is None:
            return None
        return self.at_iteration + self.duration_iterations

    def active(self, iteration: int) -> bool:
        """Does an iteration-timed fault act on ``iteration``?"""
        end = self.end_iteration
        return self.at_iteration is not None and self.at_iteration <= iteration and (end is None or iteration < end)

    def check_runs_on(self, runtime: Runtime) -> None:
        """Raise ValueError naming the problem when ``runtime`` cannot inject this fault."""
        kinds = KINDS_BY_RUNTIME[runtime]
        if self.kind not in kinds:
            raise ValueError(f"the {runtime} cannot inject a {self.kind} fault; it injects {', '.join(kinds)}")
        if runtime == "trainer" and (self.at_s is not None or self.duration_s is not None):
            raise ValueError(f"{self.kind} fault on device {self.device}: the trainer counts iterations; "
                             "give at_iteration and duration_iterations instead of seconds")


class FaultList(BaseModel):
    """The ``faults:`` list of a scenario or fault file (other top-level sections are ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    faults: list[FaultSpec] = Field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path, runtime: Runtime) -> FaultList:
        """Read ``path`` and check every fault runs on ``runtime`` (ValueError names the problem)."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read fault list {path}: {exc}") from None
        faults = cls.model_validate(data)
        for f in faults.faults:
            f.check_runs_on(runtime)
        return faults
