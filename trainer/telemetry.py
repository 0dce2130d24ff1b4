"""Per-rank telemetry, off the critical path.

``IterationRecorder`` times chunks and communication waits on the rank's own clock, as offsets
from its iteration start. ``TelemetryPublisher`` owns a queue and a daemon thread that opens the
bus and publishes; the training loop only ever does ``queue.put_nowait``. A slow or broken bus
therefore never slows training: when the queue is full, the oldest telemetry is dropped and
counted (reported with the next message that gets through, in the log). Heartbeats come from the
same thread on a timer, independent of iteration progress, so a rank stuck in a collective still
heartbeats while a dead process does not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from collector.auth import KeyFileError, Signer
from collector.bus import Bus
from collector.events import Chunk, ChunkKind, CommOp, CommWait, EventFactory, Heartbeat, Payload

log = logging.getLogger("resihp.trainer")


class IterationRecorder:
    """Chunk and comm timings of one iteration on this rank (local clock only)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.chunks: list[Chunk] = []
        self.comm: list[CommWait] = []

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    def chunk(self, kind: ChunkKind, microbatch: int, tokens: int, seq_lens: list[int], start_s: float,
              duration_s: float, virtual_stage: int = 0) -> None:
        self.chunks.append(Chunk(kind=kind, microbatch=microbatch, virtual_stage=virtual_stage, tokens=tokens,
                                 seq_lens=list(seq_lens), start_s=max(0.0, start_s), duration_s=max(0.0, duration_s)))

    @contextmanager
    def comm_wait(self, op: CommOp, peer: int | None = None, microbatch: int | None = None,
                  nbytes: int | None = None) -> Iterator[None]:
        start = self.now_s()
        try:
            yield
        finally:
            self.comm.append(CommWait(op=op, peer=peer, microbatch=microbatch, bytes=nbytes,
                                      start_s=max(0.0, start), duration_s=max(0.0, self.now_s() - start)))

    def waited_s(self, op: CommOp, since_s: float) -> float:
        """Seconds of ``op`` waits that began at or after ``since_s``: called at a chunk's end with
        its start, the chunk's own waits (waits are appended as they end, in order)."""
        total = 0.0
        for w in reversed(self.comm):
            if w.start_s < since_s:
                break
            if w.op == op:
                total += w.duration_s
        return total

    def tp_timer(self, _what: str = "tp"):
        return self.comm_wait(CommOp.TP_ALLREDUCE)

    def dp_timer(self):
        return self.comm_wait(CommOp.DP_ALLREDUCE)


class TelemetryPublisher:
    """Queue + background thread publishing this rank's events; heartbeats on a timer."""

    def __init__(self, open_bus: Callable[[], Bus], job: str, device: int, heartbeat_s: float | None = 1.0,
                 max_queued: int = 10_000, source: str | None = None, role: str = "rank") -> None:
        """``heartbeat_s`` None: no heartbeats of its own (the node agent sends one per live rank);
        ``source``: the envelope's source (default ``rank-<device>``); ``role``: the key its signed
        kinds carry (a rank's probe results; the node agent, ``executor``, its hang findings)."""
        self.factory = EventFactory(job, source or f"rank-{device}")
        self.role = role
        self.device = device
        self.heartbeat_s = heartbeat_s
        self.epoch = 0
        self.iteration = 0
        self.dropped = 0
        self._queue: queue.Queue[Payload | None] = queue.Queue(max_queued)
        self._open_bus = open_bus
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{device}", daemon=True)
        self._thread.start()

    def publish(self, payload: Payload) -> None:
        """Never blocks: drops the oldest queued message when the queue is full."""
        while True:
            try:
                self._queue.put_nowait(payload)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def _run(self) -> None:
        try:
            bus = self._open_bus()
        except Exception as exc:  # noqa: BLE001 - telemetry must never take training down
            log.error("rank %d: cannot open the bus (%s); telemetry is off for this rank", self.device, exc)
            while self._queue.get() is not None:
                pass
            return
        try:  # signed kinds (collector/auth.py) carry the role's key; telemetry passes as made
            make = Signer(self.factory, self.role).make
        except KeyFileError as exc:
            log.error("%s: %s; its signed events go out unsigned and will be refused", self.factory.source, exc)
            make = self.factory.make
        next_beat = 0.0
        stop = False
        try:
            while not stop:
                batch: list[Payload] = []
                timeout = None if self.heartbeat_s is None else max(0.0, next_beat - time.monotonic())
                try:
                    item = self._queue.get(timeout=timeout)
                    if item is None:
                        stop = True
                    else:
                        batch.append(item)
                    while len(batch) < 500:
                        item = self._queue.get_nowait()
                        if item is None:
                            stop = True
                            break
                        batch.append(item)
                except queue.Empty:
                    pass
                if self.heartbeat_s is not None and time.monotonic() >= next_beat:
                    batch.append(Heartbeat(rank=self.device, epoch=self.epoch, iteration=self.iteration,
                                           interval_s=self.heartbeat_s))
                    next_beat = time.monotonic() + self.heartbeat_s
                if batch:
                    try:
                        bus.publish([make(p) for p in batch])
                    except Exception as exc:  # noqa: BLE001
                        self.dropped += len(batch)
                        log.warning("rank %d: telemetry publish failed (%s); %d dropped so far",
                                    self.device, exc, self.dropped)
        finally:
            bus.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout_s``) and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)
