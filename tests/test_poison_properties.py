"""No record stops a consumer: arbitrary bytes and schema-valid extremes, thrown at the whole path.

Hypothesis builds a log of valid events at the contract's edges (ids and coordinates at int32's
end, iterations and sequence numbers at 2^53, durations at their bound and at the smallest double,
plans on the highest device ids, any text), mixed with bytes that are not events and with records
one step outside a range (2^31, -1, NaN, Infinity, a number too large for a double). The log goes
through the collector (decode + dead letters), analytics (the projector with every projection and
the detector), the remediation engine and the console's read model, and then again (a republish),
and the test asserts that nothing raised, that every valid event id has exactly one row, and that
every invalid record has exactly one dead letter with a reason.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analytics.projections.control_tables import ControlProjection
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.projector import Projector
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.bus import RawMessage
from collector.codec import MAX_EVENT_BYTES, encode, header_json, readable
from collector.embedded import EmbeddedBus
from collector.events import (
    COUNT_MAX, DURATION_MAX_S, INT32_MAX, TIME_MAX_S, TOKENS_MAX, AckStatus, Chunk, ChunkKind, CommandAck, CommOp,
    CommWait, Coords, DeadLetter, EventFactory, Evidence, FaultCategory, Heartbeat, IncidentOpened, IncidentResolved,
    IterationPrediction, IterationSummary, Location, PlanCurrent, PlanDecision, PlanProposed, ProbeResult,
    RankHealth, RankHealthEntry, RankIteration, RankState, Severity, TracingDeclared,
)
from collector.plan import Plan
from collector.stream import EventStream
from remediation.engine import EngineConfig, RemediationEngine
from remediation.model import PlannerModel
from tests.fixtures.payloads import payload_as
from ui.read_model import ReadModel

JOB = "poison"
GROUP = "analytics"

i32 = st.one_of(st.integers(0, 9), st.sampled_from([INT32_MAX, INT32_MAX - 1, 2**20, 2**24]))
count = st.one_of(st.integers(0, 50), st.sampled_from([COUNT_MAX, COUNT_MAX - 1, 2**31, 2**63 // 2**11]))
duration = st.one_of(st.floats(0, DURATION_MAX_S), st.sampled_from([0.0, 5e-324, DURATION_MAX_S]))
positive = st.one_of(st.floats(1e-9, 1e3), st.sampled_from([5e-324, 1e-300, 1.7e308]))
finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=24)
ids = st.one_of(st.uuids().map(lambda u: u.hex), st.text(min_size=1, max_size=64))

chunks = st.builds(
    Chunk, kind=st.sampled_from(list(ChunkKind)), microbatch=i32, virtual_stage=i32,
    tokens=st.one_of(st.none(), st.integers(1, 4096), st.just(TOKENS_MAX)),
    seq_lens=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 4096), st.just(INT32_MAX)), max_size=4)),
    start_s=duration, duration_s=duration)
comm = st.builds(CommWait, op=st.sampled_from(list(CommOp)), peer=st.one_of(st.none(), i32),
                 microbatch=st.one_of(st.none(), i32), bytes=st.one_of(st.none(), count), start_s=duration,
                 duration_s=duration)
coords = st.builds(Coords, tp=i32, pp=i32, dp=i32, cp=i32)
location = st.builds(Location, target=st.sampled_from(["compute", "link", "node"]), rank=st.one_of(st.none(), i32),
                     link=st.one_of(st.none(), st.tuples(i32, i32)), replica=st.one_of(st.none(), i32),
                     stage=st.one_of(st.none(), i32), factor=positive, confidence=st.floats(0, 1))
evidence = st.builds(Evidence, iterations=st.lists(count, max_size=3), observed_s=st.lists(finite, max_size=3),
                     predicted_s=st.lists(finite, max_size=3),
                     rank_factors=st.dictionaries(i32, finite, max_size=3), statistic=text, note=text)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    top = INT32_MAX - tp * pp * dp + 1
    return Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4, microbatches_per_replica=draw(st.integers(1, 4)),
                        epoch=draw(i32), first_device=draw(st.sampled_from([0, 2**20, top])))


payloads = st.one_of(
    st.builds(lambda **kw: RankIteration(**kw), epoch=i32, iteration=count, rank=i32, node=st.one_of(st.none(), i32), coords=coords,
              wall_s=duration, chunks=st.lists(chunks, max_size=4), comm=st.lists(comm, max_size=2)),
    st.builds(Heartbeat, rank=i32, epoch=i32, iteration=count, interval_s=st.floats(1e-9, DURATION_MAX_S)),
    st.builds(IterationSummary, epoch=i32, iteration=count, loss=st.one_of(st.none(), finite),
              tokens=count, wall_s=duration),
    st.builds(TracingDeclared, epoch=i32, dialect=st.text(min_size=1, max_size=8),
              traced_ranks=st.one_of(st.none(), st.lists(i32, max_size=3)), step_every=st.integers(1, INT32_MAX),
              step_offset=i32),
    st.builds(IterationPrediction, epoch=i32, iteration=count, observed_s=st.floats(0, 1e300),
              predicted_s=st.floats(0, 1e300), tokens=count, model_error=st.one_of(st.none(), finite)),
    st.builds(RankHealth, epoch=i32, iteration=count, ranks=st.lists(
        st.builds(RankHealthEntry, rank=i32, state=st.sampled_from(list(RankState)), factor=positive), max_size=3)),
    st.builds(IncidentOpened, incident_id=ids, category=st.sampled_from(list(FaultCategory)),
              severity=st.sampled_from(list(Severity)), iteration=count, locations=st.lists(location, max_size=2),
              evidence=evidence, summary=text),
    st.builds(IncidentResolved, incident_id=ids, iteration=count, reason=text),
    st.builds(ProbeResult, probe_id=ids, rank=i32, duration_s=duration, reference_s=st.floats(1e-9, DURATION_MAX_S)),
    st.builds(PlanCurrent, plan=plans()),
    st.builds(PlanProposed, plan_id=ids, incident_ids=st.lists(ids, max_size=2), strategy=text, base_epoch=i32,
              plan=plans(), current_tokens_per_s=st.floats(0, 1e15), predicted_tokens_per_s=st.floats(0, 1e15),
              reshape_cost_s=duration, diff=st.lists(text, max_size=2)),
    st.builds(PlanDecision, plan_id=ids, approve=st.booleans(), actor=st.text(min_size=1, max_size=12), comment=text),
    st.builds(CommandAck, command_id=ids, plan_id=ids, epoch=i32, status=st.sampled_from(list(AckStatus)),
              running_epoch=i32, pause_s=duration, pause_iterations=count),
)


@st.composite
def valid_events(draw: st.DrawFn) -> bytes:
    source = draw(st.sampled_from(["rank-0", "rank-7", "remediation", "ui:alice", "analytics", "x" * 200]))
    job = draw(st.sampled_from([JOB, JOB, "j\x00\u2028'; DROP TABLE events; --", "é" * 200]))
    factory = EventFactory(job, source, first_seq=draw(st.sampled_from([0, COUNT_MAX - 10])))
    event = factory.make(draw(payloads), time_s=draw(st.one_of(st.floats(0, TIME_MAX_S), st.just(TIME_MAX_S))),
                         event_id=draw(ids))
    return encode(event)


_OUT_OF_RANGE = [2**31, 2**53 + 1, 2**63, 2**64, -1, "NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"', "[]"]


@st.composite
def invalid_records(draw: st.DrawFn) -> bytes:
    """Not an event: random bytes, a cut record, or a valid one with one number out of its range."""
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return draw(st.binary(max_size=48))
    raw = draw(valid_events())
    if choice == 1:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    doc = json.loads(readable(raw))  # a binary record's JSON form
    holder = doc if draw(st.booleans()) else doc["payload"]
    numeric = [k for k, v in holder.items() if isinstance(v, (int, float)) and not isinstance(v, bool)] or ["seq"]
    holder = holder if numeric != ["seq"] else doc
    field = draw(st.sampled_from(sorted(numeric)))
    bad = draw(st.sampled_from(_OUT_OF_RANGE))
    if field in ("time_s", "wall_s", "duration_s", "interval_s", "observed_s", "loss") and isinstance(bad, int):
        bad = "1e400" if bad > 0 else -1  # floats: the non-finite cases and a negative
    holder[field] = "@@BAD@@"
    return json.dumps(doc).replace('"@@BAD@@"', str(bad)).encode()


records = st.lists(st.one_of(valid_events(), invalid_records()), min_size=1, max_size=10)


def _topic_of(raw: bytes, index: int) -> str:
    try:
        return topics.topic_for(json.loads(header_json(raw))["kind"])
    except (ValueError, KeyError, TypeError):
        return (topics.TELEMETRY, topics.CONTROL)[index % 2]


def _is_valid(raw: bytes) -> bool:
    from collector.codec import InvalidEvent, decode

    try:
        decode(raw)
    except InvalidEvent:
        return False
    return True


def _run_path(bus: EmbeddedBus, db: Path, model: ReadModel, stream: EventStream) -> Projector:
    detector = DetectorProjection()
    projector = Projector(bus, db, GROUP, [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                          [EventLogProjection(), TelemetryProjection(), ControlProjection(), detector])
    engine = RemediationEngine(bus, EngineConfig(job=JOB), PlannerModel.uniform(4))
    try:
        for _ in range(4):
            projector.step(timeout_s=0.01)
            detector.flush_outbox(projector.conn, bus)
            engine.poll_once(timeout_s=0.01)
            for d in stream.poll(timeout_s=0.01):
                model.apply(d.event)
    finally:
        engine.close()
    return projector


def _read_model_view(model: ReadModel) -> tuple:
    jobs = {name: (j.last_iteration, j.ranks.num_ranks, len(j.ranks), len(j.predictions), len(j.marks),
                   len(j.health), len(j.layout)) for name, j in model.jobs.items()}
    incidents = {i: (len(v.updates), v.resolved is not None) for i, v in model.incidents.items()}
    plans = {p: (len(v.decisions), len(v.acks)) for p, v in model.plans.items()}
    return jobs, incidents, plans


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(records)
def test_any_log_reaches_the_console_with_each_valid_event_once_and_each_bad_record_dead_lettered(log: list[bytes]):
    with tempfile.TemporaryDirectory() as tmp:
        bus = EmbeddedBus(Path(tmp) / "bus.sqlite")
        messages = [RawMessage(_topic_of(raw, i), b"k", raw) for i, raw in enumerate(log)]
        bus.publish_raw(messages)
        bus.publish_raw(messages)  # republished as is: duplicates, and a second copy of every bad record
        model = ReadModel()
        stream = EventStream(bus, "console", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                             on_assign=lambda ps: {tp: 0 for tp in ps})
        projector = _run_path(bus, Path(tmp) / "a.duckdb", model, stream)
        try:
            valid: dict[str, bytes] = {}
            for raw in log:
                if _is_valid(raw):
                    valid.setdefault(json.loads(header_json(raw))["id"], raw)
            rows = dict(projector.conn.execute("SELECT id, count(*) FROM events GROUP BY id").fetchall())
            for event_id in valid:
                assert rows.get(event_id) == 1, f"valid event {event_id!r} has {rows.get(event_id)} rows"
            extra = {i for i in rows if i not in valid}
            outputs = projector.conn.execute("SELECT count(*) FROM events WHERE source IN ('analytics', 'remediation') "
                                             "AND id IN (SELECT unnest(?))", [sorted(extra)]).fetchone()
            assert outputs is not None and outputs[0] == len(extra), "rows that are neither a valid input nor a consumer's own output"
            assert all(n == 1 for n in rows.values())

            letters = EventStream(bus, "dlq-reader", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps})
            mine = [d.event.payload for d in letters.poll(timeout_s=0.05)
                    if isinstance(d.event.payload, DeadLetter) and d.event.payload.group == GROUP]
            letters.close()
            bad_positions = {(m.topic, offset) for offset, m in _offsets(bus, messages) if not _is_valid(m.value)}
            assert {(d.topic, d.offset) for d in mine} == bad_positions
            assert len(mine) == len(bad_positions) and all(d.reason for d in mine)

            before = _read_model_view(model)
            stream.seek_to_beginning()  # the console folds the whole log again: nothing changes
            for d in stream.poll(timeout_s=0.05):
                model.apply(d.event)
            assert _read_model_view(model) == before
        finally:
            stream.close()
            projector.close()
            bus.close()


def _offsets(bus: EmbeddedBus, messages: list[RawMessage]) -> list[tuple[int, RawMessage]]:
    """Where each published message landed: the embedded log numbers each topic's records from 0."""
    seen: dict[str, int] = {}
    out = []
    for m in messages + messages:
        out.append((seen.get(m.topic, 0), m))
        seen[m.topic] = seen.get(m.topic, 0) + 1
    return out


