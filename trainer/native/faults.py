"""Failure injection and device pacing on a native rank, without touching the model or the schedule.

The vocabulary is the platform's one (trainer/fault_spec.py) and the padding rule the reference
trainer's (trainer/faults.py ``FaultInjector.after_compute``): a chunk's compute is first padded
to its paced time, the emulated device time (``pace_s_per_layer_token`` × layers × tokens / TP
for a forward, twice that for a backward), then slept ``(factor − 1) ×`` longer under an active
``slow_compute``. Pacing lets ranks sharing a few CPU cores behave like devices of a set speed,
so a slowed one is really ``factor`` times slower (the demo needs this: raw CPU time on a loaded
machine swings more than a fault does), and a sleeping rank does not steal CPU from the others.

The padding wraps the ``PipelineStage`` instance's ``forward_maybe_with_nosync`` and
``backward_maybe_with_nosync`` — the model's forward and the autograd backward, which torch's
``forward_one_chunk`` / ``backward_one_chunk`` call — so it lands inside the chunks the
``ScheduleWatcher`` times, as a throttled GPU's time would.

``stop_device`` SIGKILLs the rank inside its first forward chunk of ``at_iteration``: no goodbye
and mid-iteration, so its peers are in the schedule's and FSDP's collectives when its sockets
close, and the survivors recover without it (trainer/native/recovery.py). Only these two kinds are
injected here; a fault list with another kind is refused up front.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from torch.distributed.pipelining import PipelineStage

from collector.plan import RankRole
from trainer.fault_spec import FaultSpec
from trainer.faults import FaultInjector

NATIVE_KINDS = ("slow_compute", "stop_device")


def native_fault_problem(faults: list[FaultSpec]) -> str | None:
    """Why the native executor cannot inject ``faults`` (None: it can)."""
    other = sorted({f.kind for f in faults if f.kind not in NATIVE_KINDS})
    if other:
        return (f"the native executor injects only {', '.join(NATIVE_KINDS)}; remove {', '.join(other)} "
                "(or run the reference trainer)")
    return None


class ChunkPadding:
    """Pads the chunks of one device's stage to its paced time, then by its active ``slow_compute`` faults."""

    def __init__(self, faults: list[FaultSpec], device: int, pace_s_per_layer_token: float = 0.0) -> None:
        self.injector = FaultInjector(faults, device)
        self.pace = pace_s_per_layer_token
        self._attached: int | None = None
        self._paced_s_per_token = 0.0
        self._forward_paced_s = 0.0

    @property
    def idle(self) -> bool:
        return not self.injector.faults and self.pace <= 0

    def begin_iteration(self, iteration: int, stage: PipelineStage, role: RankRole) -> None:
        """Set the iteration the faults are judged at and wrap ``stage`` (a reshape builds a new one)."""
        self.injector.iteration = iteration
        if self.idle or self._attached == id(stage):
            return
        self._attached = id(stage)
        self._paced_s_per_token = self.pace * (role.end_layer - role.first_layer) / role.tp_degree
        forward, backward = stage.forward_maybe_with_nosync, stage.backward_maybe_with_nosync

        def padded_forward(*args: Any, **kwargs: Any) -> Any:
            self._kill_if_due()
            started = time.perf_counter()
            out = forward(*args, **kwargs)
            shape: tuple[int, ...] = tuple(getattr(args[0], "shape", ())) if args else ()
            tokens = shape[0] * shape[1] if len(shape) >= 2 else 0  # (B, T) ids or (B, T, dim) hidden
            self._forward_paced_s = self._paced_s_per_token * tokens
            self.injector.after_compute(time.perf_counter() - started, self._forward_paced_s)
            return out

        def padded_backward(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = backward(*args, **kwargs)
            self.injector.after_compute(time.perf_counter() - started, 2 * self._forward_paced_s)
            return out

        # mypy forbids replacing a method; padding this stage's compute is what the wrappers are for
        stage.forward_maybe_with_nosync = padded_forward  # type: ignore[method-assign]
        stage.backward_maybe_with_nosync = padded_backward  # type: ignore[method-assign]

    def _kill_if_due(self) -> None:
        if any(f.kind == "stop_device" and f.at_iteration == self.injector.iteration for f in self.injector.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def started(self, iteration: int) -> list[FaultSpec]:
        return self.injector.started(iteration)


__all__ = ["ChunkPadding", "native_fault_problem", "NATIVE_KINDS"]
