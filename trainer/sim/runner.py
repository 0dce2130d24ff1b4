"""Driving the engine: open loop into a sink (a trace, a list), or closed loop over a bus.

``run_open_loop`` steps a scenario to its end and hands every batch of events to a sink; with a
``speed`` it hands over each iteration when the simulated clock reaches it (``Pacer``), so a
consumer sees a live job's steady rate rather than a backlog.
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


def run_finished(engine: SimEngine, start_iteration: int, iterations: int | None, duration_s: float | None,
                 max_hang_s: float | None = None) -> bool:
    """Whether a run that started at ``start_iteration`` has reached its end."""
    if engine.finished:
        return True
    if max_hang_s is not None and engine.hanging_for_s > max_hang_s:
        return True
    if iterations is not None and engine.iteration - start_iteration >= iterations:
        return True
    return duration_s is not None and engine.now_s >= duration_s


class Pacer:
    """Holds a run to ``speed`` simulated seconds per wall second: ``wait`` after each step sleeps
    until the wall clock reaches the simulated clock's time. ``behind_s`` is how late the run
    has been at worst: a producer that cannot build and publish an iteration within its simulated
    duration falls behind, and a steady rate is then not what a consumer saw."""

    def __init__(self, engine: SimEngine, speed: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive (simulated seconds per wall second), not {speed}")
        self.engine, self.speed, self.clock, self.sleep = engine, speed, clock, sleep
        self.wall0, self.sim0 = clock(), engine.now_s
        self.behind_s = 0.0

    def due(self) -> float:
        """The wall time at which the simulated clock's present is due."""
        return self.wall0 + (self.engine.now_s - self.sim0) / self.speed

    def wait(self, most_s: float | None = None) -> None:
        """Sleep until due (at most ``most_s``: a closed loop handles control meanwhile), or note
        how late this step is."""
        wait = self.due() - self.clock()
        if wait > 0:
            self.sleep(wait if most_s is None else min(wait, most_s))
        else:
            self.behind_s = max(self.behind_s, -wait)


def run_open_loop(engine: SimEngine, sink: Sink, *, iterations: int | None = None, duration_s: float | None = None,
                  flush_events: int = 20_000, progress: Callable[[int], None] | None = None,
                  max_hang_s: float = 3600.0, pacer: Pacer | None = None) -> int:
    """Step until ``iterations`` iterations completed or ``duration_s`` simulated seconds passed
    (whichever comes first), or the job has hung on a dead rank for ``max_hang_s`` (open loop,
    nobody will reshape it); returns the number of events emitted. With a ``pacer`` each step's
    events go to the sink at once, and the next step waits for its time."""
    if iterations is None and duration_s is None:
        raise ValueError("give iterations or duration_s, or the simulation never ends")
    start = engine.iteration
    buf: list[Envelope] = []
    total = 0
    while not run_finished(engine, start, iterations, duration_s, max_hang_s):
        before = engine.iteration
        buf += engine.step()
        if progress is not None and engine.iteration != before:
            progress(engine.iteration - before)
        if len(buf) >= flush_events or (pacer is not None and buf):
            sink(buf)
            total += len(buf)
            buf = []
        if pacer is not None:
            pacer.wait()
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
        self.pacer = Pacer(engine, speed) if speed else None  # None: as fast as possible
        self.record = record
        self.acks: list[Envelope] = []
        # Where the control log ends now: commands published from here on are for this run. Taken
        # before joining, since on Kafka partitions are assigned only at the first poll.
        self._control_end = bus.end_offsets(list(topics.TRAINER_TOPICS))
        self.stream = EventStream(bus, group or f"simulator:{engine.config.job}", list(topics.TRAINER_TOPICS),
                                  on_assign=self._start_at_end, job=engine.config.job)
        self.gate = Gate("simulator", engine.keyring)

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
        if self.pacer is not None:
            self.pacer.wait(most_s=5.0)  # control is handled at least every 5 s
        return events

    def run(self, *, iterations: int | None = None, duration_s: float | None = None,
            stop: Callable[[], bool] = lambda: False) -> None:
        start = self.engine.iteration
        while not stop() and not run_finished(self.engine, start, iterations, duration_s):
            self.step()
        self.handle_control()

    def close(self) -> None:
        self.stream.close()
