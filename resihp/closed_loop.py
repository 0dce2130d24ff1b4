"""The whole loop in one process: simulator → bus → analytics → remediation → bus → simulator.

Every part is the production one: ``SimulatorRunner`` publishes telemetry, heartbeats and truth and
applies fenced commands; the analytics ``Projector`` with the ``DetectorProjection`` (DuckDB file,
exactly-once outbox) detects, localises, probes and publishes cost fits; the ``RemediationEngine``
plans with a named strategy under an auto-apply policy and publishes commands. What differs from
``resihp demo`` is the clock: the parts take turns (one simulator iteration, then analytics every
``analytics_every`` iterations, then the engine) instead of running as processes on the wall
clock, so a 30-minute scenario runs as fast as the machine allows and the same seed gives the same
run. The referee (resihp/referee.py, in its closed-loop terms) reads the truth and analytics topics
to say how long each fault took to be detected and which incidents matched no fault.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from collector import incident_lifecycle, topics
from collector.embedded import EmbeddedBus
from collector.auth import Gate, Signer, operator_key
from collector.events import (
    AckStatus, CommandAck, Envelope, EventFactory, FaultInjected, IncidentConfirmed, IncidentOpened, IterationSummary,
    PolicyChanged, PolicyMode, Severity,
)
from collector.incident_lifecycle import IncidentLifecycle
from collector.stream import EventStream
from analytics.projections.projector import Projection, Projector
from resihp.referee import covers, fault_devices, location_devices

__all__ = ["Detection", "ThroughputSeries", "LoopRun", "location_devices", "run_closed_loop"]


@dataclass
class Detection:
    """One injected fault and when the platform first named where it is."""

    fault_id: str
    category: str
    onset_s: float  # simulated seconds from the job's start
    detected_s: float | None = None  # first incident event (opened, confirmed, updated) covering its devices

    @property
    def delay_s(self) -> float | None:
        return None if self.detected_s is None else self.detected_s - self.onset_s


@dataclass
class ThroughputSeries:
    """Tokens/s over time, one point per window of ``window_s`` simulated seconds: (end_s, rate)
    is the rate over the window that ends at end_s, so a plot draws it as a step over that window.

    ``close(now_s)`` ends the window early. A loop calls it around a jump of the clock (a
    restart's downtime, which the simulator runs in one call): the downtime then gets a point of
    its own at 0 tokens/s, instead of averaging into the window around it, which drew as a slope
    from full speed down to the restart's end."""

    window_s: float = 60.0
    points: list[tuple[float, float]] = field(default_factory=list)
    _start_s: float = 0.0
    _tokens: int = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def tick(self, now_s: float) -> None:
        """Close the window if it is ``window_s`` long by ``now_s``."""
        if now_s - self._start_s >= self.window_s:
            self.close(now_s)

    def close(self, now_s: float) -> None:
        if now_s > self._start_s:
            self.points.append((now_s, self._tokens / (now_s - self._start_s)))
            self._start_s, self._tokens = now_s, 0


@dataclass
class LoopRun:
    tokens: int = 0
    series: list[tuple[float, float]] = field(default_factory=list)  # (time_s, tokens/s) per window
    training_at_end: bool = False
    detections: list[Detection] = field(default_factory=list)
    false_incidents: int = 0  # incidents whose locations cover no injected fault's devices
    plans_applied: int = 0  # commands the simulator applied, roll-backs included
    rolled_back: int = 0  # applied plans whose verification failed (the engine proposed the layout before)
    refusals: list[str] = field(default_factory=list)
    telemetry_lost: int = 0  # telemetry records retention deleted before the analytics consumer read them
    bus_bytes: int = 0  # the embedded log's size on disk at the end of the run


class _Referee:
    """The referee's closed-loop terms (resihp/referee.py), read off the bus as events arrive: a
    fault is detected at the first incident event (opened, confirmed, updated) from its onset on
    that covers it, of any category; an incident that never covers a fault is a false one. A
    group-level incident names its whole TP group, so it covers a fault on any member; one naming
    only healthy devices is false; one naming no device covers nothing until a later event places it.
    Where an incident is comes from the incident fold (collector/incident_lifecycle.py)."""

    def __init__(self, bus: EmbeddedBus, job: str, gpus_per_node: int, t0_s: float) -> None:
        self.stream = EventStream(bus, f"referee:{job}", [topics.TRUTH, topics.ANALYTICS],
                                  on_assign=lambda ps: {tp: 0 for tp in ps}, job=job)
        self.per_node, self.t0 = gpus_per_node, t0_s
        self.faults: dict[str, tuple[Detection, set[int]]] = {}
        self.unmatched: set[str] = set()
        self.matched: set[str] = set()
        self.incidents = IncidentLifecycle(job=job)

    def poll(self) -> None:
        # Truth first: one poll may hand over an incident before the fault it is about.
        events = sorted((d.event for d in self.stream.poll(max_records=100_000, timeout_s=0.0)),
                        key=lambda e: not isinstance(e.payload, FaultInjected))
        for e in events:
            p, t = e.payload, e.time_s - self.t0
            if isinstance(p, FaultInjected) and p.fault_id not in self.faults:
                # the devices the fault hits, not its TP group's: an incident on a healthy peer is false
                hit_devices = fault_devices(p.location, self.per_node)
                self.faults[p.fault_id] = (Detection(p.fault_id, p.category.value, t), hit_devices)
            elif isinstance(p, incident_lifecycle.PAYLOADS):
                record = incident_lifecycle.step(self.incidents, e)
                if record is None or not record.is_open or (isinstance(p, IncidentConfirmed) and not p.locations):
                    continue  # no new word on where it is
                # a confirmation can be what first locates an incident (a probe naming a link)
                hit = False
                for det, devices in self.faults.values():
                    if t >= det.onset_s and covers(devices, record.locations, self.per_node, unplaced_covers=False):
                        hit = True
                        if det.detected_s is None:
                            det.detected_s = t
                if hit:
                    self.matched.add(record.incident_id)
                elif isinstance(p, IncidentOpened):
                    self.unmatched.add(record.incident_id)
        self.stream.commit()

    def close(self) -> None:
        self.stream.close()


class _Platform:
    """The platform's production parts around one simulated job, on one embedded bus: the analytics
    projector with the detector, the remediation engine, the referee and the optional observers.
    They take turns (:meth:`turn`) instead of running on the wall clock."""

    def __init__(self, tmp: Path, sim_engine, model, *, strategy: str, options, hardware, detector_config,
                 telemetry_retention_s: float, observers: Sequence[Projection], batch: int) -> None:
        from analytics.detection.config import DetectorConfig
        from analytics.projections.detector_projection import DetectorProjection
        from remediation.engine import EngineConfig, RemediationEngine
        from trainer.sim.runner import SimulatorRunner

        cfg = sim_engine.config
        self.batch = batch
        self.bus = EmbeddedBus(tmp / "bus.sqlite", retention_s={topics.TELEMETRY: telemetry_retention_s})
        self.runner = SimulatorRunner(self.bus, sim_engine)
        self.detector = DetectorProjection(config=detector_config or DetectorConfig(probes=True))
        self.projector = Projector(self.bus, tmp / "analytics.duckdb", "analytics", [topics.TELEMETRY, topics.CONTROL],
                                   [self.detector], gate=Gate("analytics"), on_rejected=self.detector.enqueue)
        self.engine = RemediationEngine(self.bus, EngineConfig(job=cfg.job, num_devices=cfg.cluster.gpus,
                                                               hardware=hardware, options=options, strategy=strategy),
                                        model, cfg.plan)
        self.referee = _Referee(self.bus, cfg.job, cfg.cluster.gpus_per_node, cfg.start_time_s)
        self.watch = Projector(self.bus, tmp / "observers.duckdb", "observers",
                               [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL], observers) if observers else None
        self.bus.publish([Signer(EventFactory(cfg.job, "cli:closed-loop"), operator_key("cli:closed-loop", create=True)).make(
            PolicyChanged(mode=PolicyMode.AUTO, auto_severities=list(Severity), actor="cli:closed-loop"),
            time_s=cfg.start_time_s)])  # on the job's clock: the engine's clock is the newest event time

    def analyse(self) -> None:
        """Analytics reads everything published so far, in transactions of at most ``batch`` records,
        and publishes what it derived."""
        while self.projector.step(max_records=self.batch, timeout_s=0.0) >= self.batch:
            pass  # a full transaction: more may be waiting
        self.detector.flush_outbox(self.projector.conn, self.bus)

    def observe(self) -> None:
        while self.watch is not None and self.watch.step(max_records=self.batch, timeout_s=0.0):
            pass

    def turn(self) -> None:
        """One turn of the platform: analytics, then the engine, the referee and the observers."""
        self.analyse()
        self.engine.poll_once(timeout_s=0.0)
        self.referee.poll()
        self.observe()

    def finish(self) -> None:
        """The referee's last word; the observers get the last turn's telemetry and what analytics
        derived from it."""
        self.referee.poll()
        if self.watch is not None:
            while self.projector.step(max_records=self.batch, timeout_s=0.0):
                pass
            self.detector.flush_outbox(self.projector.conn, self.bus)
            self.observe()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.referee.close()
        self.engine.close()
        self.projector.close()
        self.runner.close()
        self.bus.close()


def _simulate_iteration(platform: _Platform, sim_engine, run: LoopRun, series: ThroughputSeries, duration_s: float,
                        on_applied: Callable[[object], list[Envelope]] | None) -> None:
    """One simulator iteration: its tokens counted, and each command it applied followed by what
    ``on_applied`` publishes (a restart's downtime gets a throughput window of its own)."""
    runner = platform.runner
    acks = len(runner.acks)
    for e in runner.step():
        if isinstance(e.payload, IterationSummary) and sim_engine.now_s <= duration_s:
            run.tokens += e.payload.tokens
            series.add(e.payload.tokens)
    for ack in runner.acks[acks:]:
        if isinstance(ack.payload, CommandAck) and ack.payload.status == AckStatus.APPLIED:
            run.plans_applied += 1
            if on_applied is not None:
                series.close(sim_engine.now_s)
                runner.publish(on_applied(sim_engine))
                series.close(sim_engine.now_s)


def run_closed_loop(sim_engine, model, *, strategy: str, duration_s: float,
                    options, hardware, detector_config=None, analytics_every: int = 5, analytics_batch: int = 20_000,
                    window_s: float = 60.0,
                    directory: str | Path | None = None, telemetry_retention_s: float = 60.0,
                    on_applied: Callable[[object], list[Envelope]] | None = None,
                    on_progress: Callable[[float], None] | None = None,
                    observers: Sequence[Projection] = ()) -> LoopRun:
    """Run ``sim_engine``'s job for ``duration_s`` simulated seconds with the platform in the loop.

    ``model`` is the engine's fallback cost figures (it switches to the analytics cost fits once they
    arrive); ``options`` the planner's (pauses, horizon); ``on_applied(sim_engine)`` runs after each
    applied command and returns events to publish (a baseline that pays a restart idles the
    simulator there, and the heartbeats of the downtime go out); ``on_progress(now_s)`` gets the
    simulated seconds done after every iteration (a run at 8,192 GPUs takes hours). The job's
    throughput is sampled into ``series`` every ``window_s`` simulated seconds. Telemetry is kept on
    the bus for ``telemetry_retention_s`` wall seconds: the analytics consumer reads it every few
    iterations, and a 2-hour run at 256 GPUs would otherwise hold ~20 GB of it. At its turn the
    consumer reads everything published so far, in transactions of at most ``analytics_batch``
    records (one turn at 8,192 ranks is ~45,000 records: a single transaction per turn would fall
    further behind at every turn until retention deleted what it had not read)."""
    from remediation.lifecycle import PlanStatus

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        platform = _Platform(Path(tmp), sim_engine, model, strategy=strategy, options=options, hardware=hardware,
                             detector_config=detector_config, telemetry_retention_s=telemetry_retention_s,
                             observers=observers, batch=analytics_batch)
        run = LoopRun()
        series = ThroughputSeries(window_s)
        try:
            while sim_engine.now_s < duration_s and not sim_engine.finished:
                before = sim_engine.now_s
                _simulate_iteration(platform, sim_engine, run, series, duration_s, on_applied)
                if sim_engine.iteration % analytics_every == 0 or sim_engine.hanging_for_s > 0:
                    platform.turn()
                series.tick(sim_engine.now_s)
                if on_progress is not None:
                    on_progress(min(sim_engine.now_s, duration_s))
                run.training_at_end = sim_engine.now_s > before and sim_engine.hanging_for_s == 0.0
            platform.finish()
            run.series = series.points
            run.rolled_back = sum(r.status == PlanStatus.ROLLED_BACK for r in platform.engine.state.plans.values())
            run.telemetry_lost = sum(getattr(platform.projector.stream.consumer, "lost_to_retention", {}).values())
            run.bus_bytes = sum(p.stat().st_size for p in Path(tmp).glob("bus.sqlite*"))
        finally:
            platform.close()
        run.detections = [det for det, _ in platform.referee.faults.values()]
        run.false_incidents = len(platform.referee.unmatched - platform.referee.matched)
        run.refusals = list(platform.engine.refusals)
    return run
