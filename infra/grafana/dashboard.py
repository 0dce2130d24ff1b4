"""The ResiHP Grafana dashboard as code (grafana-foundation-sdk), written to ``infra/grafana/resihp.json``.

    python -m infra.grafana.dashboard            # regenerate the JSON beside this file
    python -m infra.grafana.dashboard --check    # exit 1 if the committed JSON is not what the code builds

Panels: goodput over time with the loss stacked by cause, observed against predicted iteration time,
and per pipeline stage (observed / predicted compute, and both in seconds), open incidents by category and severity, ranks by slowdown factor, plans waiting for approval,
consumer lag and dead letters; incidents are annotations (when the count of open incidents of a job
rises). A ``job`` variable picks the training job; the Prometheus data source is a variable too, so
the JSON imports into any Grafana as exported. The series are documented in docs/metrics.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard

OUT = Path(__file__).resolve().parent / "resihp.json"
DS = dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")
J = 'job=~"$job"'


def _q(expr: str, legend: str, ref: str = "A") -> prom_b.Dataquery:
    return prom_b.Dataquery().expr(expr).legend_format(legend).ref_id(ref)


def _series(title: str, unit: str, *queries: prom_b.Dataquery, stacked: bool = False, w: int = 12,
            h: int = 8) -> ts_b.Panel:
    panel = ts_b.Panel().title(title).unit(unit).datasource(DS).span(w).height(h)
    for q in queries:
        panel = panel.with_target(q)
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
    return panel


def build() -> dashboard.Dashboard:
    goodput = (stat_b.Panel().title("Goodput (whole run)").unit("percentunit").datasource(DS).span(6).height(6)
               .with_target(_q(f"resihp_goodput_ratio{{{J}}}", "{{job}}")))
    windowed = _series(
        "Goodput, last 30 min", "percentunit",
        _q(f"1 - sum by (job) (rate(resihp_goodput_loss_seconds_total{{{J}}}[30m])) / "
           f"sum by (job) (rate(resihp_goodput_wall_seconds_total{{{J}}}[30m]))", "{{job}}"), w=18, h=6)
    loss = _series("Where the time goes: loss by cause (seconds lost per second)", "percentunit",
                   _q(f"sum by (cause) (rate(resihp_goodput_loss_seconds_total{{{J}}}[5m]))", "{{cause}}"),
                   stacked=True, w=24)
    iteration = _series("Iteration time: observed vs predicted", "s",
                        _q(f"resihp_iteration_observed_seconds{{{J}}}", "observed {{job}}"),
                        _q(f"resihp_iteration_predicted_seconds{{{J}}}", "predicted {{job}}", "B"))
    stage_ratio = _series("Per stage: observed / predicted compute (the replica furthest above)", "short",
                          _q(f"max by (job, stage) (resihp_stage_observed_seconds{{{J}}} / "
                             f"resihp_stage_predicted_seconds{{{J}}})", "stage {{stage}}"))
    stage_time = _series("Per stage: compute time, observed vs predicted", "s",
                         _q(f"max by (job, stage) (resihp_stage_observed_seconds{{{J}}})", "observed stage {{stage}}"),
                         _q(f"max by (job, stage) (resihp_stage_predicted_seconds{{{J}}})", "predicted stage {{stage}}",
                            "B"))
    incidents = _series("Open incidents", "short",
                        _q(f"sum by (category, severity) (resihp_open_incidents{{{J}}})", "{{category}} {{severity}}"),
                        stacked=True)
    factors = _series("Ranks by slowdown factor", "short",
                      _q(f"sum by (le) (resihp_rank_slowdown_factor_bucket{{{J}}})", "≤ {{le}}"),
                      _q(f"resihp_ranks{{{J},state=\"dead\"}}", "dead", "B"))
    approval = _series("Plans waiting for approval (oldest wait)", "s",
                       _q(f"resihp_plan_approval_wait_seconds{{{J}}}", "{{job}}"))
    lag = _series("Consumer lag (records)", "short", _q("sum by (group, topic) (resihp_consumer_lag_records)",
                                                          "{{group}} {{topic}}"))
    dead = _series("Dead letters (per minute)", "short",
                   _q("sum by (group) (rate(resihp_dead_letters_total[5m])) * 60", "{{group}}"))
    annotation = (dash_b.AnnotationQuery().name("Incidents").datasource(DS).enable(True).icon_color("red")
                  .expr(f"sum by (job, category) (changes(resihp_open_incidents{{{J}}}[1m])) > 0"))
    job_var = (dash_b.QueryVariable("job").label("Training job").datasource(DS)
               .query("label_values(resihp_goodput_ratio, job)").multi(True).include_all(True)
               .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED))
    ds_var = dash_b.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    built = (dash_b.Dashboard("ResiHP: goodput and incidents").uid("resihp-goodput").tags(["resihp", "training"])
             .refresh("10s").time("now-6h", "now").timezone("browser")
             .with_variable(ds_var).with_variable(job_var).annotation(annotation)
             .with_row(dash_b.Row("Goodput")).with_panel(goodput).with_panel(windowed).with_panel(loss)
             .with_row(dash_b.Row("The job")).with_panel(iteration).with_panel(stage_ratio).with_panel(stage_time)
             .with_panel(incidents).with_panel(factors)
             .with_panel(approval)
             .with_row(dash_b.Row("The platform")).with_panel(lag).with_panel(dead)
             .build())
    for i, panel in enumerate(built.panels or []):
        panel.id_val = i + 1  # Grafana keys panel state (links, edits) by id: unique and stable
    return built


def render() -> str:
    return json.dumps(build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is not what infra/grafana/dashboard.py builds: run python -m infra.grafana.dashboard",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
