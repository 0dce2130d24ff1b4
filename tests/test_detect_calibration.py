"""An incident's two confidences: p_real (how sure the fault is real, read from the table fitted on
the detection suite) and place_confidence (how sure of the place); old records still decode, the
auto-apply policy reads p_real, and the benchmark's reliability table says what it measures."""

from __future__ import annotations

import json
import math

import pytest

from analytics.detection import calibration
from analytics.detection.calibration import BASES, COMPUTE_CUSUM, HEARTBEAT, LINK_CUSUM, band, fit, p_real, read_table
from bench.detect import reliability, worst_judged_gap
from collector.events import (
    Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, Location, PlanProposed, PolicyChanged, PolicyMode,
    Severity,
)
from collector.codec import decode, encode_json
from collector.incident_lifecycle import UNCALIBRATED, IncidentLifecycle, IncidentRecord, step
from collector.plan import Plan
from remediation.lifecycle import auto_applies, fold, initial_state
from tests.fixtures.signing import Authors

JOB = "job"
F = Authors(JOB, "test")
PLAN0 = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
PLAN1 = Plan.uniform(tp=2, pp=2, dp=1, num_layers=8, microbatches_per_replica=8, epoch=1)


def _rows(real: int, false: int, basis: str = COMPUTE_CUSUM, margin: float = 2.0) -> list[tuple[str, float, bool]]:
    return [(basis, margin, True)] * real + [(basis, margin, False)] * false


# ---- the calibration table ------------------------------------------------------------------------


def test_p_real_never_falls_as_the_evidence_grows_even_where_the_suite_says_otherwise():
    # weak openings all real, middling ones half false: the fitted shares violate order, PAV pools them
    table = fit(_rows(6, 0, margin=0.5) + _rows(3, 3, margin=2.0) + _rows(10, 0, margin=5.0))
    ps = [p_real(COMPUTE_CUSUM, m, table) for m in (0.0, 0.5, 1.0, 2.0, 2.9, 3.0, 10.0, math.inf)]
    assert ps == sorted(ps)
    assert ps[0] < 1.0 and ps[-1] < 1.0  # shrunk: a finite suite never claims certainty


def test_a_band_is_shrunk_toward_the_pooled_share_by_one_pseudo_incident():
    table = fit(_rows(18, 2) + _rows(2, 0, basis=LINK_CUSUM))
    pooled = (20 + 1) / (22 + 2)
    assert table["pooled"]["p_real"] == pytest.approx(pooled, abs=1e-4)
    assert p_real(LINK_CUSUM, 2.0, table) == pytest.approx((2 + pooled) / 3, abs=1e-4)
    assert p_real(COMPUTE_CUSUM, 2.0, table) == pytest.approx((18 + pooled) / 21, abs=1e-4)
    # a basis the suite never saw reads the pooled share
    assert p_real(HEARTBEAT, 1.0, table) == pytest.approx(pooled, abs=1e-4)


def test_without_a_table_every_incident_reads_uncalibrated():
    assert p_real(COMPUTE_CUSUM, 5.0, table=None) in (UNCALIBRATED, p_real(COMPUTE_CUSUM, 5.0))
    assert calibration.p_real("anything", 1.0, {"p_real": {}, "pooled": {"p_real": 0.5}}) == UNCALIBRATED


def test_margin_bands_split_at_the_documented_edges_and_nan_is_weakest():
    assert [band(m) for m in (-1.0, 0.99, 1.0, 2.99, 3.0, math.inf, math.nan)] == [0, 0, 1, 1, 2, 2, 0]


def test_fitting_an_unknown_basis_or_reading_a_stale_table_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="unknown evidence basis 'guess'"):
        fit([("guess", 1.0, True)])
    stale = tmp_path / "t.json"
    stale.write_text(json.dumps({**fit(_rows(3, 0)), "margin_edges": [2.0]}))
    with pytest.raises(ValueError, match="regenerate it with `resihp bench detect --dialect all --fit-calibration`"):
        read_table(stale)


def test_the_committed_table_reads_cleanly_and_names_only_known_bases():
    table = read_table()
    if table is None:
        pytest.skip("no calibration table committed")
    assert set(table["p_real"]) <= set(BASES) and table["command"] == calibration.FIT_COMMAND
    for basis, ps in table["p_real"].items():
        assert ps == sorted(ps), basis


# ---- the wire ---------------------------------------------------------------------------------------