def test_a_dead_letter_of_a_record_at_the_bus_limit_fits_the_bus_and_keeps_a_digest():
    """An undecodable record just under 1 MB: its dead letter would be ~1.3 MB in base64, so it keeps
    a prefix, the length and the SHA-256, re-encodes, and the consumer moves past it."""
    import base64
    import hashlib

    with tempfile.TemporaryDirectory() as tmp:
        bus = EmbeddedBus(Path(tmp) / "bus.sqlite")
        raw = b"\xff" + b"x" * (MAX_EVENT_BYTES - 1)
        bus.publish_raw([RawMessage(topics.TELEMETRY, b"k", raw)])
        stream = EventStream(bus, GROUP, [topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps})
        assert stream.poll(timeout_s=0.05) == [] and stream.counters.dead_letters == 1
        stream.close()
        letters = EventStream(bus, "r", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps})
        (d,) = letters.poll(timeout_s=0.05)
        letters.close()
        bus.close()
    letter = payload_as(d.event, DeadLetter)
    assert len(encode(d.event)) < MAX_EVENT_BYTES // 4
    assert letter.raw_length == len(raw) and letter.raw_sha256 == hashlib.sha256(raw).hexdigest()
    assert raw.startswith(base64.b64decode(letter.raw_b64)) and "not UTF-8" in letter.reason


