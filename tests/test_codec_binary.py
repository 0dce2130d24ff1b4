"""The binary records of the packed-array payloads (replica summaries, liveness batches): they round
trip, are smaller than their JSON, JSON records of them (the logs written before) still decode, and
a corrupt one is refused with a one-line reason and dead-lettered on both buses, never half-read."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analytics.sharding.replica_summary import LIVENESS_ARRAYS, pack, unpack
from collector import topics
from collector.bus import RawMessage
from collector.codec import BINARY_MAGIC, InvalidEvent, decode, encode, encode_json, readable
from collector.events import DeadLetter, EventFactory, Heartbeat, LivenessBatch, ReplicaSummary
from collector.stream import EventStream
from collector.trace import EventHeader, TraceReader, TraceWriter
from tests.fixtures.payloads import payload_as

FACTORY = EventFactory("job-bin", "shard:s0")
ROWS = np.array([[0, 5, 0, 3, 10.5, 0.0], [1, 6, 0, 4, 11.0, 2.0], [1, 7, 0, 4, 11.25, 2.0]])


def liveness_event():
    layout, blob = pack(dict(zip(LIVENESS_ARRAYS, ROWS.T)))
    return FACTORY.make(LivenessBatch(rows=len(ROWS), shard="s0", layout=layout, blob=blob), time_s=12.0)


def summary_event():
    rng = np.random.default_rng(7)
    arrays: dict[str, np.ndarray] = {"rank": np.arange(128), "x": rng.normal(size=128), "x_f": rng.normal(size=128).astype(np.float32),
              "u_class": rng.integers(0, 4, size=32), "u_own": rng.random(32), "l_waits": np.ones(30)}
    arrays["x"][3] = np.nan  # "not judged" travels as it is
    layout, blob = pack(arrays)
    return FACTORY.make(ReplicaSummary(
        epoch=0, iteration=9, replica=2, ranks=128, inferred=False, explained_s=1.5, pipeline_s=1.75, dp_wait_s=0.1,
        tokens=4096, wall_s=2.0, class_keys='[["F", 0, 4]]', layout=layout, blob=blob))


LIVE = encode(liveness_event())


def test_packed_payloads_travel_binary_round_trip_and_are_smaller_than_their_json() -> None:
    for event in (liveness_event(), summary_event()):
        raw, as_json = encode(event), encode_json(event)
        assert raw.startswith(BINARY_MAGIC) and as_json.startswith(b"{")
        assert decode(raw) == event == decode(as_json)
        assert len(raw) < len(as_json)
        assert readable(raw) == as_json
    summary = payload_as(decode(encode(summary_event())), ReplicaSummary)
    arrays = unpack(summary.layout, summary.blob)
    assert np.isnan(arrays["x"][3]) and arrays["rank"].tolist() == list(range(128))
    heartbeat = FACTORY.make(Heartbeat(rank=1, epoch=0, iteration=2, interval_s=1.0))
    assert encode(heartbeat) == encode_json(heartbeat)  # every other kind stays JSON


def test_a_json_record_written_before_binary_records_still_decodes() -> None:
    """The first sharded builds wrote the arrays as a standard-base64 string inside the JSON (``+``
    and ``/``, not the URL-safe alphabet); such a log must decode to the same arrays."""
    blob = bytes(range(256)) * 3  # 6 arrays of 16 doubles, every byte value: the base64 holds '+' and '/'
    doc = json.loads(encode_json(liveness_event()))
    doc["payload"].update(rows=16, layout=[[name, "<f8", 16] for name in LIVENESS_ARRAYS],
                          blob=base64.b64encode(blob).decode("ascii"))
    assert "+" in doc["payload"]["blob"] and "/" in doc["payload"]["blob"]
    event = decode(json.dumps(doc).encode())
    assert payload_as(event, LivenessBatch).blob == blob
    assert json.loads(encode_json(event))["payload"]["blob"] == doc["payload"]["blob"]  # written back the same way


@pytest.mark.parametrize(("raw", "reason"), [
    (LIVE[:-1], "blob holds 95 bytes but its layout names 96"),
    (LIVE + b"\x00", "blob holds 97 bytes but its layout names 96"),
    (LIVE[:6], "shorter than its 8-byte prefix"),
    (LIVE[:40], "header runs past its 40 bytes: truncated"),
    (LIVE[:3] + b"\x07" + LIVE[4:], "wire format 7 (this build reads 1 and 2)"),
    (LIVE[:8] + b"\xfe" + LIVE[9:], "binary record's header is not UTF-8"),
    (LIVE[:8] + b"[" + LIVE[9:], "invalid event"),
], ids=["cut", "padded", "prefix", "header", "format", "utf8", "json"])  # stable ids: LIVE holds a random event id
def test_a_corrupt_binary_record_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason.replace("(", r"\(").replace(")", r"\)")) as err:
        decode(raw)
    assert "\n" not in err.value.reason


def test_a_binary_record_of_a_kind_that_is_not_packed_arrays_is_refused() -> None:
    head = encode_json(FACTORY.make(Heartbeat(rank=1, epoch=0, iteration=2, interval_s=1.0)))
    raw = LIVE[:4] + len(head).to_bytes(4, "little") + head + b"\x00" * 8
    with pytest.raises(InvalidEvent, match="only payloads of packed arrays"):
        decode(raw)


def test_a_binary_header_that_carries_a_blob_of_its_own_is_refused() -> None:
    """The arrays follow the header; a header with a blob too would leave two candidates."""
    event = liveness_event()
    head = encode_json(event)
    raw = LIVE[:4] + len(head).to_bytes(4, "little") + head + event.payload.blob
    with pytest.raises(InvalidEvent, match="header must leave blob empty"):
        decode(raw)


def test_a_layout_with_a_negative_length_is_refused() -> None:
    """numpy reads count -1 as "the rest of the buffer": a negative length must never reach unpack."""
    doc = json.loads(encode_json(liveness_event()))
    doc["payload"]["layout"][0][2] = -1
    doc["payload"]["layout"][1][2] = 7  # -4 + 28 bytes: the total still matches the blob's 96 bytes
    with pytest.raises(InvalidEvent, match="'kind' has length -1, outside 0..1048576"):
        decode(json.dumps(doc).encode())


@settings(max_examples=300)
@given(st.integers(min_value=0, max_value=len(LIVE)), st.binary(min_size=1, max_size=8))
def test_truncated_or_corrupted_binary_records_never_escape_as_anything_but_invalid_event(cut, noise):
    for raw in (LIVE[:cut], LIVE[:cut] + noise + LIVE[cut:], LIVE[:cut] + noise + LIVE[cut + len(noise):]):
        try:
            decode(raw)
        except InvalidEvent as exc:
            assert exc.reason and "\n" not in exc.reason


def _read_all(bus, group: str, topic: str, want: int) -> tuple[EventStream, list]:
    stream = EventStream(bus, group, [topic], on_assign=lambda ps: {tp: 0 for tp in ps})
    got: list = []
    for _ in range(40):
        got += stream.poll(timeout_s=0.5)
        if len(got) >= want:
            break
    return stream, got


def test_a_corrupt_binary_record_goes_to_the_dead_letter_topic_and_the_consumer_carries_on(bus_factory) -> None:
    bus = bus_factory()
    good = summary_event()
    corrupt = LIVE[:-5]  # cut short: the blob is shorter than its layout
    bus.publish_raw([RawMessage(topics.ANALYTICS, b"job-bin/shard:s0", corrupt)])
    bus.publish([good])
    stream, got = _read_all(bus, "merge", topics.ANALYTICS, 1)
    stream.close()
    assert [d.event for d in got] == [good] and stream.counters.dead_letters == 1
    letters, found = _read_all(bus, "reader", topics.DEADLETTER, 1)
    letters.close()
    (letter,) = [d.event.payload for d in found if isinstance(d.event.payload, DeadLetter)]
    assert letter.topic == topics.ANALYTICS and base64.b64decode(letter.raw_b64) == corrupt
    assert "blob holds 91 bytes but its layout names 96" in letter.reason


def test_a_trace_keeps_binary_records_as_their_json(tmp_path) -> None:
    """A trace's value column is UTF-8 JSON that any tool reads: a recorder that writes the bus's
    binary bytes stores their JSON form, which decodes to the same event."""
    event = summary_event()
    raw = encode(event)
    header = EventHeader.parse(raw)
    assert header is not None and header.kind == "analytics.replica_summary" and header.id == event.id
    with TraceWriter(tmp_path / "t.parquet") as w:
        w.write_encoded(header, raw)
        w.write([liveness_event()])
    (rec_summary, rec_liveness) = list(TraceReader(tmp_path / "t.parquet").records())
    assert rec_summary.value == encode_json(event) and decode(rec_summary.value) == event
    assert rec_liveness.value.startswith(b"{") and decode(rec_liveness.value).payload == liveness_event().payload
    with TraceWriter(tmp_path / "bad.parquet") as w, pytest.raises(InvalidEvent, match="blob holds"):
        w.write_encoded(header, raw[:-1])
