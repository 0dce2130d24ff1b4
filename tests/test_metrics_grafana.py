"""The Grafana dashboard (infra/grafana/): the committed JSON is what the code builds, it loads into
the grafana-foundation-sdk's dashboard model and re-exports unchanged (every field is one the model
knows), it has the fields Grafana needs to import it, and every series it — and every alert rule —
queries is one our exporters serve."""

from __future__ import annotations

import json
import re

import duckdb
import yaml

from analytics.projections.goodput_projection import GoodputProjection
from analytics.service.metrics import AnalyticsCollector, AnalyticsSnapshot, ApprovalCollector
from collector.events import (
    EventFactory, Evidence, FaultCategory, IncidentOpened, IterationPrediction, IterationSummary, RankHealth, RankHealthEntry,
    Location, RankState, Severity, StageTime,
)
from collector.stream import Delivery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from infra import monitoring
from infra.grafana import dashboard


def test_the_committed_json_is_what_the_code_builds() -> None:
    assert dashboard.main(["--check"]) == 0, "run python -m infra.grafana.dashboard"


def test_the_json_round_trips_through_the_sdks_dashboard_model() -> None:
    exported = json.loads(dashboard.OUT.read_text())
    model = Dashboard.from_json(exported)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == exported


def test_it_has_what_grafana_needs_to_import_it() -> None:
    d = json.loads(dashboard.OUT.read_text())
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(i > 0 for i in ids)
    for p in d["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["type"] in {"row", "stat", "timeseries"}
        for t in p.get("targets", []):
            assert t["refId"] and t["expr"] and p["datasource"]["uid"] == "${datasource}"
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "job"}
    assert d["annotations"]["list"][0]["expr"]
    loss = next(p for p in d["panels"] if p["title"].startswith("Where the time goes"))
    assert loss["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def _served_names() -> set[str]:
    """Every series name the two exporters render for a job with a prediction per stage, an open
    incident and rank health (so the per-stage, per-incident and histogram series are all there)."""
    proj = GoodputProjection()
    trainer, analytics = EventFactory("j", "launcher"), EventFactory("j", "analytics")
    events = [
        trainer.make(IterationSummary(epoch=0, iteration=0, tokens=1, wall_s=1.0), time_s=10.0),
        analytics.make(IterationPrediction(epoch=0, iteration=0, observed_s=1.0, predicted_s=1.0, tokens=1, stages=[
            StageTime(replica=0, stage=0, observed_s=0.5, predicted_s=0.5)]), time_s=10.0),
        analytics.make(IncidentOpened(incident_id="i", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH,
                                      iteration=0, summary="x", evidence=Evidence(),
                                      locations=[Location(target="compute", rank=0, factor=2.0, confidence=0.9)]),
                       time_s=10.0),
        analytics.make(RankHealth(epoch=0, iteration=0, ranks=[RankHealthEntry(rank=0, state=RankState.SLOW, factor=2.0)]),
                       time_s=10.0),
    ]
    conn = duckdb.connect()
    proj.create(conn)
    proj.apply(conn, [Delivery("t", 0, i, e) for i, e in enumerate(events)])
    snap = AnalyticsSnapshot(jobs=proj.snapshot(), lag={("analytics", "resihp.telemetry"): 0}, dead_letters={"g": 0})
    names = set()
    for collector in (AnalyticsCollector(lambda: snap), ApprovalCollector(lambda: ("j", [1.0]))):
        for family in collector.collect():
            assert family.samples, f"{family.name} rendered no sample: the fixture misses what it needs"
            names |= {s.name for s in family.samples}
    return names


def test_every_series_it_queries_is_served() -> None:
    queried = set(re.findall(r"\b(resihp_[a-z_]+)", dashboard.OUT.read_text()))
    served = _served_names()
    assert queried and queried <= served, queried - served


def test_every_series_the_alert_rules_query_is_served() -> None:
    rules = yaml.safe_load(monitoring.RULES.read_text())["groups"][0]["rules"]
    queried = {name for rule in rules for name in re.findall(r"\b(resihp_[a-z_]+)", rule["expr"])}
    served = _served_names()
    assert len(rules) == 6 and queried and queried <= served, queried - served