def test_a_record_with_a_huge_field_name_gets_a_clipped_reason():
    """A reason quotes field names from the input; a 600 KB name must not make the letter too large."""
    from collector.codec import dead_letter

    doc = json.loads(encode(EventFactory(JOB, "rank-0").make(Heartbeat(rank=0, epoch=0, iteration=0, interval_s=1))))
    doc["payload"]["k" * 600_000] = 1
    raw = json.dumps(doc).encode()
    from collector.codec import InvalidEvent, decode

    try:
        decode(raw)
    except InvalidEvent as exc:
        letter = dead_letter(topics.TELEMETRY, 0, 0, GROUP, exc.reason, raw)
    else:
        raise AssertionError("an unknown field was accepted")
    event = EventFactory(JOB, "consumer:x").make(letter, event_id=uuid.uuid4().hex)
    assert len(encode(event)) < MAX_EVENT_BYTES and letter.reason.endswith("…")


def test_reports_that_would_blow_up_the_detectors_arrays_are_kept_from_it_and_the_next_ones_are_judged():
    """Two schema-valid reports of one iteration, micro-batches 0 and 2^23 of one replica: the frame
    would hold 2^23 micro-batch columns per stage. The second is kept from the detector (counted),
    a rank of 2^31 - 1 likewise, and an ordinary report after them still reaches it."""
    import duckdb

    from collector.stream import Delivery

    def report(rank: int, microbatch: int, iteration: int = 0):
        return EventFactory(JOB, f"rank-{rank}").make(RankIteration(
            epoch=0, iteration=iteration, rank=rank, coords=Coords(tp=0, pp=0, dp=0), wall_s=1.0,
            chunks=[Chunk(kind="F", microbatch=microbatch, tokens=8, start_s=0.0, duration_s=0.5)]))

    events = [report(0, 0), report(1, 2**23), report(INT32_MAX, 0), report(0, 1, iteration=1)]
    projection = DetectorProjection()
    with duckdb.connect() as conn:
        projection.create(conn)
        projection.apply(conn, [Delivery(topics.TELEMETRY, 0, i, e) for i, e in enumerate(events)])
    assert projection.skipped == 2 and projection.failed == 0
    assert projection.detectors[JOB].fail_stop.top_iteration(0) == 1  # the last report was folded
