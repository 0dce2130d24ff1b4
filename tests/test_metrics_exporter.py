"""The exporters' output (analytics/service/metrics.py): bounded series at 100k ranks, the rank histogram's
counts, per-rank series only for slow ranks, per-stage and per-incident series capped per job, and
the engine's approval wait on the right clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from analytics.service.metrics import AnalyticsCollector, AnalyticsSnapshot, ApprovalCollector
from analytics.detection.prediction import MAX_STAGE_ROWS
from bench.metrics import _synthetic_projection
from collector.plan_lifecycle import PlanStatus
from remediation.approval_metrics import waiting_ages
from remediation.engine import RemediationEngine


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_large_job_renders_a_bounded_number_of_series() -> None:
    """25,000 ranks here (bench metrics scrapes 100,000): no series count depends on the ranks."""
    proj = _synthetic_projection(25_000, iterations=50)
    snap = AnalyticsSnapshot(jobs=proj.snapshot(), lag={("analytics", "resihp.telemetry"): 7}, dead_letters={"analytics": 2})
    text = generate_latest(AnalyticsCollector(lambda: snap))
    samples = _samples(text)
    stages = [k for k in samples if k[0].startswith("resihp_stage_")]
    incidents_each = [k for k in samples if k[0] == "resihp_open_incident_slowdown_factor"]
    assert len(stages) == 2 * MAX_STAGE_ROWS and len(incidents_each) == 9  # both capped per job, not by ranks
    assert len(samples) - len(stages) - len(incidents_each) < 200 and len(text) < 60_000
    job = (("job", "big-job"),)
    assert samples[("resihp_rank_slowdown_factor_bucket", job + (("le", "+Inf"),))] == 25_000 - 8  # dead apart
    assert samples[("resihp_ranks", job + (("state", "dead"),))] == 8
    slow = [k for k in samples if k[0] == "resihp_slow_rank_factor"]
    assert len(slow) == 64  # one series per slow rank, none for the 24,936 others
    incidents = (("category", "fail_stop"), ("job", "big-job"), ("severity", "high"))
    assert samples[("resihp_open_incidents", incidents)] == 1
    assert samples[("resihp_open_incidents", (("category", "fail_slow"),) + incidents[1:])] == 8
    assert samples[("resihp_consumer_lag_records", (("group", "analytics"), ("topic", "resihp.telemetry")))] == 7
    assert samples[("resihp_dead_letters_total", (("group", "analytics"),))] == 2
    assert samples[("resihp_goodput_ratio", job)] == 1.0  # no cause: every second trained


def test_the_approval_wait_is_on_the_wall_clock_live_and_on_the_jobs_clock_in_a_replay() -> None:
    plans = {"a": SimpleNamespace(status=PlanStatus.PROPOSED, proposed_at_s=1000.0),
             "b": SimpleNamespace(status=PlanStatus.APPROVED, proposed_at_s=900.0)}
    live = SimpleNamespace(state=SimpleNamespace(plans=plans), clock_s=1010.0)
    assert waiting_ages(cast(RemediationEngine, live), wall_s=1100.0) == [100.0]
    replay = SimpleNamespace(state=SimpleNamespace(plans=plans), clock_s=1010.0)
    assert waiting_ages(cast(RemediationEngine, replay), wall_s=1_800_000_000.0) == [10.0]
    text = generate_latest(ApprovalCollector(lambda: ("j", [100.0, 30.0])))
    samples = _samples(text)
    assert samples[("resihp_plans_awaiting_approval", (("job", "j"),))] == 2
    assert samples[("resihp_plan_approval_wait_seconds", (("job", "j"),))] == 100.0
