"""The Grafana dashboard (infra/grafana/): the committed JSON is what the code builds, it loads into
the grafana-foundation-sdk's dashboard model and re-exports unchanged (every field is one the model
knows), it has the fields Grafana needs to import it, and every series it queries is one our
exporters serve."""

from __future__ import annotations

import json
import re

from analytics.goodput_projection import GoodputProjection
from analytics.metrics import AnalyticsCollector, AnalyticsSnapshot, ApprovalCollector
from collector.events import EventFactory, IterationSummary
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
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
    proj = GoodputProjection()
    e = EventFactory("j", "launcher").make(IterationSummary(epoch=0, iteration=0, tokens=1, wall_s=1.0), time_s=10.0)
    proj.fold.apply(e)
    snap = AnalyticsSnapshot(jobs=proj.snapshot(), lag={("analytics", "resihp.telemetry"): 0}, dead_letters={"g": 0})
    names = set()
    for collector in (AnalyticsCollector(lambda: snap), ApprovalCollector(lambda: ("j", [1.0]))):
        for family in collector.collect():
            names |= {s.name for s in family.samples} | {family.name}
    return names


def test_every_series_it_queries_is_served() -> None:
    text = dashboard.OUT.read_text()
    queried = set(re.findall(r"\b(resihp_[a-z_]+)", text))
    served = _served_names() | {"resihp_rank_slowdown_factor_bucket"}  # a histogram's buckets, with ranks
    assert queried and queried <= served, queried - served
