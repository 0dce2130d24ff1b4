"""The projections: chunk rows with Σl² (NULL when not reported), ranks once per epoch, plans and
incidents folded from their lifecycle events, and the detector inside the consumer publishing what
it found (so nobody else opens the DuckDB file)."""

from __future__ import annotations

from pathlib import Path


from analytics.control_tables import ControlProjection
from analytics.detector_projection import DetectorProjection
from analytics.event_log import EventLogProjection
from analytics.projector import Projector
from analytics.tables import TelemetryProjection
from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import (
    Chunk, Coords, EventFactory, Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved,
    Location, PlanDecision, PlanProposed, RankIteration, Severity,
)
from collector.plan import Plan
from collector.stream import EventStream


def _project(bus, db: Path, extra=()) -> Projector:
    pj = Projector(bus, db, "t", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                   [EventLogProjection(), TelemetryProjection(), ControlProjection(), *extra])
    return pj


def test_chunk_rows_carry_sum_of_squares_or_null_and_ranks_keep_their_first_iteration(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    f = EventFactory("j", "rank-3")
    bus.publish([f.make(RankIteration(
        epoch=0, iteration=it, rank=3, node=0, coords=Coords(tp=1, pp=0, dp=1), wall_s=1.0,
        chunks=[Chunk(kind="F", microbatch=0, tokens=30, seq_lens=[10, 20], start_s=0, duration_s=0.1),
                Chunk(kind="B", microbatch=0, tokens=30, seq_lens=None, start_s=0.1, duration_s=0.2)]))
        for it in (4, 5)])
    pj = _project(bus, tmp_path / "a.duckdb")
    pj.run(idle_exit_s=0.2)
    rows = pj.conn.execute("SELECT iteration, kind, sum_sq_len, n_seqs FROM chunks ORDER BY iteration, kind").fetchall()
    assert rows == [(4, "B", None, None), (4, "F", 500.0, 2), (5, "B", None, None), (5, "F", 500.0, 2)]
    assert pj.conn.execute("SELECT rank, tp, dp, first_iteration FROM ranks").fetchall() == [(3, 1, 1, 4)]
    assert pj.conn.execute("SELECT compute_s FROM rank_iterations").fetchall() == [(0.30000000000000004,)] * 2
    pj.close()


def test_plans_and_incidents_are_folds_of_their_lifecycle_events(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    plan = Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1)
    ui, an = EventFactory("j", "ui:alice"), EventFactory("j", "analytics")
    loc = Location(target="compute", rank=2, factor=1.5)
    bus.publish([
        an.make(IncidentOpened(incident_id="i1", category=FaultCategory.FAIL_SLOW, severity=Severity.MEDIUM,
                               iteration=7, locations=[loc], evidence=Evidence(), summary="rank 2 slow")),
        an.make(IncidentConfirmed(incident_id="i1", method="probe", detail="x1.5")),
        an.make(IncidentResolved(incident_id="i1", iteration=30, reason="reconfigured")),
        ui.make(PlanProposed(plan_id="p1", incident_ids=["i1"], strategy="s", base_epoch=0, plan=plan,
                             current_tokens_per_s=1.0, predicted_tokens_per_s=2.0, reshape_cost_s=1.0, diff=["d"])),
        ui.make(PlanDecision(plan_id="p1", approve=True, actor="ui:alice")),
    ])
    pj = _project(bus, tmp_path / "a.duckdb")
    pj.run(idle_exit_s=0.2)
    inc = pj.conn.execute("SELECT incident_id, status, confirmed_by, opened_iteration, resolved_iteration "
                          "FROM incidents").fetchall()
    assert inc == [("i1", "resolved", "probe", 7, 30)]
    assert pj.conn.execute("SELECT plan_id, status, epoch, shape FROM plans").fetchall() == [("p1", "approved", 1, "TP1·PP2·DP1")]
    pj.close()


def test_the_consumer_publishes_incidents_and_its_own_tables_fold_them_back(tmp_path: Path) -> None:
    from test_detect_detector import synth

    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    bus.publish(synth(slow={7: 1.4}, start=6, iterations=16, plan=True))  # plan.current, as producers announce it
    pj = _project(bus, tmp_path / "a.duckdb", [DetectorProjection()])
    det = pj.projections[-1]
    for _ in range(200):
        n = pj.step(max_records=150, timeout_s=0.05)
        det.flush_outbox(pj.conn, bus)
        if n == 0 and pj.step(timeout_s=0.05) == 0:
            break
    rows = pj.conn.execute("SELECT status, locations->>'$[0].rank' FROM incidents").fetchall()
    assert rows == [("confirmed", "7")]
    assert pj.conn.execute("SELECT count(*) FROM predictions").fetchone()[0] == 16
    assert pj.conn.execute("SELECT count(*) FROM detector_outbox").fetchone()[0] == 0
    pj.close()
    with EventStream(bus, "reader", [topics.ANALYTICS]) as stream:
        kinds = [d.event.kind for d in stream.poll(10_000, 0.5)]
    assert kinds.count("incident.opened") == 1 and "analytics.prediction" in kinds
