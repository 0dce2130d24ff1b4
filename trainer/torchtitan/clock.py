"""Where a torchtitan rank reads its chunk boundaries: the host clock on CPU, CUDA events on a GPU.

On a GPU the host reaches a chunk's end long before the device does (kernels only queue), so a host
clock needs a ``torch.cuda.synchronize`` at every boundary, and that costs the overlap of one
micro-batch with the next. Events are recorded on the current stream instead, without waiting, and
read once per step (:meth:`StepClock.settle`: one wait for the step's last event); their times
are placed on the host's ``perf_counter`` scale from an event recorded with the host's time when the
step began, so the rank's report keeps one clock. On CPU a mark is the host's time and settling
does nothing.

Marks are opaque: ``mark()`` gives one, ``seconds(mark)`` reads it after ``settle()``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class _Event(Protocol):  # what this module uses of torch.cuda.Event
    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class StepClock:
    """One rank's marks for one step at a time. ``event_type``: a CUDA event class (``torch.cuda.Event``)
    on a GPU, None on CPU."""

    def __init__(self, event_type: Any = None) -> None:
        self.event_type = event_type
        self._base: _Event | None = None
        self._base_host = 0.0
        self._last: _Event | None = None

    @classmethod
    def for_device(cls, device: Any) -> StepClock:
        """Events when ``device`` is a CUDA device, the host clock otherwise."""
        import torch

        on_gpu = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        return cls(torch.cuda.Event if on_gpu else None)

    @property
    def device_events(self) -> bool:
        return self.event_type is not None

    def begin(self) -> None:
        """A step begins: the event later marks are read against, with the host's time."""
        if self.event_type is not None:
            self._base = self._record()
            self._base_host = time.perf_counter()

    def mark(self) -> float | _Event:
        """Now, on the device's timeline (queued work included) or the host's."""
        if self.event_type is None:
            return time.perf_counter()
        return self._record()

    def settle(self) -> None:
        """Wait until the step's marks so far have happened on the device (one wait a step)."""
        if self._last is not None:
            self._last.synchronize()

    def seconds(self, mark: float | _Event) -> float:
        """A settled mark on the host's ``perf_counter`` scale."""
        if isinstance(mark, float):
            return mark
        if self._base is None:
            raise RuntimeError("a device mark read outside a step (StepClock.begin was not called)")
        return self._base_host + self._base.elapsed_time(mark) / 1e3

    def _record(self) -> _Event:
        event = self.event_type(enable_timing=True)
        event.record()
        self._last = event
        return event
