"""Failure injection for the torch trainer, driven by a small YAML fault list.

Format (a ``faults:`` list; the same keys the simulator's scenarios use where they overlap)::

    faults:
      - kind: slow_compute      # every F/B chunk on the rank takes ``factor`` times as long
        rank: 5                 # device id
        factor: 2.0
        start_iteration: 3
        end_iteration: 20       # exclusive; omit for "until the end"
      - kind: slow_send         # every pipeline send from the rank is delayed by ``delay_s``
        rank: 2
        delay_s: 0.02
        start_iteration: 0
      - kind: stop_device       # the process exits (os._exit) at the start of the iteration
        rank: 6                 # (the simulator's name; ``kill`` is read as an alias)
        start_iteration: 4
      - kind: kill_in_reshape   # the process exits when it enters the first reshape it starts
        rank: 3                 # at or after this iteration (before the new world's rendezvous)
        start_iteration: 1
      - kind: kill_in_rendezvous  # the same, but after every device arrived, as the new
        rank: 3                   # world's c10d rendezvous starts
        start_iteration: 1
      - kind: kill_in_transfer  # the same, but after the new world met (every device arrived,
        rank: 3                 # c10d rendezvous done), as the state transfer starts
        start_iteration: 1

Slowing is done by sleeping ``(factor - 1) × measured compute`` after each chunk, so the extra time
scales with the real work (long sequences get slower in absolute terms, as on a throttled GPU),
and a sleeping rank does not steal CPU from its neighbours on a shared machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

KILL_EXIT_CODE = 43
KIND_ALIASES = {"kill": "stop_device"}  # older trainer name -> the kind the simulator uses too


class Fault(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["slow_compute", "slow_send", "stop_device", "kill_in_reshape", "kill_in_rendezvous", "kill_in_transfer"]
    rank: int = Field(ge=0, description="device id")
    start_iteration: int = Field(default=0, ge=0)
    end_iteration: int | None = Field(default=None, description="exclusive")
    factor: float = Field(default=2.0, ge=1.0)
    delay_s: float = Field(default=0.0, ge=0.0)

    @field_validator("kind", mode="before")
    @classmethod
    def _simulator_names(cls, kind: object) -> object:
        """One vocabulary with the simulator's scenarios: a process exit is ``stop_device`` there
        and here; older fault files say ``kill``, read as the same kind."""
        return KIND_ALIASES.get(kind, kind) if isinstance(kind, str) else kind

    def active(self, iteration: int) -> bool:
        return self.start_iteration <= iteration and (self.end_iteration is None or iteration < self.end_iteration)


class FaultList(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")  # scenario files carry more sections

    faults: list[Fault] = Field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> FaultList:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ValueError(f"cannot read fault list {path}: {exc}") from None
        return cls.model_validate(data)


class FaultInjector:
    """The faults that touch one device, applied by the training loop at its hooks."""

    def __init__(self, faults: list[Fault], device: int) -> None:
        self.faults = [f for f in faults if f.rank == device]
        self.iteration = 0

    def begin_iteration(self, iteration: int) -> None:
        """Kill now if a kill fault starts at this iteration (no goodbye: peers see a dead socket)."""
        self.iteration = iteration
        for f in self.faults:
            if f.kind == "stop_device" and f.start_iteration == iteration:
                os._exit(KILL_EXIT_CODE)

    def begin_reshape(self, iteration: int) -> None:
        """Kill now if a ``kill_in_reshape`` fault is due: the rank dies after the launcher posted a
        world that holds it and before the new world meets (the race a real crash can hit)."""
        self._kill_if_due("kill_in_reshape", iteration)

    def begin_rendezvous(self, iteration: int) -> None:
        """Kill now if a ``kill_in_rendezvous`` fault is due: every device of the new world arrived
        (an abort no longer reaches them) and this one dies before it registers in the c10d
        rendezvous — the others wait there until the rendezvous timeout."""
        self._kill_if_due("kill_in_rendezvous", iteration)

    def begin_transfer(self, iteration: int) -> None:
        """Kill now if a ``kill_in_transfer`` fault is due: the rank dies after the new world met
        (past the arrival barrier, where an abort no longer reaches the others) and before the
        state moved — the survivors find out from a send, a receive or a group that never forms."""
        self._kill_if_due("kill_in_transfer", iteration)

    def _kill_if_due(self, kind: str, iteration: int) -> None:
        for f in self.faults:
            if f.kind == kind and f.start_iteration <= iteration:
                os._exit(KILL_EXIT_CODE)

    def after_compute(self, duration_s: float, paced_s: float = 0.0) -> None:
        """Pad compute that took ``duration_s`` (a chunk's, less its communication): first up to
        ``paced_s`` (the emulated device time, 0 when not pacing), then by the slow factor of any
        active slow_compute fault."""
        factor = 1.0
        for f in self.faults:
            if f.kind == "slow_compute" and f.active(self.iteration):
                factor *= f.factor
        wanted_s = factor * max(duration_s, paced_s)
        if wanted_s > duration_s:
            time.sleep(wanted_s - duration_s)

    def before_send(self) -> None:
        for f in self.faults:
            if f.kind == "slow_send" and f.active(self.iteration):
                time.sleep(f.delay_s)

    def started(self, iteration: int) -> list[Fault]:
        """Faults that begin at ``iteration`` (published as ground truth)."""
        return [f for f in self.faults if f.start_iteration == iteration]
