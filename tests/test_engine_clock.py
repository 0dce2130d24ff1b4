"""The engine's clock follows signed events only, and never runs more than a stated skew past the
wall clock: whoever can write unsigned telemetry cannot end the engine's waits early."""

from __future__ import annotations

import time
from pathlib import Path

from collector.embedded import EmbeddedBus
from collector.events import (
    Envelope, EventFactory, Evidence, FaultCategory, IncidentOpened, IncidentUpdated, IterationPrediction, Location, Severity,
)
from collector.plan import Plan
from remediation.engine import EngineConfig, RemediationEngine
from remediation.model import PlannerModel
from tests.fixtures.signing import Authors

JOB = "clock"
YEAR_S = 365 * 86400.0


def _engine(bus: EmbeddedBus, **config) -> RemediationEngine:
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    return RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16, **config), PlannerModel.uniform(8), plan)


def _group_incident(analytics: Authors, t: float) -> Envelope:
    group = Location(target="compute", tp_group=(4, 5), replica=1, stage=0, factor=3.0)
    return analytics.make(IncidentOpened(
        incident_id="i1", category=FaultCategory.FAIL_SLOW, severity=Severity.CRITICAL, iteration=5,
        locations=[group], evidence=Evidence(), summary="TP group [4, 5] ×3"), time_s=t)


def test_an_unsigned_event_stamped_a_year_ahead_does_not_end_the_engines_wait(tmp_path: Path) -> None:
    """A group-level fail-slow waits 30 s of the engine's clock to be narrowed to a rank. A
    prediction without analytics' signature (any telemetry writer can publish one) stamped a year
    ahead is refused and leaves the clock where the signed incident put it, so the engine still
    waits instead of planning around the whole group."""
    t0 = time.time()
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        analytics = Authors(JOB, "analytics")
        bus.publish([_group_incident(analytics, t0)])
        engine.poll_once()
        assert engine.clock_s == t0 and "i1" in engine.waiting
        forger = EventFactory(JOB, "analytics")  # the same source name, without analytics' key
        bus.publish([forger.make(IterationPrediction(epoch=0, iteration=6, observed_s=1.0, predicted_s=1.0, tokens=1),
                                 time_s=t0 + YEAR_S)])
        engine.poll_once()
        assert engine.clock_s == t0
        assert not engine.state.plans and "i1" in engine.waiting
        engine.close()


def test_a_signed_event_stamped_ahead_moves_the_clock_at_most_the_skew_past_the_wall_clock(tmp_path: Path) -> None:
    t0 = time.time()
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus, clock_skew_s=120.0)
        analytics = Authors(JOB, "analytics")
        bus.publish([_group_incident(analytics, t0)])
        engine.poll_once()
        before = time.time()
        bus.publish([analytics.make(IncidentUpdated(incident_id="i1", iteration=6, severity=Severity.CRITICAL,
                                                    locations=[], evidence=Evidence()), time_s=t0 + YEAR_S)])
        engine.poll_once()
        after = time.time()
        assert before + 120.0 <= engine.clock_s <= after + 120.0
        engine.close()
