"""Telemetry from torch's own pipeline schedule, in our contract, without touching the model.

``ScheduleWatcher`` wraps the ``PipelineStage`` instance's ``forward_one_chunk`` and
``backward_one_chunk`` (what every torch schedule calls once per micro-batch, with its index), so
it times the F and B chunks of any ``nn.Module`` a user hands to pipelining. Point-to-point waits
are timed by wrapping the schedule module's ``_batch_p2p`` / ``_wait_batch_p2p`` (private to
torch 2.15, the one place the schedules wait on activations and gradients; the wrapper is
installed once per process and is inert when no watcher is active — if torch renames them, the
chunks are still timed and the p2p waits are simply absent). Timings go into trainer/telemetry.py's
``IterationRecorder`` on the rank's own clock; the worker publishes one ``RankIteration`` per
iteration through the same non-blocking ``TelemetryPublisher`` the reference trainer uses.

A watcher given a ``clock`` (a torchtitan rank's :class:`~trainer.torchtitan.clock.StepClock`)
marks each chunk's boundaries on it instead of reading the host's: on a GPU these are CUDA events,
which the host reaches long before the device does, so they are read once the iteration ends
(:meth:`ScheduleWatcher.end`, one wait for the device) rather than at each boundary.

Not timed yet: the TP all-reduces inside DTensor ops and FSDP's all-gather / reduce-scatter
(their time is inside the chunks and the step's tail).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

from collector.events import ChunkKind, CommOp, CommWait
from trainer.data import MicroBatch
from trainer.telemetry import IterationRecorder

_active: IterationRecorder | None = None
_p2p_timed = False  # torch's schedule module waits through our wrappers (installed once per process)


class _TaggedWork(list[dist.Work]):
    desc: str = ""


def _install_p2p_timer() -> None:
    global _p2p_timed
    if _p2p_timed or not hasattr(_schedules, "_wait_batch_p2p"):
        return
    batch, wait = _schedules._batch_p2p, _schedules._wait_batch_p2p

    def timed_batch(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
        out = _TaggedWork(batch(p2p_ops, desc=desc))
        out.desc = desc or ""
        return out

    def timed_wait(work: Any) -> None:
        rec = _active
        if rec is None:
            wait(work)
            return
        desc = getattr(work, "desc", "")
        op = (CommOp.PP_SENDRECV if "send" in desc and "recv" in desc
              else CommOp.PP_RECV if "recv" in desc else CommOp.PP_SEND)
        start = rec.now_s()
        wait(work)
        rec.comm.append(CommWait(op=op, start_s=max(0.0, start), duration_s=max(0.0, rec.now_s() - start),
                                 includes_wait=True, group="pp"))

    _schedules._batch_p2p = timed_batch
    _schedules._wait_batch_p2p = timed_wait
    _p2p_timed = True


class ChunkClock(Protocol):
    """Marks that may be read only later (trainer/torchtitan/clock.py's ``StepClock``)."""

    def mark(self) -> Any: ...

    def settle(self) -> None: ...

    def seconds(self, mark: Any) -> float: ...


class _HostClock:
    """The host's clock as a :class:`ChunkClock`: a mark is the time, and is read at once."""

    mark = staticmethod(time.perf_counter)

    def settle(self) -> None:
        pass

    def seconds(self, mark: float) -> float:
        return mark


class ScheduleWatcher:
    """Times every F and B chunk (and p2p wait) of one ``PipelineStage`` per iteration: on
    ``clock``'s marks (the host's clock when none is given), read when the iteration ends."""

    def __init__(self, stage: PipelineStage, clock: ChunkClock | None = None) -> None:
        _install_p2p_timer()
        self.recorder = IterationRecorder()
        self.microbatches: list[MicroBatch] = []
        self.clock: ChunkClock = clock or _HostClock()
        self._marked: list[tuple[ChunkKind, MicroBatch, Any, Any]] = []  # read at end()
        # mypy forbids replacing a method; timing this stage's chunks is what the wrappers are for
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk, ChunkKind.FORWARD)  # type: ignore[method-assign]
        stage.backward_one_chunk = self._timed(stage.backward_one_chunk, ChunkKind.BACKWARD)  # type: ignore[method-assign]

    def begin(self, microbatches: list[MicroBatch]) -> IterationRecorder:
        """Start an iteration running ``microbatches`` (chunk index i is ``microbatches[i]``)."""
        global _active
        self.recorder = IterationRecorder()
        self.microbatches = microbatches
        self._marked = []
        _active = self.recorder
        return self.recorder

    def end(self) -> IterationRecorder:
        global _active
        _active = None
        if self._marked:
            clock, rec = self.clock, self.recorder
            clock.settle()
            for kind, mb, start, end in self._marked:
                started = clock.seconds(start)
                rec.chunk(kind, mb.index, len(mb.tokens), mb.seq_lens, started - rec.t0, clock.seconds(end) - started)
            self._marked = []
        return self.recorder

    def _timed(self, run: Callable[..., Any], kind: ChunkKind) -> Callable[..., Any]:
        clock = self.clock

        def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = clock.mark()
            try:
                return run(chunk_id, *args, **kwargs)
            finally:
                end = clock.mark()
                if chunk_id < len(self.microbatches):
                    self._marked.append((kind, self.microbatches[chunk_id], start, end))
        return wrapper
