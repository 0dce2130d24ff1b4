"""Failure injection on a native rank: a slow device, without touching the model or the schedule.

The vocabulary is the platform's one (trainer/fault_spec.py) and the padding rule the reference
trainer's (trainer/faults.py ``FaultInjector.after_compute``: sleep ``(factor − 1) ×`` the measured
compute, so a sleeping rank does not steal CPU from its neighbours). It is applied with module
hooks on the stage model, which run inside the chunks torch's schedule runs — so the chunk
timings the ``ScheduleWatcher`` publishes carry the slowdown, as a throttled GPU's would: the
forward hook pads the forward by its own time; a hook on the forward's output pads the backward
(twice the forward, a backward's usual cost) when its gradient arrives.

Only ``slow_compute`` is injected here: the native executor cannot yet recover a killed rank
(docs/native.md), so a fault list with another kind is refused up front.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from trainer.fault_spec import FaultSpec
from trainer.faults import FaultInjector

NATIVE_KINDS = ("slow_compute",)


def native_fault_problem(faults: list[FaultSpec]) -> str | None:
    """Why the native executor cannot inject ``faults`` (None: it can)."""
    other = sorted({f.kind for f in faults if f.kind not in NATIVE_KINDS})
    if other:
        return (f"the native executor injects only {', '.join(NATIVE_KINDS)}; remove {', '.join(other)} "
                "(or run the reference trainer)")
    return None


class SlowCompute:
    """Pads the chunks of one device's stage model by its active ``slow_compute`` faults."""

    def __init__(self, faults: list[FaultSpec], device: int) -> None:
        self.injector = FaultInjector(faults, device)
        self._attached: int | None = None
        self._started = 0.0

    @property
    def idle(self) -> bool:
        return not self.injector.faults

    def begin_iteration(self, iteration: int, model: nn.Module) -> None:
        """Set the iteration the faults are judged at and hook ``model`` (a reshape builds a new one)."""
        self.injector.iteration = iteration
        if self.idle or self._attached == id(model):
            return
        self._attached = id(model)
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, module: nn.Module, args: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        forward_s = time.perf_counter() - self._started
        self.injector.after_compute(forward_s)
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: self.injector.after_compute(2 * forward_s))

    def started(self, iteration: int) -> list[FaultSpec]:
        return self.injector.started(iteration)


__all__ = ["SlowCompute", "native_fault_problem", "NATIVE_KINDS"]
