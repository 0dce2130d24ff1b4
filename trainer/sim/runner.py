"""Driving the engine: open loop into a sink (a trace, a list), or closed loop over a bus.

``run_open_loop`` steps a scenario to its end and hands every batch of events to a sink.
``SimulatorRunner`` is the simulator as the platform sees a trainer: it publishes telemetry and
truth to the bus, and between iterations consumes ``command.reconfigure`` (applied after the
reshape pause, fenced by epoch, acknowledged with ``command.ack``) and ``probe.request`` (answered
with one ``probe.result`` per live rank) from the control topic. It joins the control topic at its
end: commands published before it started are not its business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from collector import topics
from collector.auth import Gate
from collector.bus import Bus, TopicPartition
from collector.events import Envelope, ProbeRequest, ReconfigureCommand
from collector.stream import EventStream
from trainer.sim.engine import SimEngine

Sink = Callable[[list[Envelope]], None]


def _done(engine: SimEngine, start_iteration: int, iterations: int | None, duration_s: float | None,
          max_hang_s: float | None = None) -> bool:
    if engine.finished:
        return True
    if max_hang_s is not None and engine.hanging_for_s > max_hang_s:
        return True
    if iterations is not None and engine.iteration - start_iteration >= iterations:
        return True
    return duration_s is not None and engine.now_s >= duration_s


def run_open_loop(engine: SimEngine, sink: Sink, *, iterations: int | None = None, duration_s: float | None = None,
                  flush_events: int = 20_000, progress: Callable[[int], None] | None = None,
                  max_hang_s: float = 3600.0) -> int:
    """Step until ``iterations`` iterations completed or ``duration_s`` simulated seconds passed
    (whichever comes first), or the job has hung on a dead rank for ``max_hang_s`` (open loop,
    nobody will reshape it); returns the number of events emitted."""
    if iterations is None and duration_s is None:
        raise ValueError("give iterations or duration_s, or the simulation never ends")
    start = engine.iteration
    buf: list[Envelope] = []
    total = 0
    while not _done(engine, start, iterations, duration_s, max_hang_s):
        before = engine.iteration
        buf += engine.step()
        if progress is not None and engine.iteration != before:
            progress(engine.iteration - before)
        if len(buf) >= flush_events:
            sink(buf)
            total += len(buf)
            buf = []
    if buf:
        sink(buf)
        total += len(buf)
    return total


class SimulatorRunner:
    """The simulator in closed loop with the platform over ``bus``."""

    def __init__(self, bus: Bus, engine: SimEngine, *, speed: float | None = None, group: str | None = None,
                 record: Sink | None = None) -> None:
        self.bus = bus
        self.engine = engine
        self.speed = speed  # simulated seconds per wall second; None: as fast as possible
        self.record = record
        self.acks: list[Envelope] = []
        # Where the control log ends now: commands published from here on are for this run. Taken
        # before joining, since on Kafka partitions are assigned only at the first poll.
        self._control_end = bus.end_offsets(list(topics.TRAINER_TOPICS))
        self.stream = EventStream(bus, group or f"simulator:{engine.config.job}", list(topics.TRAINER_TOPICS),
                                  on_assign=self._start_at_end, job=engine.config.job)
        self.gate = Gate("simulator", engine.keyring)
        self._wall0 = time.monotonic()
        self._sim0 = engine.now_s

    def _start_at_end(self, partitions: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self._control_end.get(tp, 0) for tp in partitions}

    def publish(self, events: list[Envelope]) -> None:
        if events:
            self.bus.publish(events)
            if self.record is not None:
                self.record(events)

    def handle_control(self, timeout_s: float = 0.0) -> int:
        """Consume pending commands and probe requests; returns how many were handled."""
        handled = 0
        for d in self.stream.poll(timeout_s=timeout_s):
            if d.event.job != self.engine.config.job:
                continue  # another job's command on a shared bus
            if not isinstance(d.event.payload, (ReconfigureCommand, ProbeRequest)):
                continue
            if d.topic != topics.obeyed_from(d.event.kind):
                continue  # the control topic's copy of a command is the lifecycle's record, not an order
            out = self.engine.handle(d.event, self.gate)  # only signed control acts; refusals are reported
            self.acks += [e for e in out if e.kind == "command.ack"]
            self.publish(out)
            handled += 1
        self.stream.commit()
        return handled

    def step(self) -> list[Envelope]:
        """Handle control, run one iteration, publish, and pace to ``speed``."""
        self.handle_control()
        events = self.engine.step()
        self.publish(events)
        if self.speed:
            due = self._wall0 + (self.engine.now_s - self._sim0) / self.speed
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 5.0))
        return events

    def run(self, *, iterations: int | None = None, duration_s: float | None = None,
            stop: Callable[[], bool] = lambda: False) -> None:
        start = self.engine.iteration
        while not stop() and not _done(self.engine, start, iterations, duration_s):
            self.step()
        self.handle_control()

    def close(self) -> None:
        self.stream.close()
