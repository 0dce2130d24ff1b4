"""Per-stage observed against predicted compute time: the detector's ``analytics.prediction`` carries
one row per (replica, stage) — the sum of the stage's chunk times in this iteration against the cost
model's — and /metrics serves the newest as ``resihp_stage_observed_seconds`` /
``resihp_stage_predicted_seconds`` with bounded labels (job, stage, replica)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from analytics.detection.detector import Detector
from analytics.detection.config import DetectorConfig
from analytics.projections.goodput_projection import GoodputProjection
from analytics.service.metrics import AnalyticsCollector, AnalyticsSnapshot
from analytics.detection.prediction import MAX_STAGE_ROWS
from collector.events import Envelope, EventFactory, IterationPrediction, RankIteration
from collector.plan import Plan
from trainer.fault_spec import FaultSpec
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import run_open_loop

JOB = "stages"


def _live_job(plan: Plan, faults: list[FaultSpec], iterations: int) -> tuple[list[Envelope], list[Envelope]]:
    """(telemetry.iteration events, analytics events) of a simulated job judged by the real detector."""
    sim = SimEngine(SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=len(plan.devices)), plan=plan,
                              job=JOB, seed=5, heartbeat_interval_s=1.0), faults)
    detector = Detector(JOB, DetectorConfig(probes=False))
    out = EventFactory(JOB, "analytics")
    telemetry: list[Envelope] = []
    log: list[Envelope] = []

    def sink(events: list[Envelope]) -> None:
        for e in events:
            log.append(e)
            if isinstance(e.payload, RankIteration):
                telemetry.append(e)
            log.extend(out.make(p, time_s=e.time_s) for p in detector.on_event(e))

    run_open_loop(sim, sink, iterations=iterations)
    return telemetry, log


def _scraped(log: list[Envelope]) -> dict[tuple[str, str, str], float]:
    """{(series, stage, replica): value} of the stage series /metrics serves after folding ``log``."""
    projection = GoodputProjection()
    projection.fold.apply_all(log)
    snapshot = AnalyticsSnapshot(jobs=projection.snapshot())
    text = generate_latest(AnalyticsCollector(lambda: snapshot).for_job(JOB)).decode()
    return {(s.name, s.labels["stage"], s.labels["replica"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("resihp_stage_")}


def test_stage_times_are_the_telemetrys_and_the_slow_stage_stands_out() -> None:
    """TP 1 (a chunk's own time is its duration): each stage's observed time is the sum of its rank's
    chunk durations in the newest iteration, straight from the event log; the stage of the GPU slowed
    ×2 reads about twice its prediction, the others about their prediction; /metrics serves exactly
    the newest prediction's rows."""
    plan = Plan.uniform(tp=1, pp=2, dp=2, num_layers=MODEL_PRESETS["tiny"].layers, microbatches_per_replica=4)
    slow = plan.roles[3]
    telemetry, log = _live_job(plan, [FaultSpec(kind="slow_compute", device=3, factor=2.0, at_iteration=60)], 100)
    newest = [e.payload for e in log if isinstance(e.payload, IterationPrediction)][-1]
    assert len(newest.stages) == 4
    for row in newest.stages:
        rank = next(r for r, role in plan.roles.items() if (role.replica, role.stage) == (row.replica, row.stage))
        report = next(e.payload for e in telemetry if isinstance(e.payload, RankIteration)
                      and e.payload.iteration == newest.iteration and e.payload.rank == rank)
        assert row.observed_s == pytest.approx(sum(report.chunk_table.duration_s), rel=1e-9)
        ratio = row.observed_s / row.predicted_s
        if (row.replica, row.stage) == (slow.replica, slow.stage):
            assert 1.6 < ratio < 2.4
        else:
            assert 0.85 < ratio < 1.15
    scraped = _scraped(log)
    assert len(scraped) == 8
    for row in newest.stages:
        key = (str(row.stage), str(row.replica))
        assert scraped[("resihp_stage_observed_seconds", *key)] == row.observed_s
        assert scraped[("resihp_stage_predicted_seconds", *key)] == row.predicted_s


def test_a_layout_with_many_replicas_gives_one_row_per_stage_its_worst_replica() -> None:
    """Past MAX_STAGE_ROWS (replica, stage) pairs the series stay bounded: per stage the replica
    furthest above its prediction, here the one with the slowed GPU."""
    dp = MAX_STAGE_ROWS // 2 + 1
    plan = Plan.uniform(tp=1, pp=2, dp=dp, num_layers=MODEL_PRESETS["tiny"].layers, microbatches_per_replica=2)
    slow = plan.roles[7]
    _, log = _live_job(plan, [FaultSpec(kind="slow_compute", device=7, factor=3.0, at_iteration=30)], 40)
    newest = [e.payload for e in log if isinstance(e.payload, IterationPrediction)][-1]
    assert sorted(row.stage for row in newest.stages) == [0, 1]
    worst = next(row for row in newest.stages if row.stage == slow.stage)
    assert worst.replica == slow.replica and worst.observed_s / worst.predicted_s > 2.0
    assert len(_scraped(log)) == 4
