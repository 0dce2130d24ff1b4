"""The lifecycle projections: plans, incidents, predictions and rank health.

Plans and incidents are folds over their events (eventsourcing's habit): every lifecycle event is
appended to ``plan_events`` / ``incident_events`` through Arrow, and the views ``plans`` and
``incidents`` fold them into one row each, ordered by log position (control and incident events
are keyed by their source, so their order in the log is the order they happened). Appending plus a
view keeps ingestion one statement per batch and makes replay trivially identical.

A plan event's ``status`` is the state collector/plan_lifecycle.py's fold moves the plan to
(:func:`~collector.plan_lifecycle.claimed_status`): one vocabulary with the engine, the console and
the demo. An event that moves no plan (a trainer's ``ignored_*`` ack) has no status, and the view
keeps the plan's last one. The view does not re-judge events the fold would refuse (a second
decision, a stale command): the engine never acts on those, so they are rare, and the fold itself
is the referee.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import duckdb
import pyarrow as pa

from analytics.projections.tables import insert_arrow
from collector.events import (
    CommandAck, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated, IterationPrediction,
    PlanDecision, PlanProposed, PlanRolledBack, PlanVerified, RankHealth, ReconfigureCommand,
)
from collector.plan_lifecycle import claimed_status
from collector.stream import Delivery

PLAN_EVENT_SCHEMA = pa.schema([
    ("job", pa.string()), ("plan_id", pa.string()), ("kind", pa.string()), ("status", pa.string()),
    ("epoch", pa.int32()), ("strategy", pa.string()), ("shape", pa.string()),
    ("predicted_tokens_per_s", pa.float64()), ("plan", pa.string()), ("detail", pa.string()),
    ("time_s", pa.float64()), ("part", pa.int32()), ("log_offset", pa.int64()),
])

INCIDENT_EVENT_SCHEMA = pa.schema([
    ("job", pa.string()), ("incident_id", pa.string()), ("kind", pa.string()), ("category", pa.string()),
    ("severity", pa.string()), ("iteration", pa.int64()), ("method", pa.string()), ("summary", pa.string()),
    ("locations", pa.string()), ("evidence", pa.string()), ("time_s", pa.float64()), ("part", pa.int32()),
    ("log_offset", pa.int64()),
])

PREDICTION_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("iteration", pa.int64()), ("observed_s", pa.float64()),
    ("predicted_s", pa.float64()), ("tokens", pa.int64()), ("model_error", pa.float64()), ("time_s", pa.float64()),
])

RANK_HEALTH_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("iteration", pa.int64()), ("rank", pa.int32()),
    ("state", pa.string()), ("factor", pa.float64()), ("time_s", pa.float64()),
])

_DDL = (
    "CREATE TABLE IF NOT EXISTS plan_events (job VARCHAR, plan_id VARCHAR, kind VARCHAR, status VARCHAR, "
    "epoch INTEGER, strategy VARCHAR, shape VARCHAR, predicted_tokens_per_s DOUBLE, plan JSON, detail VARCHAR, "
    "time_s DOUBLE, part INTEGER, log_offset BIGINT)",
    "CREATE TABLE IF NOT EXISTS incident_events (job VARCHAR, incident_id VARCHAR, kind VARCHAR, category VARCHAR, "
    "severity VARCHAR, iteration BIGINT, method VARCHAR, summary VARCHAR, locations JSON, evidence JSON, "
    "time_s DOUBLE, part INTEGER, log_offset BIGINT)",
    "CREATE TABLE IF NOT EXISTS predictions (job VARCHAR, epoch INTEGER, iteration BIGINT, observed_s DOUBLE, "
    "predicted_s DOUBLE, tokens BIGINT, model_error DOUBLE, time_s DOUBLE)",
    "CREATE TABLE IF NOT EXISTS rank_health (job VARCHAR, epoch INTEGER, iteration BIGINT, rank INTEGER, "
    "state VARCHAR, factor DOUBLE, time_s DOUBLE)",
    # One row per plan: what was proposed, and where its lifecycle stands now.
    "CREATE OR REPLACE VIEW plans AS SELECT plan_id, any_value(job) AS job, "
    "arg_max(status, CASE WHEN status IS NULL THEN -1 ELSE log_offset END) AS status, "
    "max(epoch) AS epoch, max(strategy) AS strategy, max(shape) AS shape, "
    "max(predicted_tokens_per_s) AS predicted_tokens_per_s, "
    "arg_max(plan, CASE WHEN plan IS NULL THEN -1 ELSE log_offset END) AS plan, "
    "arg_max(detail, log_offset) AS detail, max(time_s) AS updated_s FROM plan_events GROUP BY plan_id",
    # One row per incident: opened where, confirmed how, resolved when.
    "CREATE OR REPLACE VIEW incidents AS SELECT incident_id, any_value(job) AS job, max(category) AS category, "
    "arg_max(severity, CASE WHEN severity IS NULL THEN -1 ELSE log_offset END) AS severity, "
    "min(iteration) FILTER (WHERE kind = 'opened') AS opened_iteration, "
    "CASE WHEN bool_or(kind = 'resolved') THEN 'resolved' WHEN bool_or(kind = 'confirmed') THEN 'confirmed' "
    "ELSE 'open' END AS status, "
    "max(method) FILTER (WHERE kind = 'confirmed') AS confirmed_by, "
    "max(iteration) FILTER (WHERE kind = 'resolved') AS resolved_iteration, "
    "arg_max(locations, CASE WHEN locations IS NULL THEN -1 ELSE log_offset END) AS locations, "
    "max(summary) FILTER (WHERE kind = 'opened') AS summary, "
    "max(summary) FILTER (WHERE kind = 'resolved') AS resolution FROM incident_events GROUP BY incident_id",
)

class ControlProjection:
    """plan_events (+ view plans), incident_events (+ view incidents), predictions, rank_health."""

    tables: tuple[str, ...] = ("plan_events", "incident_events", "predictions", "rank_health")

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        for ddl in _DDL:
            conn.execute(ddl)

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        pe: dict[str, list] = {n: [] for n in PLAN_EVENT_SCHEMA.names}
        ie: dict[str, list] = {n: [] for n in INCIDENT_EVENT_SCHEMA.names}
        pr: dict[str, list] = {n: [] for n in PREDICTION_SCHEMA.names}
        rh: dict[str, list] = {n: [] for n in RANK_HEALTH_SCHEMA.names}
        for d in deliveries:
            e, p = d.event, d.event.payload
            where = (e.time_s, d.partition, d.offset)
            if isinstance(p, IterationPrediction):
                _append(pr, PREDICTION_SCHEMA, (e.job, p.epoch, p.iteration, p.observed_s, p.predicted_s, p.tokens,
                                                p.model_error, e.time_s))
            elif isinstance(p, RankHealth):
                for r in p.entries():
                    _append(rh, RANK_HEALTH_SCHEMA, (e.job, p.epoch, p.iteration, r.rank, r.state.value, r.factor,
                                                     e.time_s))
            elif (row := _plan_row(e.job, p)) is not None:
                _append(pe, PLAN_EVENT_SCHEMA, row + where)
            elif (row := _incident_row(e.job, p)) is not None:
                _append(ie, INCIDENT_EVENT_SCHEMA, row + where)
        insert_arrow(conn, "plan_events", pa.Table.from_pydict(pe, schema=PLAN_EVENT_SCHEMA))
        insert_arrow(conn, "incident_events", pa.Table.from_pydict(ie, schema=INCIDENT_EVENT_SCHEMA))
        insert_arrow(conn, "predictions", pa.Table.from_pydict(pr, schema=PREDICTION_SCHEMA))
        insert_arrow(conn, "rank_health", pa.Table.from_pydict(rh, schema=RANK_HEALTH_SCHEMA))


def _append(cols: dict[str, list], schema: pa.Schema, values: tuple) -> None:
    for name, value in zip(schema.names, values, strict=True):
        cols[name].append(value)


def _plan_row(job: str, p: object) -> tuple | None:
    """(job, plan_id, kind, status, epoch, strategy, shape, predicted, plan, detail) or None."""
    claimed = claimed_status(p)
    status = claimed.value if claimed is not None else None
    if isinstance(p, PlanProposed):
        return (job, p.plan_id, "proposed", status, p.plan.epoch, p.strategy, p.plan.shape(),
                p.predicted_tokens_per_s, p.plan.model_dump_json(), "; ".join(p.diff))
    if isinstance(p, PlanDecision):
        return (job, p.plan_id, "decision", status, None, None, None, None, None,
                f"{p.actor}: {p.comment}".rstrip(": "))
    if isinstance(p, ReconfigureCommand):
        return (job, p.plan_id, "command", status, p.plan.epoch, None, p.plan.shape(), None,
                p.plan.model_dump_json(), p.command_id)
    if isinstance(p, CommandAck):
        return (job, p.plan_id, "ack", status, p.running_epoch, None, None, None, None,
                p.detail or f"pause {p.pause_s:.2f} s")
    if isinstance(p, PlanVerified):
        return (job, p.plan_id, "verified", status, None, None, None, p.predicted_tokens_per_s, None,
                f"measured {p.measured_tokens_per_s:.0f} tokens/s")
    if isinstance(p, PlanRolledBack):
        return (job, p.plan_id, "rolled_back", status, None, None, None, p.predicted_tokens_per_s, None,
                p.reason)
    return None


def _incident_row(job: str, p: object) -> tuple | None:
    """(job, incident_id, kind, category, severity, iteration, method, summary, locations, evidence) or None."""
    if isinstance(p, IncidentOpened):
        return (job, p.incident_id, "opened", p.category.value, p.severity.value, p.iteration, None, p.summary,
                _locations(p.locations), p.evidence.model_dump_json())
    if isinstance(p, IncidentConfirmed):
        return (job, p.incident_id, "confirmed", None, None, None, p.method, p.detail,
                _locations(p.locations) if p.locations else None, None)
    if isinstance(p, IncidentUpdated):
        return (job, p.incident_id, "updated", None, p.severity.value, p.iteration, None, None,
                _locations(p.locations), p.evidence.model_dump_json())
    if isinstance(p, IncidentResolved):
        return (job, p.incident_id, "resolved", None, None, p.iteration, None, p.reason, None, None)
    return None


def _locations(locations: list) -> str:
    return json.dumps([loc.model_dump(mode="json") for loc in locations])
