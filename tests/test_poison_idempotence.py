"""Duplicates and replays change nothing, on both buses; a dead letter always fits the bus.

A run is published and folded by the analytics consumer (every projection and the detector). Then
the same records arrive again — republished as they are, and replayed from a recorded trace with
``collector.trace.replay`` (what ``resihp replay`` does) — and the consumer must add no row, fold
nothing into the detector and publish no incident: the replay of a run is not a new run.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from analytics.projections.control_tables import ControlProjection
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.projector import Projector
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.bus import Bus, RawMessage
from collector.codec import MAX_EVENT_BYTES, encode
from collector.events import DeadLetter
from collector.stream import EventStream
from collector.trace import TraceWriter, replay
from tests.fixtures.payloads import payload_as

TABLES = ("events", "chunks", "rank_iterations", "heartbeats", "ranks", "iterations", "incident_events",
          "plan_events", "predictions", "rank_health")


def _consume(bus: Bus, db: Path) -> Projector:
    """Fold everything on the bus, publishing the detector's output, until nothing new arrives."""
    det = DetectorProjection()
    pj = Projector(bus, db, "analytics", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                   [EventLogProjection(), TelemetryProjection(), ControlProjection(), det])
    idle, started, deadline = 0, False, time.monotonic() + 120
    while idle < 8 and time.monotonic() < deadline:  # a Kafka consumer reads nothing until it is assigned
        moved = pj.step(max_records=2_000, timeout_s=0.3)
        published = det.flush_outbox(pj.conn, bus)
        started = started or bool(moved)
        idle = 0 if moved or published or not started else idle + 1
    return pj


def _counts(pj: Projector) -> dict[str, int]:
    counts: dict[str, int] = {}
    for table in TABLES:
        row = pj.conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        counts[table] = row[0]
    return counts


def _analytics_records(bus: Bus) -> int:
    return sum(bus.end_offsets([topics.ANALYTICS]).values())


def test_a_republished_and_a_replayed_run_add_no_row_and_raise_no_incident(bus_factory, tmp_path: Path) -> None:
    from test_detect_detector import synth

    events = synth(slow={4: 1.5}, start=6, iterations=14, dp=2, plan=True)
    bus = bus_factory()
    bus.publish(events)
    db = tmp_path / "a.duckdb"
    pj = _consume(bus, db)
    first = _counts(pj)
    assert first["incident_events"] > 0 and first["chunks"] > 0, first  # the run itself was detected
    published = _analytics_records(bus)
    state = pj.conn.execute("SELECT job, emitted, state FROM detector_state").fetchall()
    pj.close()

    bus.publish(events)  # republished, as a retrying producer would
    trace = tmp_path / "run.parquet"
    with TraceWriter(trace) as writer:
        writer.write(events)
    assert replay(trace, bus, speed=0) == len(events)  # resihp replay onto the live bus

    pj = _consume(bus, db)  # the same consumer, restarted, reads both copies
    assert _counts(pj) == first
    assert pj.duplicates == 2 * len(events)
    assert pj.conn.execute("SELECT job, emitted, state FROM detector_state").fetchall() == state
    assert _analytics_records(bus) == published, "the replay raised incidents or predictions"
    pj.close()


def test_a_dead_letter_of_a_record_at_the_size_limit_fits_the_bus(bus_factory) -> None:
    """An undecodable record just under the limit (Kafka's ~1 MB): before bounding, its base64 dead
    letter exceeded the limit and the consumer crash-looped on it. Now it carries a 64 KiB prefix,
    the length and the SHA-256, and the consumer goes on to the next record."""
    bus = bus_factory()
    raw = b"{" + b"\xfe" * (MAX_EVENT_BYTES - 200)
    from test_detect_detector import synth

    good = synth(iterations=1, tp=1, pp=1, dp=1)[0]
    bus.publish_raw([RawMessage(topics.TELEMETRY, b"j/rank-0", raw)])
    bus.publish([good])
    stream = EventStream(bus, "analytics", [topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps})
    got = []
    for _ in range(20):
        got += stream.poll(timeout_s=0.5)
        if got:
            break
    stream.close()
    assert [d.event.id for d in got] == [good.id] and stream.counters.dead_letters == 1
    letters = EventStream(bus, "reader", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps})
    found = []
    for _ in range(20):
        found += [d.event for d in letters.poll(timeout_s=0.5) if isinstance(d.event.payload, DeadLetter)]
        if found:
            break
    letters.close()
    (event,) = found
    letter = payload_as(event, DeadLetter)
    assert len(encode(event)) < MAX_EVENT_BYTES // 4
    assert letter.raw_length == len(raw) and letter.raw_sha256 == hashlib.sha256(raw).hexdigest()
    assert "not UTF-8" in letter.reason and letter.group == "analytics"
