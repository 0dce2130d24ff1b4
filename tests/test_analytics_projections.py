"""The projections: chunk rows with Σl² (NULL when not reported), ranks once per epoch, plans and
incidents folded from their lifecycle events, and the detector inside the consumer publishing what
it found (so nobody else opens the DuckDB file)."""

from __future__ import annotations

from pathlib import Path


from analytics.projections.control_tables import ControlProjection
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.projector import Projector
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import (
    Chunk, Coords, Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentResolved,
    Location, PlanDecision, PlanProposed, RankIteration, Severity,
)
from collector.plan import Plan
from collector.stream import EventStream
from tests.fixtures.signing import Authors


def _project(bus, db: Path, extra=()) -> Projector:
    pj = Projector(bus, db, "t", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                   [EventLogProjection(), TelemetryProjection(), ControlProjection(), *extra])
    return pj


def test_chunk_rows_carry_sum_of_squares_or_null_and_ranks_keep_their_first_iteration(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    f = Authors("j", "rank-3")
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
    ui, an = Authors("j", "ui:alice"), Authors("j", "analytics")
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
    det = DetectorProjection()
    pj = _project(bus, tmp_path / "a.duckdb", [det])
    for _ in range(200):
        n = pj.step(max_records=150, timeout_s=0.05)
        det.flush_outbox(pj.conn, bus)
        if n == 0 and pj.step(timeout_s=0.05) == 0:
            break
    rows = pj.conn.execute("SELECT status, locations->>'$[0].rank' FROM incidents").fetchall()
    assert rows == [("confirmed", "7")]
    assert pj.conn.execute("SELECT count(*) FROM predictions").fetchall() == [(16,)]
    assert pj.conn.execute("SELECT count(*) FROM detector_outbox").fetchall() == [(0,)]
    pj.close()
    with EventStream(bus, "reader", [topics.ANALYTICS]) as stream:
        kinds = [d.event.kind for d in stream.poll(10_000, 0.5)]
    assert kinds.count("incident.opened") == 1 and "analytics.prediction" in kinds


# ---- the detector's stored state across restarts ------------------------------------------------------


def _detect(bus, db: Path, config=None) -> Projector:
    """Run a consumer with the detector over everything on ``bus``, then close it."""
    from analytics.detection.config import DetectorConfig

    det = DetectorProjection(config=config or DetectorConfig())
    pj = _project(bus, db, [det])
    while pj.step(max_records=150, timeout_s=0.05) or pj.step(timeout_s=0.05):
        det.flush_outbox(pj.conn, bus)
    det.flush_outbox(pj.conn, bus)
    return pj


def test_a_restarted_consumer_goes_on_under_the_detector_config_it_was_started_with(tmp_path: Path) -> None:
    """An operator tunes the detector and restarts analytics: the restored state of a running job
    must obey the new config, not the one pickled with it."""
    from analytics.detection.config import DetectorConfig
    from test_detect_detector import synth

    events = synth(slow={7: 1.4}, start=6, iterations=24, plan=True)
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    bus.publish(events[: len(events) * 2 // 5])
    deaf = DetectorConfig(min_slowdown=5.0, min_alarm_factor=5.0)  # a ×1.4 rank is below its allowance
    pj = _detect(bus, tmp_path / "a.duckdb", deaf)
    assert pj.conn.execute("SELECT count(*) FROM incidents").fetchall() == [(0,)]
    pj.close()
    bus.publish(events[len(events) * 2 // 5:])
    pj = _detect(bus, tmp_path / "a.duckdb")  # the default config
    detector = pj.projections[-1]
    assert isinstance(detector, DetectorProjection)
    restored = detector.detectors["j"]
    assert restored.config == DetectorConfig()
    assert all(part.config is restored.config for part in (restored.book, restored.fail_stop, restored.arrival,
                                                           restored.costs))
    assert pj.conn.execute("SELECT locations->>'$[0].rank' FROM incidents").fetchall() == [("7",)]
    pj.close()


def _stored_state(tmp_path: Path) -> Path:
    """A DuckDB file holding the detector state of job ``j`` (and the bus beside it)."""
    from test_detect_detector import synth

    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    bus.publish(synth(iterations=4, plan=True))
    _detect(bus, tmp_path / "a.duckdb").close()
    bus.close()
    return tmp_path / "a.duckdb"


def _reopen(db: Path, config=None):
    import duckdb

    from analytics.detection.config import DetectorConfig

    conn = duckdb.connect(str(db))
    try:
        projection = DetectorProjection(config=config or DetectorConfig())
        projection.create(conn)
        return projection
    finally:
        conn.close()


def test_stored_detector_state_from_another_layout_version_is_refused_with_the_way_out(tmp_path: Path) -> None:
    import duckdb
    import pytest

    from analytics.detection.detector import STATE_VERSION
    from analytics.detection.config import DetectorConfig
    from analytics.projections.detector_projection import DetectorStateError

    db = _stored_state(tmp_path)
    assert _reopen(db).detectors["j"].job == "j"
    with pytest.raises(DetectorStateError, match=r"window_iterations 8 → 16 .*--rebuild"):
        _reopen(db, DetectorConfig(window_iterations=16))
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE detector_state SET version = 99")
    with pytest.raises(DetectorStateError, match=rf"job 'j' has layout version 99; this build reads version {STATE_VERSION}: "
                                                 r"stop this consumer .* resihp analytics --rebuild"):
        _reopen(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE detector_state SET version = ?, state = 'not a pickle'::BLOB", [STATE_VERSION])
    with pytest.raises(DetectorStateError, match=r"job 'j' cannot be read by this build \(UnpicklingError"):
        _reopen(db)


def test_state_stored_before_layout_versions_is_read_as_version_1(tmp_path: Path) -> None:
    import duckdb
    import pytest

    from analytics.detection.detector import STATE_VERSION
    from analytics.projections.detector_projection import DetectorStateError

    db = _stored_state(tmp_path)
    with duckdb.connect(str(db)) as conn:
        conn.execute("ALTER TABLE detector_state DROP COLUMN version")  # the table as older builds made it
    with pytest.raises(DetectorStateError, match=rf"layout version 1; this build reads version {STATE_VERSION}"):
        _reopen(db)  # version 1 is not this build's layout: the way out is named, nothing is guessed
    with duckdb.connect(str(db)) as conn:
        assert conn.execute("SELECT version FROM detector_state").fetchall() == [(None,)]
