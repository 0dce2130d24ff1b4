"""The integration API: how a training loop that is not ours (Megatron-, torchtitan-style) joins ResiHP.

Two objects, one per side of the contract:

* ``ResiHPReporter`` (every rank): per iteration, the chunks it ran (F / B / W per micro-batch,
  with tokens and packed sequence lengths) and the communication it waited on, published as one
  ``telemetry.iteration`` event; heartbeats on a timer. It rides on trainer/telemetry.py's
  ``TelemetryPublisher`` (a queue and a daemon thread), so recording a chunk is a list append and
  ending an iteration a ``put_nowait``: a slow or broken bus never slows training. When the queue
  is full the oldest telemetry is dropped and counted (``reporter.dropped``).
* ``CommandListener`` (rank 0, or the launcher — exactly one reader per job): announces the running
  plan (``plan.current``) and what the loop can run (``plan.capabilities``, optional), reads ``command.reconfigure`` for this job and fences it by epoch:
  epoch e+1 is handed to the loop only on top of e; a command seen before is acknowledged
  ``ignored_duplicate`` and any other epoch ``ignored_stale``, without the loop seeing them. The
  loop reshapes (or cannot) and says so with ``ack_applied(command, pause_s)`` / ``ack_failed``.

Probes (optional; the detector asks only when its config says ``probes: true``): the listener also
collects this job's ``probe.request`` events (``take_probes()``). The loop shares each with every
rank at an iteration boundary, as it shares plans; every rank times the workload
(``best_seconds``), the ranks gather their times, and ``probe_answer`` turns them into this rank's
``probe.result`` against the median, which ``reporter.answer_probe`` publishes. The workload is
the loop's own (one GEMM of a layer for ``compute``, one activation sent to the next rank for
``link``); the protocol is trainer/reference/probe.py's, which our torch trainer runs.

Runs: each listener serves one run incarnation of the job (``run``: new random bits by default,
announced in every ``plan.current`` it publishes). It refuses, and reports, a command for another
run, one without a run or an expiry, and one past its expiry (collector/epoch_fence.py's
``order_refusal``): a signed command replayed from another run of the same job name, or kept for
a month, is history. A loop that restarts and resumes the same run passes its ``run`` again: the
listener rebuilds its fence from its own acknowledgements on the log, so it never obeys an epoch it
already applied, an older one, or a command it already answered.

Trust: the listener hands over only commands signed by the engine (or the job's own executor) and
probes signed by analytics and within :func:`probe_refusal`'s bounds (collector/auth.py); anything
else is published as ``control.rejected`` with why and never reaches the loop. Its acknowledgements
are signed with the executor's key.

Durations are measured on the rank's own clock; never subtract the clocks of two hosts. On a GPU,
measure chunks with CUDA events and pass ``start_s`` / ``duration_s`` explicitly (docs/real-cluster.md);
``time_chunk`` times with the host clock, which is right only for synchronous (CPU) work.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from collector import topics
from collector.auth import Gate, Keyring, Signer
from collector.epoch_fence import COMMAND_TTL_S, EpochFence, new_run, order_refusal
from collector.bus import Bus, Consumer, OnAssign, RawMessage, TopicPartition, open_bus
from collector.events import (AckStatus, Chunk, ChunkKind, CommandAck, CommOp, CommWait, Coords, Envelope, EventFactory,
                              ExecutorCapabilities, IterationSummary, Payload, PlanCurrent, PlanCurrentReason, ProbeRequest,
                              ProbeResult, RankIteration,
                              ReconfigureCommand)
from collector.plan import Plan
from collector.stream import EventStream
from trainer.telemetry import IterationRecorder, TelemetryPublisher
from trainer.protocol import acknowledgement

BusSource = Bus | Callable[[], Bus] | None


@runtime_checkable
class IntegerArray(Protocol):
    """A tensor or array of whole numbers (``torch.Tensor``, ``numpy.ndarray``): one ``tolist()`` turns it
    into plain ints without importing either library here."""

    def tolist(self) -> list[int]: ...


class _Borrowed(Bus):
    """A bus the caller owns: usable by the publisher thread, never closed by it."""

    def __init__(self, bus: Bus) -> None:
        self._bus, self.name = bus, bus.name

    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        self._bus.publish_raw(messages)

    def consumer(self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None,
                 instance_id: str | None = None) -> Consumer:
        return self._bus.consumer(group, topics, on_assign, instance_id)

    def end_offsets(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        return self._bus.end_offsets(topics)

    def close(self) -> None:
        pass


def _bus_opener(bus: BusSource) -> Callable[[], Bus]:
    """A Bus instance is borrowed (the caller closes it); a callable or None (``open_bus()`` from
    RESIHP_BUS & co.) is opened by the publisher thread, which closes it at the end."""
    if isinstance(bus, Bus):
        return lambda: _Borrowed(bus)
    return bus if bus is not None else open_bus


def seq_lens_from_cu_seqlens(cu_seqlens: Iterable[int] | IntegerArray) -> list[int]:
    """Packed sequence lengths from cumulative offsets ``[0, l0, l0+l1, ...]`` (flash-attention's
    ``cu_seqlens``; a tensor, array or list). Raises ValueError if the offsets decrease."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, IntegerArray) else list(cu_seqlens)
    lens = [int(b) - int(a) for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must not decrease, got {values[:8]}...; pass the cumulative offsets")
    return [n for n in lens if n > 0]  # padding slots repeat the last offset


def coords_in(plan: Plan, rank: int) -> Coords:
    """This device's (tp, pp, dp) coordinates under ``plan`` (KeyError if the plan leaves it out)."""
    role = plan.role_of(rank)
    return Coords(tp=role.tp_rank, pp=role.stage, dp=role.replica)


class IterationReport:
    """What one rank ran in one iteration; built inside ``with reporter.iteration(i) as it:``."""

    def __init__(self, reporter: ResiHPReporter, iteration: int, epoch: int) -> None:
        self.reporter, self.iteration, self.epoch = reporter, iteration, epoch
        self.recorder = IterationRecorder()
        self.wall_s: float | None = None  # None: host time from entering the block to leaving it
        self._summary: tuple[int, float | None, float | None] | None = None  # tokens, loss, wall_s

    def now_s(self) -> float:
        """Host seconds since this iteration started (the base of every ``start_s``)."""
        return self.recorder.now_s()

    def chunk(self, kind: str | ChunkKind, microbatch: int, *, duration_s: float, tokens: int | None = None,
              seq_lens: Sequence[int] | None = None, start_s: float | None = None, virtual_stage: int = 0) -> None:
        """Record a chunk measured elsewhere (CUDA events). ``tokens`` defaults to Σ ``seq_lens``;
        ``start_s`` (from the iteration start, this rank's clock) defaults to now − duration."""
        lens = None if seq_lens is None else [int(n) for n in seq_lens]
        if tokens is None:
            if lens is None:
                raise ValueError("chunk() needs tokens or seq_lens (the detector's cost model is per token)")
            tokens = sum(lens)
        if lens is not None and sum(lens) > tokens:
            raise ValueError(f"seq_lens sum to {sum(lens)} tokens but the chunk has only {tokens}; "
                             "pass the lengths of the sequences packed into this micro-batch")
        if start_s is None:
            start_s = self.now_s() - duration_s
        self.recorder.chunks.append(Chunk(kind=ChunkKind(kind), microbatch=microbatch, virtual_stage=virtual_stage,
                                          tokens=tokens, seq_lens=lens, start_s=max(0.0, start_s),
                                          duration_s=max(0.0, duration_s)))

    @contextmanager
    def time_chunk(self, kind: str | ChunkKind, microbatch: int, tokens: int | None = None,
                   seq_lens: Sequence[int] | None = None, *, virtual_stage: int = 0) -> Iterator[None]:
        """Time the block with the host clock. Asynchronous (CUDA) work must be synchronised at
        the end of the block, or use CUDA events and ``chunk()``. Nothing is recorded on error."""
        start = self.now_s()
        yield
        self.chunk(kind, microbatch, tokens=tokens, seq_lens=seq_lens, start_s=start,
                   duration_s=self.now_s() - start, virtual_stage=virtual_stage)

    def comm_wait(self, op: str | CommOp, *, duration_s: float, start_s: float | None = None, peer: int | None = None,
                  microbatch: int | None = None, nbytes: int | None = None) -> None:
        """Record a communication wait measured elsewhere (``peer``: device id for point-to-point)."""
        if start_s is None:
            start_s = self.now_s() - duration_s
        self.recorder.comm.append(CommWait(op=CommOp(op), peer=peer, microbatch=microbatch, bytes=nbytes,
                                           start_s=max(0.0, start_s), duration_s=max(0.0, duration_s)))

    def time_comm(self, op: str | CommOp, *, peer: int | None = None, microbatch: int | None = None,
                  nbytes: int | None = None):  # a context manager
        """Time a blocking collective or receive with the host clock (trainer/telemetry.py's timer)."""
        return self.recorder.comm_wait(CommOp(op), peer=peer, microbatch=microbatch, nbytes=nbytes)

    def summary(self, *, tokens: int, loss: float | None = None, wall_s: float | None = None) -> None:
        """The job-level line of this iteration (``telemetry.summary``): call it on one rank only
        (world rank 0, or the last stage that knows the loss). ``tokens``: the whole global batch."""
        self._summary = (tokens, loss, wall_s)

    def payloads(self, wall_s: float) -> list[RankIteration | IterationSummary]:
        r = self.reporter
        out: list[RankIteration | IterationSummary] = [RankIteration(
            epoch=self.epoch, iteration=self.iteration, rank=r.rank, node=r.node, coords=r.coords, wall_s=wall_s,
            chunks=self.recorder.chunks, comm=self.recorder.comm)]
        if self._summary is not None:
            tokens, loss, summary_wall_s = self._summary
            out.append(IterationSummary(epoch=self.epoch, iteration=self.iteration, loss=loss, tokens=tokens,
                                        wall_s=wall_s if summary_wall_s is None else summary_wall_s))
        return out


class ResiHPReporter:
    """One rank's telemetry: ``with reporter.iteration(i) as it: it.chunk(...)``; heartbeats on a timer.

    ``rank`` is the device id plans name: keep it stable across reshapes (the global rank at job
    start). ``bus``: a Bus you own (borrowed, not closed), a callable that opens one, or None for
    ``open_bus()`` from the environment. ``heartbeat_s`` None: no heartbeats of its own (under
    ``resihp run`` the node agent sends one per live rank). Call ``close()`` at the end (it flushes, up to a timeout).
    """

    def __init__(self, job: str, rank: int, coords: Coords | tuple[int, int, int], *, bus: BusSource = None,
                 epoch: int = 0, node: int | None = None, heartbeat_s: float | None = 1.0, max_queued: int = 10_000) -> None:
        self.job, self.rank, self.node, self.epoch = job, rank, node, epoch
        self.coords = coords if isinstance(coords, Coords) else Coords(tp=coords[0], pp=coords[1], dp=coords[2])
        self.publisher = TelemetryPublisher(_bus_opener(bus), job, rank, heartbeat_s, max_queued)
        self.publisher.epoch = epoch

    @property
    def dropped(self) -> int:
        """Telemetry messages dropped so far (queue full, or the bus refused a batch)."""
        return self.publisher.dropped

    def set_role(self, epoch: int, coords: Coords | tuple[int, int, int] | None = None) -> None:
        """After a reshape: the epoch now running and this rank's new coordinates."""
        self.epoch = self.publisher.epoch = epoch
        if coords is not None:
            self.coords = coords if isinstance(coords, Coords) else Coords(tp=coords[0], pp=coords[1], dp=coords[2])

    def follow(self, plan: Plan) -> None:
        """``set_role`` from a plan (this rank must have a role in it)."""
        self.set_role(plan.epoch, coords_in(plan, self.rank))

    @contextmanager
    def iteration(self, iteration: int, *, epoch: int | None = None) -> Iterator[IterationReport]:
        """Collect one iteration; published when the block ends normally (an iteration that
        raised, e.g. a peer died mid-step, is not reported: it did not commit)."""
        report = IterationReport(self, iteration, self.epoch if epoch is None else epoch)
        self.publisher.iteration = iteration  # heartbeats carry the last iteration started
        yield report
        wall_s = report.wall_s if report.wall_s is not None else report.now_s()
        for payload in report.payloads(wall_s):
            self.publisher.publish(payload)

    def answer_probe(self, result: ProbeResult | None) -> None:
        """Publish this rank's ``probe.result`` (from ``probe_answer``; None, not asked, publishes nothing)."""
        if result is not None:
            if result.rank != self.rank:
                raise ValueError(f"probe result for rank {result.rank} given to rank {self.rank}'s reporter")
            self.publisher.publish(result)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout_s``) and stop the publisher thread."""
        self.publisher.close(timeout_s)

    def __enter__(self) -> ResiHPReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- commands ---------------------------------------------------------------------------------------


class CommandListener:
    """The one reader of this job's commands (rank 0 or the launcher): fence, hand over, acknowledge.

    ``poll()`` returns the next command to apply, or None; while a returned command is not yet
    acknowledged it returns None and keeps the rest queued, so each is judged against the epoch
    the previous one left running. By default it reads commands published from now on
    (``from_beginning=True`` re-reads the log: old commands are then acked as stale).
    ``check(plan) -> reason | None`` fails plans the loop cannot run before it sees them.

    ``run``: None starts a new run (``self.run``, fresh random bits); a loop that resumes a run
    after a restart passes the ``run`` it had (keep it with the checkpoint), and the fence is
    rebuilt from that run's acknowledgements and ``plan.current`` on the control topic: the epoch
    never goes below one the run applied, and answered command ids stay answered. ``clock``
    gives the time commands' expiries are judged by (the host's Unix time).
    """

    def __init__(self, job: str, plan: Plan, *, bus: BusSource = None, check: Callable[[Plan], str | None] | None = None,
                 group: str | None = None, from_beginning: bool = False, source: str = "trainer",
                 run: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.job, self.running = job, plan
        self._owned = not isinstance(bus, Bus)
        self.bus: Bus = bus if isinstance(bus, Bus) else (bus or open_bus)()
        self.fence = EpochFence(plan.epoch, check)
        self.factory = Signer(EventFactory(job, source), "executor")
        self.gate = Gate(source, self.factory.keyring)
        self.clock = clock
        self.run = run or new_run()
        if run is not None:
            self._recall_fence()
        self.acks: list[CommandAck] = []
        self._queue: deque[ReconfigureCommand] = deque()
        self.pending: ReconfigureCommand | None = None
        self._announced: PlanCurrent | None = None
        self._probes: list[ProbeRequest] = []
        self._probes_seen: set[str] = set()
        # "From now on" is the log's end *now*, not when the group gets around to assigning the
        # partition (on Kafka that is the first poll): a command published in between still counts.
        start = None if from_beginning else self.bus.end_offsets(list(topics.TRAINER_TOPICS))
        start_at_end = None if start is None else (lambda tps: {tp: start.get(tp, 0) for tp in tps})
        self.stream = EventStream(self.bus, group or f"trainer:{job}", list(topics.TRAINER_TOPICS),
                                  on_assign=start_at_end, job=job)

    def _recall_fence(self) -> None:
        """Rebuild the fence of a resumed run from this run's own acknowledgements (answered ids,
        applied epochs) and ``plan.current`` (the epochs it ran) on the control topic."""
        for ev in signed_history(self.bus, self.job, (CommandAck, PlanCurrent), self.factory.keyring):
            if isinstance(p := ev.payload, (CommandAck, PlanCurrent)):
                self.fence.recall(p, self.run)

    def announce_plan(self, plan: Plan | None = None, *, reason: PlanCurrentReason = "start", gpus_per_node: int = 8,
                      model_name: str = "", layer_state_bytes: int = 0, tokens_per_microbatch: int = 0) -> None:
        """Publish ``plan.current`` (at start; ``ack_applied`` re-announces after a reshape). The
        planner needs ``layer_state_bytes`` (parameters + optimizer state of one layer) to cost a
        reshape and ``tokens_per_microbatch`` to turn iteration time into tokens/s."""
        self._announced = PlanCurrent(plan=plan or self.running, reason=reason, gpus_per_node=gpus_per_node,
                                      model_name=model_name, layer_state_bytes=layer_state_bytes,
                                      tokens_per_microbatch=tokens_per_microbatch, run=self.run)
        self.bus.publish([self.factory.make(self._announced)])

    @property
    def announced(self) -> bool:
        """Whether this listener has said its plan (``announce_plan``) yet."""
        return self._announced is not None

    def announce_capabilities(self, capabilities: ExecutorCapabilities) -> None:
        """Publish ``plan.capabilities``: which remediations this loop can run, so the engine proposes
        only those (collector/capabilities.py). A loop that never declares is planned for as if it
        could run every plan; pass ``check`` to refuse what it cannot run anyway."""
        self.bus.publish([self.factory.make(capabilities)])

    def poll(self, timeout_s: float = 0.0) -> ReconfigureCommand | None:
        """Read new commands; acknowledge the ones to ignore; return the next one to apply."""
        for delivery in self.stream.poll(timeout_s=timeout_s):
            ev = delivery.event
            if ev.job != self.job or not isinstance(ev.payload, (ReconfigureCommand, ProbeRequest)):
                continue
            if delivery.topic != topics.obeyed_from(ev.kind):
                continue  # the control topic's copy of a command is the lifecycle's record, not an order
            if not self.gate.admit(ev):
                continue
            if isinstance(ev.payload, ReconfigureCommand):
                refusal = order_refusal(ev.payload, self.run, ev.time_s, self.clock())
                if refusal is not None:
                    self.gate.refuse(ev, refusal)
                else:
                    self._queue.append(ev.payload)
            elif ev.payload.probe_id not in self._probes_seen:
                self._probes_seen.add(ev.payload.probe_id)
                refusal = probe_refusal(ev.payload, self.running.devices)
                if refusal is None:
                    self._probes.append(ev.payload)
                else:
                    self.gate.refuse(ev, refusal)
        rejected = self.gate.take()
        if rejected:
            self.bus.publish(rejected)
        self.stream.commit()
        ignored: list[CommandAck] = []
        while self._queue and self.pending is None:
            command = self._queue.popleft()
            status, detail = self.fence.judge(command)
            if status is None:
                self.pending = command
            else:
                ignored.append(self._ack(command, status, detail))
        self._publish(ignored)
        return self.pending

    def take_probes(self) -> list[ProbeRequest]:
        """This job's probe requests read by ``poll()`` since the last call, each once, oldest first.
        Every rank must run each one (see ``probe_answer``), so share them as you share plans."""
        out, self._probes = self._probes, []
        return out

    def ack_applied(self, command: ReconfigureCommand, pause_s: float, pause_iterations: int = 0,
                    detail: str = "") -> None:
        """The loop now runs ``command.plan``: acknowledge with the pause it cost and, if the plan
        was announced at start, announce the new one (``plan.current``, reason ``reshape``)."""
        self._finish(command)
        self.running = command.plan
        self.fence.running_epoch = command.plan.epoch
        events: list[Payload] = [self._ack(command, AckStatus.APPLIED, detail or f"now {self.running.shape()}", pause_s,
                            pause_iterations)]
        if self._announced is not None:
            self._announced = self._announced.model_copy(update={"plan": self.running, "reason": "reshape"})
            events.append(self._announced)
        self._publish(events)

    def adopt(self, plan: Plan, reason: PlanCurrentReason = "reshape") -> None:
        """The loop moved to ``plan`` on its own, not on a command (the survivors of a lost rank
        re-formed without it; a restart past a lost device): fence the next command on it and, if
        the plan was announced at start, announce this one (``plan.current``) so the engine plans
        from it."""
        self.running = plan
        self.fence.running_epoch = plan.epoch
        if self._announced is not None:
            self._announced = self._announced.model_copy(update={"plan": plan, "reason": reason})
            self._publish([self._announced])

    def ack_failed(self, command: ReconfigureCommand, detail: str) -> None:
        """The loop could not apply ``command`` and still runs the previous plan; say why."""
        self._finish(command)
        self._publish([self._ack(command, AckStatus.FAILED, detail or "failed (no reason given)")])

    def _finish(self, command: ReconfigureCommand) -> None:
        if self.pending is None or command.command_id != self.pending.command_id:
            waiting = self.pending.command_id if self.pending else "none"
            raise ValueError(f"command {command.command_id} is not the one awaiting an acknowledgement "
                             f"({waiting}); acknowledge what poll() returned")
        self.pending = None

    def _ack(self, command: ReconfigureCommand, status: AckStatus, detail: str, pause_s: float = 0.0,
             pause_iterations: int = 0) -> CommandAck:
        ack = acknowledgement(command, status, detail[:2000], running_epoch=self.running.epoch, run=self.run,
                              pause_s=pause_s, pause_iterations=pause_iterations)
        self.acks.append(ack)
        return ack

    def _publish(self, payloads: list) -> None:
        if payloads:
            self.bus.publish([self.factory.make(p) for p in payloads])

    def close(self) -> None:
        """Stop reading; a command still pending is left unacknowledged (ack it first)."""
        self.stream.close()
        if self._owned:
            self.bus.close()

    def __enter__(self) -> CommandListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def signed_history(bus: Bus, job: str, kinds: tuple[type[Payload], ...], keyring: Keyring,
                   quiet_polls: int = 20) -> Iterator[Envelope]:
    """``job``'s events of ``kinds`` on the control topic, from its start to where it ends now, that
    verify (an unsigned or forged one could otherwise move a restarted reader's fence). A log that
    stops answering for ``quiet_polls`` polls ends the read where it got to."""
    end = bus.end_offsets([topics.CONTROL])
    stream = EventStream(bus, f"history:{job}:{uuid.uuid4().hex}", [topics.CONTROL],
                         on_assign=lambda tps: {tp: 0 for tp in tps}, job=job)
    try:
        quiet = 0
        while quiet < quiet_polls and any(stream.positions_after_poll().get(tp, 0) < n for tp, n in end.items()):
            deliveries = stream.poll(timeout_s=0.5)
            quiet = 0 if deliveries else quiet + 1
            for d in deliveries:
                if d.event.job == job and isinstance(d.event.payload, kinds) and keyring.verify(d.event) is None:
                    yield d.event
    finally:
        stream.close()


# ---- probes -----------------------------------------------------------------------------------------

MAX_PROBE_REPEATS = 16  # each repeat pauses the whole job; the detector asks for 3
MAX_PROBE_S = 5.0  # a compute probe stops repeating once it has run this long (it keeps the best so far)


def probe_refusal(request: ProbeRequest, devices: Iterable[int]) -> str | None:
    """Why a job should not run ``request`` (None: run it). A probe pauses every rank, so its work
    is bounded: at most :data:`MAX_PROBE_REPEATS` repeats, only devices the job runs, each named
    once; the time of each compute probe is capped by :data:`MAX_PROBE_S` where it runs."""
    if request.repeats > MAX_PROBE_REPEATS:
        return (f"probe {request.probe_id} asks for {request.repeats:,} repeats; a job runs at most "
                f"{MAX_PROBE_REPEATS} (each pauses every rank): ask again with fewer")
    running = set(devices)
    unknown = sorted(set(request.ranks) - running)
    if unknown:
        shown = unknown[:8]
        return (f"probe {request.probe_id} names devices {shown}{' …' if len(unknown) > 8 else ''} the job does not "
                f"run (it runs {len(running)}); probe devices of the running plan")
    if len(set(request.ranks)) != len(request.ranks):
        return f"probe {request.probe_id} names a device twice; name each once"
    return None



def best_seconds(workload: Callable[[], object], repeats: int, *, sync: Callable[[], object] | None = None,
                 budget_s: float = MAX_PROBE_S) -> float:
    """The best wall time of ``repeats`` runs of ``workload``. ``sync()`` runs before each clock
    stop: pass ``torch.cuda.synchronize`` on a GPU, where kernels only queue. The best, not the
    mean: noise (preemption, a shared host) only ever adds time, and a slow device is slow in every
    repeat. Repeating stops once ``budget_s`` has passed (after the first run), so a probe cannot
    hold the job for long however many repeats it asks."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    samples: list[float] = []
    began = time.perf_counter()
    for _ in range(repeats):
        if samples and time.perf_counter() - began >= budget_s:
            break
        if sync is not None:
            sync()
        start = time.perf_counter()
        workload()
        if sync is not None:
            sync()
        samples.append(time.perf_counter() - start)
    return min(samples)


def probe_answer(request: ProbeRequest, rank: int, seconds: float, everyone: Sequence[float]) -> ProbeResult | None:
    """This rank's answer to ``request``, or None when it was not asked.

    ``everyone`` is every rank's ``seconds`` for the same probe, gathered (all-gather) after all
    ranks ran it at the same boundary. The reference a healthy device takes is their median:
    measured under the same conditions, and a minority of slow devices cannot move it. A world with
    nothing to time (one device, a link probe) answers against a reference of 1 s."""
    if not everyone:
        raise ValueError("probe_answer needs every rank's time (gathered), got none")
    if rank not in request.ranks:
        return None
    reference = statistics.median(float(t) for t in everyone)
    return ProbeResult(probe_id=request.probe_id, rank=rank, duration_s=seconds,
                       reference_s=reference if reference > 0 else 1.0)


def new_command(plan: Plan, plan_id: str = "manual", *, run: str | None = None, issued_s: float | None = None,
                ttl_s: float = COMMAND_TTL_S) -> ReconfigureCommand:
    """A reconfiguration command for ``plan`` (tests, examples, a hand-made reshape) for the run
    ``run`` (a listener's ``run``), valid ``ttl_s`` from ``issued_s`` (default now). A listener
    obeys only a command that names its run and has not expired."""
    issued_s = time.time() if issued_s is None else issued_s
    return ReconfigureCommand(command_id=uuid.uuid4().hex, plan_id=plan_id, plan=plan, run=run,
                              expires_at_s=issued_s + ttl_s)


__all__ = ["ResiHPReporter", "IterationReport", "CommandListener", "EpochFence", "coords_in", "new_command",
           "seq_lens_from_cu_seqlens", "best_seconds", "probe_answer", "probe_refusal"]
