"""Property-based tests of the decoder: whatever bytes arrive, it returns an event or raises
InvalidEvent with a reason — never anything else — and valid events survive a round trip."""

from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from collector.codec import MAX_EVENT_BYTES, InvalidEvent, decode, encode
from collector.events import (
    EVENT_TYPES, Chunk, ChunkKind, Coords, EventFactory, Heartbeat, RankIteration, new_event_id,
)

FACTORY = EventFactory("job-prop", "rank-0")
VALID = encode(FACTORY.make(Heartbeat(rank=1, epoch=2, iteration=3, interval_s=1.0)))

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)


def decodes_or_explains(raw: bytes) -> None:
    try:
        decode(raw)
    except InvalidEvent as exc:
        assert exc.reason and "\n" not in exc.reason


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_random_bytes_never_escape_as_anything_but_invalid_event(raw):
    decodes_or_explains(raw)


@settings(max_examples=400)
@given(st.integers(min_value=0, max_value=len(VALID)), st.binary(min_size=1, max_size=8))
def test_truncated_or_corrupted_valid_records_are_rejected_cleanly(cut, noise):
    decodes_or_explains(VALID[:cut])
    decodes_or_explains(VALID[:cut] + noise + VALID[cut:])


@settings(max_examples=400)
@given(st.sampled_from(["id", "kind", "schema_version", "job", "source", "seq", "time_s", "payload"]), json_values)
def test_random_envelope_field_values_are_validated(field, value):
    doc = json.loads(VALID)
    doc[field] = value
    decodes_or_explains(json.dumps(doc).encode())


@settings(max_examples=300)
@given(st.sampled_from(["rank", "epoch", "iteration", "interval_s", "extra"]), json_values)
def test_random_payload_field_values_are_validated(field, value):
    doc = json.loads(VALID)
    doc["payload"][field] = value
    decodes_or_explains(json.dumps(doc).encode())


chunks = st.builds(
    Chunk,
    kind=st.sampled_from(list(ChunkKind)),
    microbatch=st.integers(0, 64),
    virtual_stage=st.integers(0, 4),
    tokens=st.integers(0, 1 << 20),
    seq_lens=st.one_of(st.none(), st.lists(st.integers(1, 1 << 17), max_size=16)),
    start_s=st.floats(0, 1e4, allow_nan=False),
    duration_s=st.floats(0, 1e3, allow_nan=False),
)


@settings(max_examples=200)
@given(st.lists(chunks, max_size=24), st.integers(0, 1 << 30), st.floats(0, 1e4, allow_nan=False))
def test_valid_telemetry_round_trips_exactly(chunk_list, iteration, wall_s):
    event = FACTORY.make(
        RankIteration(epoch=0, iteration=iteration, rank=5, coords=Coords(tp=1, pp=2, dp=3), wall_s=wall_s, chunks=chunk_list)
    )
    assert decode(encode(event)) == event


def test_an_oversized_record_is_rejected_with_its_size():
    raw = VALID[:-1] + b" " * (MAX_EVENT_BYTES + 1) + b"}"
    try:
        decode(raw)
    except InvalidEvent as exc:
        assert "exceeds" in exc.reason and f"{MAX_EVENT_BYTES:,}" in exc.reason
    else:
        raise AssertionError("an oversized record was accepted")


def test_an_unknown_schema_version_names_the_versions_this_build_reads():
    doc = json.loads(VALID)
    doc["schema_version"] = 7
    try:
        decode(json.dumps(doc).encode())
    except InvalidEvent as exc:
        assert "unknown schema version 7 for telemetry.heartbeat" in exc.reason
        assert "reads 1–1" in exc.reason
    else:
        raise AssertionError("schema version 7 was accepted")


def test_a_factory_makes_after_its_first_event_what_validation_would_and_still_refuses_a_bad_source() -> None:
    """A factory validates the first envelope of a payload type, then builds the next ones without
    pydantic: they equal validated envelopes field for field, and what it cannot vouch for (a
    given id or time, a job or source changed since) goes through validation again."""
    factory = EventFactory("job-f", "rank-0")
    beat = Heartbeat(rank=0, epoch=0, iteration=1, interval_s=1.0)
    first, second = factory.make(beat), factory.make(beat)
    assert (first.seq, second.seq) == (0, 1) and first.id != second.id and len(second.id) == 32
    rebuilt = EVENT_TYPES[beat.KIND](**{k: getattr(second, k) for k in second.model_fields_set})
    assert rebuilt == second and rebuilt.model_fields_set == second.model_fields_set
    assert decode(encode(second)) == second
    assert factory.make(beat, time_s=5.0).time_s == 5.0
    with pytest.raises(ValidationError):
        factory.make(beat, time_s=-1.0)
    factory.source = ""
    with pytest.raises(ValidationError):
        factory.make(beat)
    with pytest.raises(ValidationError):
        EventFactory("job-f", "x" * 201).make(beat)
    assert all(uuid.UUID(hex=new_event_id()).version == 4 for _ in range(100))
