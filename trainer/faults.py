"""Failure injection for the torch trainer, driven by a scenario's ``faults:`` list.

The vocabulary is the simulator's (trainer/fault_spec.py), so one scenario file runs on either; the
kinds the trainer injects::

    faults:
      - kind: slow_compute      # every F/B chunk on the device takes ``factor`` times as long
        device: 5
        factor: 2.0
        at_iteration: 3
        duration_iterations: 17 # omit for "until the end"
      - kind: slow_send         # every pipeline send from the device is delayed by ``delay_s``
        device: 2
        delay_s: 0.02
      - kind: stop_device       # the process exits (os._exit) at the start of the iteration
        device: 6
        at_iteration: 4
      - kind: kill_in_reshape   # the process exits when it enters the first reshape it starts
        device: 3               # at or after this iteration (before the new world's rendezvous)
        at_iteration: 1
      - kind: kill_in_rendezvous  # the same, but after every device arrived, as the new
        device: 3                 # world's c10d rendezvous starts
        at_iteration: 1
      - kind: kill_in_transfer  # the same, but after the new world met (every device arrived,
        device: 3               # c10d rendezvous done), as the state transfer starts
        at_iteration: 1

Slowing is done by sleeping ``(factor - 1) × measured compute`` after each chunk, so the extra time
scales with the real work (long sequences get slower in absolute terms, as on a throttled GPU),
and a sleeping rank does not steal CPU from its neighbours on a shared machine.
"""

from __future__ import annotations

import os
import time

from collector.events import FaultInjected, Location
from trainer.fault_spec import FaultSpec

KILL_EXIT_CODE = 43


class FaultInjector:
    """The faults that touch one device, applied by the training loop at its hooks."""

    def __init__(self, faults: list[FaultSpec], device: int) -> None:
        self.faults = [f for f in faults if f.device == device]
        self.iteration = 0

    def begin_iteration(self, iteration: int) -> None:
        """Kill now if a kill fault starts at this iteration (no goodbye: peers see a dead socket)."""
        self.iteration = iteration
        for f in self.faults:
            if f.kind == "stop_device" and f.at_iteration == iteration:
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
            if f.kind == kind and f.at_iteration is not None and f.at_iteration <= iteration:
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

    def started(self, iteration: int) -> list[FaultSpec]:
        """Faults that begin at ``iteration`` (published as ground truth)."""
        return [f for f in self.faults if f.at_iteration == iteration]

    def truth(self, job: str, iteration: int) -> list[FaultInjected]:
        """The ``truth.fault`` events of the slowdowns that begin at ``iteration`` on this device."""
        return [FaultInjected(fault_id=f.id or f"{job}/{f.kind}/{f.device}/{iteration}", category=f.category,
                              location=Location(target="compute" if f.kind == "slow_compute" else "link",
                                                rank=f.device, factor=f.factor),
                              start_iteration=iteration, end_iteration=f.end_iteration)
                for f in self.started(iteration) if f.kind in ("slow_compute", "slow_send")]
