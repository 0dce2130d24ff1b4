"""One torchtitan rank's telemetry in the contract: chunks with their documents, steps, the loss.

Where the times come from, without touching torchtitan's code:

* **without pipelining** a step runs one ``forward_backward_step`` per micro-batch (gradient
  accumulation). A forward pre-hook (prepended, so FSDP's all-gather is inside) and a forward hook
  on the model time the F chunk; the rest of the call, up to the end of ``backward()``, is the B chunk;
* **with pipelining** torchtitan's ``pp_schedule`` is torch's schedule over ``PipelineStage``
  objects, and trainer/native/telemetry.py's ``ScheduleWatcher`` times every F and B chunk of each
  stage this rank holds on the step clock below (and its p2p waits on the host's);
* each micro-batch's documents come from its ``positions`` (they restart at 0 where a document
  starts; torchtitan's loaders and ours emit them): the lengths the detector's β·Σl² term needs.

The boundaries are marks of a :class:`~trainer.torchtitan.clock.StepClock`: the host's clock on CPU,
CUDA events on a GPU, read once at the step's end, so timing never serialises one micro-batch with
the next (the chunks of a step are written into its report then). An injected slowdown needs the
chunk's length at once, so a rank with one waits for the device at its boundaries.

Injected faults (``--resihp.faults``): a ``slow_compute`` on this rank's device stretches each chunk
by its factor (trainer/faults.py's padding); ``stop_device`` kills the rank in its forward
(trainer/native/faults.py's ``ChunkPadding`` does both on pipeline stages).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from collector.events import ChunkKind, CommOp, CommWait, TracingDeclared
from collector.settings import environment
from trainer.agent.flight import FlightRecorder
from trainer.data import MicroBatch
from trainer.fault_spec import FaultList
from trainer.faults import FaultInjector
from trainer.integration import IterationReport, ResiHPReporter
from trainer.native.faults import native_fault_problem
from trainer.torchtitan.clock import StepClock

if TYPE_CHECKING:
    from trainer.torchtitan.trainer import ResiHPSection, ResiHPTrainer


_syncing: StepTelemetry | None = None  # the rank's telemetry while a step runs (FSDP's hooks report to it)
_sync_depth = 0
_sync_timed = False


def _install_sync_timer() -> None:
    """Time FSDP2's own gradient reduction and parameter all-gathers, once per process.

    The collectives run inside the model's forward and backward (FSDP's hooks), so a chunk timed
    around them holds each rank's wait for the slowest peer: every healthy replica's backward grows
    with a slow one's, and the slow rank stands out by less than its slowdown. Wrapping the four
    methods of ``FSDPParamGroup`` / ``FSDPState`` that issue and wait on them (private to torch
    2.15; if torch renames them, nothing is subtracted and the chunks hold the waits as before)
    lets :class:`StepTelemetry` report those seconds as waits (``all_gather``, ``reduce_scatter``)
    and the chunks without them. Inert when no step is being timed."""
    global _sync_timed
    if _sync_timed:
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return
    targets = [(FSDPParamGroup, "unshard", "all_gather"), (FSDPParamGroup, "wait_for_unshard", "all_gather"),
               (FSDPParamGroup, "post_backward", "reduce_scatter"),
               (FSDPState, "_root_post_backward_final_callback", "reduce_scatter")]
    for cls, name, op in targets:
        method = getattr(cls, name, None)
        if method is not None:
            setattr(cls, name, _timed_sync(method, op))
    _sync_timed = True


def _timed_sync(method: Any, op: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        global _sync_depth
        telemetry = _syncing
        if telemetry is None or _sync_depth:
            return method(*args, **kwargs)
        _sync_depth += 1
        started = telemetry.clock.mark()
        try:
            return method(*args, **kwargs)
        finally:
            _sync_depth -= 1
            telemetry.synced(op, started, telemetry.clock.mark())
    return timed


def document_lengths(positions: torch.Tensor | None, labels: torch.Tensor) -> list[int]:
    """The packed documents' lengths of a (B, L) micro-batch, row after row; one document per row
    when the loader gave no positions."""
    if positions is None:
        return [int(labels.shape[-1])] * int(labels.shape[0]) if labels.dim() > 1 else [int(labels.numel())]
    rows = positions if positions.dim() > 1 else positions.unsqueeze(0)
    lengths: list[int] = []
    for row in rows:
        starts = torch.nonzero(row == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, int(row.numel())]
        lengths += [b - a for a, b in zip(bounds, bounds[1:]) if b > a]
    return lengths


class StepTelemetry:
    """The telemetry of one rank; :meth:`attach` builds it for a trainer."""

    def __init__(self, trainer: ResiHPTrainer, reporter: ResiHPReporter, injector: FaultInjector | None,
                 flight: FlightRecorder | None) -> None:
        self.trainer, self.reporter, self.injector, self.flight = trainer, reporter, injector, flight
        self.report: IterationReport | None = None
        self.group: list[MicroBatch] = []  # the micro-batches of the forward_backward_step under way
        self._next_index = 0
        self._tokens = 0
        self.clock = StepClock.for_device(getattr(trainer, "device", "cpu"))
        self._forward_started: Any = 0.0  # the clock's marks
        self._forward_ended: Any = 0.0
        self.watchers: list[Any] = []
        self.loss: float | None = None
        self.reports_summary = False  # this rank reports the step's tokens and loss (one rank per job)
        self._syncs: list[tuple[str, Any, Any]] = []  # FSDP's collectives this micro-batch: (op, start, end marks)
        self._timed: list[_FusedMarks] = []  # this step's micro-batches, read at its end

    @classmethod
    def attach(cls, trainer: ResiHPTrainer, section: ResiHPSection) -> StepTelemetry:
        env = environment()
        job = section.job or env.job or "torchtitan"
        under_agent = bool(env.flight_dir)  # the node agent heartbeats for its ranks
        reporter = ResiHPReporter(job, trainer.device_id, trainer.layout.coords(trainer.world_rank),
                                  epoch=trainer.plan_epoch, heartbeat_s=None if under_agent else 1.0)
        faults = FaultList.load(section.faults, "trainer").faults if section.faults else []
        problem = native_fault_problem(faults)
        if problem:
            raise ValueError(problem.replace("the native executor", "a torchtitan rank"))
        injector = FaultInjector(faults, trainer.device_id) if faults else None
        self = cls(trainer, reporter, injector, FlightRecorder.from_env())
        if trainer.parallel_dims.pp_enabled:
            self._watch_schedule()
        else:
            self._hook_model(trainer.model_parts[0])
        self._wrap_metrics_log()
        pd = trainer.parallel_dims
        tp_rank = trainer.layout.coords(trainer.world_rank)[0]
        batch_rank = trainer.layout.coords(trainer.world_rank)[2]
        last_stage = trainer.pp_has_last_stage if pd.pp_enabled else True
        self.reports_summary = last_stage and tp_rank == 0 and batch_rank == 0
        if trainer.world_rank == 0:
            reporter.publisher.publish(TracingDeclared(epoch=trainer.plan_epoch, dialect="torchtitan", seq_lens=True,
                                                       tokens=True, fused_p2p=False))
        return self

    # ---- one step ----------------------------------------------------------------------------------

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.flight is not None:
            self.flight.step(step)
        if self.injector is not None:
            self.injector.iteration = step
            for truth in self.injector.truth(self.reporter.job, step):
                self.reporter.publisher.publish(truth)
        self._next_index, self._tokens, self.loss, self._timed = 0, 0, None, []
        for w in self.watchers:
            w.begin([])
        with self.reporter.iteration(step) as report:
            self.report = report
            self.clock.begin()
            yield
            self._write_chunks(report)
            for w in self.watchers:
                rec = w.end()
                report.recorder.chunks += rec.chunks
                report.recorder.comm += rec.comm
            if self.reports_summary:
                report.summary(tokens=self._tokens * self.trainer.layout.batch, loss=self.loss)
        self.report = None

    def microbatch(self, positions: torch.Tensor | None, labels: torch.Tensor) -> None:
        """A micro-batch entered the model (``post_dataloading_process``): its index and documents."""
        lens = document_lengths(positions, labels)
        flat = labels.reshape(-1)
        mb = MicroBatch(iteration=self.trainer.step, index=self._next_index, tokens=flat, targets=flat,
                        positions=flat if positions is None else positions.reshape(-1), seq_lens=lens)
        self._next_index += 1
        self._tokens += int(flat.numel())
        self.group.append(mb)
        for w in self.watchers:
            w.microbatches = self.group

    def synced(self, op: str, start: Any, end: Any) -> None:
        """FSDP waited from mark ``start`` to mark ``end`` in ``op`` (see :func:`_install_sync_timer`)."""
        self._syncs.append((op, start, end))

    def begin_group(self) -> None:
        """A ``forward_backward_step`` begins: its micro-batches are numbered on from the last."""
        self.group = []

    @contextmanager
    def fused_chunks(self) -> Iterator[None]:
        """One micro-batch's F and B without pipelining: F from the forward hooks, B the rest, each
        without FSDP's collectives, which are reported as the waits they are. Marked now, written
        into the report when the step ends (:meth:`_write_chunks`)."""
        global _syncing
        self._syncs = []
        _syncing = self
        try:
            yield
        finally:
            _syncing = None
        ended = self.clock.mark()
        if self.injector is not None:  # the padding is a multiple of the backward's length: read now
            self.clock.settle()
            forward_end = self.clock.seconds(self._forward_ended)
            waits = sum(self.clock.seconds(e) - self.clock.seconds(s) for _, s, e in self._syncs
                        if self.clock.seconds(s) >= forward_end)
            self.injector.after_compute(max(0.0, self.clock.seconds(ended) - forward_end - waits))
            ended = self.clock.mark()
        if self.report is not None and self.group:
            mb = self.group[-1]
            self._timed.append(_FusedMarks(mb.index, len(mb.tokens), mb.seq_lens, self._forward_started,
                                           self._forward_ended, ended, self._syncs))

    def _write_chunks(self, report: IterationReport) -> None:
        """The step's F and B chunks and FSDP waits, from their marks (one wait for the device)."""
        if not self._timed:
            return
        clock, t0 = self.clock, report.recorder.t0
        clock.settle()
        for m in self._timed:
            start, forward_end, end = clock.seconds(m.forward_started), clock.seconds(m.forward_ended), clock.seconds(m.ended)
            syncs = [(op, clock.seconds(s), clock.seconds(e)) for op, s, e in m.syncs]
            forward_sync_s = sum(e - s for _, s, e in syncs if s < forward_end)  # the all-gathers inside the forward
            backward_sync_s = sum(e - s for _, s, e in syncs if s >= forward_end)
            report.chunk(ChunkKind.FORWARD, m.index, duration_s=max(0.0, forward_end - start - forward_sync_s),
                         tokens=m.tokens, seq_lens=m.seq_lens, start_s=start - t0)
            report.chunk(ChunkKind.BACKWARD, m.index, duration_s=max(0.0, end - forward_end - backward_sync_s),
                         tokens=m.tokens, seq_lens=m.seq_lens, start_s=forward_end - t0)
            for op, s, e in syncs:  # FSDP's collectives hold the wait for the slowest peer
                report.recorder.comm.append(CommWait(op=CommOp(op), microbatch=m.index, start_s=max(0.0, s - t0),
                                                     duration_s=e - s, includes_wait=True, group="fsdp"))
        self._timed = []

    # ---- hooks ---------------------------------------------------------------------------------------

    def _hook_model(self, model: torch.nn.Module) -> None:
        def before(_module: Any, _args: Any) -> None:
            if self.injector is not None and any(f.kind == "stop_device" and f.at_iteration == self.injector.iteration
                                                 for f in self.injector.faults):
                os.kill(os.getpid(), signal.SIGKILL)  # no goodbye, mid-step: a device lost
            if self.flight is not None:
                self.flight.enter("forward")  # progress the agent's hang judge reads (trainer/agent/hang.py)
            self._forward_started = self.clock.mark()

        def after(_module: Any, _args: Any, _out: Any) -> None:
            self._forward_ended = self.clock.mark()
            if self.injector is not None:  # the padding is a multiple of the forward's length: read now
                clock = self.clock
                clock.settle()
                waits = sum(clock.seconds(e) - clock.seconds(s) for _, s, e in self._syncs)  # all inside the forward
                clock_s = clock.seconds(self._forward_ended) - clock.seconds(self._forward_started)
                self.injector.after_compute(max(0.0, clock_s - waits))
                self._forward_ended = clock.mark()
            if self.flight is not None:
                self.flight.enter("backward")

        model.register_forward_pre_hook(before, prepend=True)
        model.register_forward_hook(after)
        _install_sync_timer()

    def _watch_schedule(self) -> None:
        from trainer.native.faults import ChunkPadding
        from trainer.native.telemetry import ScheduleWatcher

        schedule = self.trainer.pp_schedule
        stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        for stage in stages:
            if self.injector is not None:
                padding = ChunkPadding(self.injector.faults, self.trainer.device_id)
                padding.injector = self.injector
                padding.begin_iteration(0, stage, _role_for_padding())
            self.watchers.append(ScheduleWatcher(stage, self.clock))

    def _wrap_metrics_log(self) -> None:
        """The loss torchtitan logs (every ``--metrics.log_freq`` steps) goes in the step's summary."""
        processor = self.trainer.metrics_processor
        log = processor.log

        def logged(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
            self.loss = float(global_avg_loss) if global_avg_loss >= 0 else None
            return log(step, global_avg_loss, *args, **kwargs)

        processor.log = logged

    def finished(self) -> None:
        """The rank is past its last step (its flight record says so: teardown is not a hang)."""
        if self.flight is not None:
            self.flight.finish()
            self.flight = None

    def close(self) -> None:
        self.finished()
        self.reporter.close()


@dataclass
class _FusedMarks:
    """One micro-batch's boundaries as the clock marked them, read when the step ends."""

    index: int
    tokens: int
    seq_lens: list[int]
    forward_started: Any
    forward_ended: Any
    ended: Any
    syncs: list[tuple[str, Any, Any]]


def _role_for_padding() -> Any:
    """ChunkPadding sizes a paced device from its role; torchtitan ranks are not paced."""
    from collector.plan import RankRole

    return RankRole(device=0, replica=0, stage=0, tp_rank=0, tp_degree=1, first_layer=0, end_layer=1,
                    microbatches=1, num_stages=1)