def _opened(p: float | None = None, location: Location | None = None, iid: str = "i1") -> IncidentOpened:
    return IncidentOpened(incident_id=iid, category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=3,
                          locations=[location or Location(target="compute", rank=1, factor=2.0, place_confidence=1.0)],
                          evidence=Evidence(basis=COMPUTE_CUSUM, margin=2.5), summary="rank 1 slow", p_real=p)


def test_a_schema_2_incident_decodes_with_its_confidence_as_the_place_and_p_real_uncalibrated():
    new = F.make(_opened())
    body = json.loads(encode_json(new))
    body["schema_version"] = 2
    body["payload"].pop("p_real", None)
    body["payload"]["evidence"] = {"statistic": "CUSUM", "note": ""}
    loc = body["payload"]["locations"][0]
    loc["confidence"] = loc.pop("place_confidence") * 0.25
    old = decode(json.dumps(body).encode())
    assert isinstance(old.payload, IncidentOpened)
    assert old.payload.p_real is None and old.payload.locations[0].place_confidence == 0.25
    # written back as it came: the bytes a signature covers are unchanged
    assert json.loads(encode_json(old))["payload"]["locations"][0] == loc
    state = IncidentLifecycle(job=JOB)
    record = step(state, F.make(old.payload))
    assert record is not None and not record.calibrated and record.p_real == UNCALIBRATED
    assert record.place_confidence == 0.25


def test_a_new_incident_carries_p_real_and_the_fold_keeps_the_latest():
    state = IncidentLifecycle(job=JOB)
    record = step(state, F.make(_opened(0.9)))
    assert record is not None and record.calibrated and record.p_real == 0.9
    step(state, F.make(IncidentConfirmed(incident_id="i1", method="probe", detail="x", p_real=0.97)))
    assert state.incidents["i1"].p_real == 0.97
    step(state, F.make(IncidentConfirmed(incident_id="i1", method="probe", detail="again")))  # no p_real: kept
    assert state.incidents["i1"].p_real == 0.97
    assert IncidentRecord.from_state(state.incidents["i1"].to_state()).p_real == 0.97


# ---- the policy ---------------------------------------------------------------------------------------


def _proposed(plan_id: str, incident: str) -> PlanProposed:
    return PlanProposed(plan_id=plan_id, incident_ids=[incident], strategy="ours", base_epoch=0, plan=PLAN1,
                        current_tokens_per_s=50.0, predicted_tokens_per_s=100.0, reshape_cost_s=3.0,
                        diff=["replica 1: dropped"], severity=Severity.HIGH)


def test_auto_apply_needs_every_answered_incident_at_the_policys_p_real():
    policy = PolicyChanged(mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], auto_min_p_real=0.9, actor="cli:ops")
    s = fold([F.make(policy), F.make(_opened(0.95, iid="sure")), F.make(_opened(0.6, iid="doubt")),
              F.make(_opened(None, iid="old"))], initial_state(JOB, PLAN0))
    assert auto_applies(s, _proposed("a", "sure")) is not None
    assert auto_applies(s, _proposed("b", "doubt")) is None
    assert auto_applies(s, _proposed("c", "old")) is None  # uncalibrated: an operator decides
    assert auto_applies(s, _proposed("d", "never-opened")) is None


def test_a_policy_without_a_p_real_bar_applies_by_severity_alone():
    policy = PolicyChanged(mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="cli:ops")
    assert "auto_min_p_real" not in json.loads(policy.model_dump_json())  # a schema 1 policy's bytes
    s = fold([F.make(policy), F.make(_opened(None, iid="old"))], initial_state(JOB, PLAN0))
    assert auto_applies(s, _proposed("c", "old")) is not None


# ---- the benchmark's reliability table ------------------------------------------------------------------


def test_reliability_bins_by_decile_and_judges_only_full_deciles():
    rows = [(0.95, True)] * 19 + [(0.95, False)] + [(0.35, True)] * 2 + [(0.35, False)] * 3 + [(1.0, True)]
    table = {row["decile"]: row for row in reliability(rows, min_judged=20)}
    assert set(table) == {"0.3-0.4", "0.9-1.0"}
    top = table["0.9-1.0"]
    assert top["incidents"] == 21 and top["share_real"] == pytest.approx(20 / 21, abs=1e-4)
    assert top["mean_p_real"] == pytest.approx((20 * 0.95 + 1.0) / 21, abs=1e-4) and top["judged"]
    low = table["0.3-0.4"]
    assert low["gap"] == pytest.approx(0.05, abs=1e-4) and not low["judged"]
    assert worst_judged_gap(list(table.values())) == top["gap"]
    assert worst_judged_gap([low]) is None
