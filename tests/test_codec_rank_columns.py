"""Binary rank reports (telemetry.iteration schema 5): their columns round trip as arrays, the JSON
forms of every schema and the binary records with a JSON header (wire format 1) still decode, and
any byte string in a binary report's fixed header (wire format 2) or body is either a report the
JSON form would accept too or refused with one line naming the field or column, and dead-lettered
while the consumer carries on."""

from __future__ import annotations

import base64
import json
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector import topics
from collector.bus import RawMessage
from collector.codec import (
    BINARY_FORMAT, BINARY_MAGIC, InvalidEvent, binary_record, decode, encode, encode_json, header_json, readable,
)
from collector.events import (
    COUNT_MAX, DURATION_MAX_S, TOKENS_MAX, Chunk, ChunkKind, CommOp, CommTable, CommWait, Coords, DeadLetter,
    EventFactory, RankIteration,
)
from collector.rank_columns import ArrayColumn, SeqLensColumn
from collector.rank_header import FIXED, RANK_FORMAT
from collector.stream import EventStream
from tests.fixtures.payloads import payload_as

FACTORY = EventFactory("job-rc", "rank-3")


def report(with_comm: bool = True) -> RankIteration:
    """Every kind of value a report holds: unknown token counts and sequence lengths, collectives
    without a peer or a byte count, a fused timer, a group."""
    chunks = [Chunk(kind=ChunkKind.FORWARD, microbatch=0, tokens=700, seq_lens=[300, 400], start_s=0.0, duration_s=0.01),
              Chunk(kind=ChunkKind.BACKWARD, microbatch=0, virtual_stage=1, tokens=None, seq_lens=None, start_s=0.02,
                    duration_s=0.03),
              Chunk(kind=ChunkKind.WEIGHT, microbatch=1, tokens=5, seq_lens=[5], start_s=0.05, duration_s=200_000.0)]
    comm = [CommWait(op=CommOp.PP_SENDRECV, peer=7, microbatch=0, bytes=4096, start_s=0.011, duration_s=0.002,
                     includes_wait=True, group="pp"),
            CommWait(op=CommOp.DP_ALLREDUCE, peer=None, microbatch=None, bytes=None, start_s=0.09, duration_s=0.1)]
    return RankIteration(epoch=2, iteration=9, rank=3, node=0, coords=Coords(tp=1, pp=1, dp=0), wall_s=0.2,
                         chunks=chunks, comm=comm if with_comm else [])


EVENT = FACTORY.make(report())
RAW = encode(EVENT)
HEAD_LEN = struct.unpack_from("<I", RAW, 4)[0]
BODY = 8 + HEAD_LEN  # where the blob starts
RAW_V1 = binary_record(header_json(RAW), RAW[BODY:])  # the same report with a JSON header (wire format 1)


def test_a_rank_report_travels_as_binary_columns_and_reads_back_as_arrays_equal_to_its_json() -> None:
    assert EVENT.schema_version == 5 and RAW.startswith(BINARY_MAGIC) and RAW[3] == RANK_FORMAT
    got = decode(RAW)
    assert got == EVENT == decode(encode_json(EVENT)) == decode(RAW_V1)
    assert RAW_V1[3] == BINARY_FORMAT and len(RAW) < len(RAW_V1)
    assert readable(RAW) == encode_json(EVENT) and json.loads(header_json(RAW))["id"] == EVENT.id
    table = payload_as(got, RankIteration).chunk_table
    assert isinstance(table.duration_s, ArrayColumn) and isinstance(table.seq_lens, SeqLensColumn)
    assert table.duration_s.array.dtype == np.float64 and table.duration_s.array.tolist() == [0.01, 0.03, 200_000.0]
    assert table.tokens == [700, None, 5] and table.seq_lens == [[300, 400], None, [5]]
    assert table.seq_lens.flat.tolist() == [300, 400, 5] and table.seq_lens.counts.tolist() == [2, -1, 1]
    waits = payload_as(got, RankIteration).waits()
    assert waits.peer == [7, None] and waits.bytes == [4096, None] and waits.group == ["pp", None]
    assert waits.includes_wait == [True, False]
    assert decode(encode(got)) == EVENT  # a decoded report publishes again unchanged
    signed = EVENT.model_copy(update={"signature": "rank:" + "0" * 128})  # the header written by model copies
    assert encode(signed)[3] == BINARY_FORMAT and decode(encode(signed)) == signed  # the fixed header has no signature
    plain = FACTORY.make(report(with_comm=False))
    assert decode(encode(plain)) == plain


def test_the_json_form_of_each_schema_still_decodes_and_a_json_record_naming_columns_is_refused() -> None:
    body = json.loads(encode_json(EVENT))
    for version in (2, 3, 4, 5):
        body["schema_version"] = version
        assert decode(json.dumps(body).encode()).payload == EVENT.payload
    body["payload"]["columns"] = json.loads(header_json(RAW))["payload"]["columns"]
    with pytest.raises(InvalidEvent, match="only a binary record's header carries"):
        decode(json.dumps(body).encode())


def _with_head(change) -> bytes:
    """The report with a JSON header (wire format 1) changed by ``change``."""
    head = json.loads(header_json(RAW))
    change(head)
    return binary_record(json.dumps(head).encode(), RAW[BODY:])


def _with_value(fmt: str, at: int, value) -> bytes:
    body = bytearray(RAW[BODY:])
    struct.pack_into(fmt, body, at, value)
    return RAW[:BODY] + bytes(body)


# the blob of EVENT: f8 [3 start, 3 duration, 2 comm start, 2 comm duration], i8 [3 tokens, 2 bytes],
# i4 [3 microbatch, 3 virtual stage, 3 seq lens, 3 counts, 2 peers, 2 comm microbatch], u1 [2 ops, 2 waits, 2 groups]
F8, I8, I4, U1 = 0, 80, 120, 184


@pytest.mark.parametrize(("raw", "reason"), [
    (RAW[:-1], "columns hold 189 bytes but its header names 190"),
    (RAW + b"\x00", "columns hold 191 bytes but its header names 190"),
    (_with_value("<d", F8 + 8 * 4, float("nan")), "chunk duration_s[1] = nan is outside 0 … 1e+06"),
    (_with_value("<d", F8 + 8 * 8, -1.0), "comm duration_s[0] = -1.0 is outside 0 … 1e+06"),
    (_with_value("<d", F8, DURATION_MAX_S * 2), "chunk start_s[0] = 2000000.0 is outside"),
    (_with_value("<i", I4 + 4 * 1, -3), "chunk microbatch[1] = -3 is below 0"),
    (_with_value("<i", I4 + 4 * 7, -2), "seq_lens[1] = -2 is below 0"),
    (_with_value("<i", I4 + 4 * 9, 1), "sequence counts sum to 2, not the header's 3"),
    (_with_value("<i", I4 + 4 * 12, -5), "comm peer[0] = -5 is below -1 (-1: unknown)"),
    (_with_value("<q", I8 + 8 * 2, 2**41), "chunk tokens[2] = 2199023255552 is above 1,099,511,627,776"),
    (_with_value("<q", I8 + 8 * 4, -2), "comm bytes[1] = -2 is below -1 (-1: unknown)"),
    (_with_value("<q", I8 + 8 * 3, 2**53 + 1), "comm bytes[0] = 9007199254740993 is above 9,007,199,254,740,992"),
    (_with_value("<i", I4 + 4 * 15, -2), "comm microbatch[1] = -2 is below -1 (-1: unknown)"),
    (_with_value("<B", U1, 200), "comm op code[0] = 200 is above 8"),
    (_with_value("<B", U1 + 2, 2), "includes_wait holds 2, not 0 or 1"),
    (_with_value("<B", U1 + 4, 9), "comm group codes go past 4"),
    (_with_head(lambda h: h.update(schema_version=4)), "rank reports travel binary from schema 5"),
    (_with_head(lambda h: h["payload"].pop("columns")), "without payload.columns"),
    (_with_head(lambda h: h["payload"]["columns"].update(seq_lens=-1)), "columns.seq_lens"),
    (_with_head(lambda h: h["payload"]["chunk_table"].update(kind="F", microbatch=[0], virtual_stage=[0], tokens=[1],
                                                             seq_lens=[None], start_s=[0], duration_s=[0])),
     "header carries table rows"),
], ids=["cut", "padded", "nan", "negative-float", "too-long", "negative-int", "negative-len", "counts", "peer",
        "tokens", "bytes-minus-2", "bytes-too-many", "comm-microbatch-minus-2", "op", "wait-flag", "group", "schema-4",
        "no-columns", "bad-columns", "rows-in-header"])
def test_a_corrupt_binary_rank_report_is_refused_naming_the_column_and_row(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=re.escape(reason)) as err:
        decode(raw)
    assert "\n" not in err.value.reason


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=190, max_size=190), st.integers(0, 190), st.binary(max_size=16))
def test_any_bytes_in_a_binary_report_are_refused_or_read_as_a_report_its_json_form_accepts(body, cut, noise):
    """Random columns of the right length, and the real ones cut or padded with noise: whatever
    the binary reader accepts, the JSON reader (pydantic's range checks) accepts too."""
    real = RAW[BODY:]
    for blob in (body, real[:cut] + noise + real[cut + len(noise):], real[:cut] + noise):
        try:
            event = decode(RAW[:BODY] + blob)
        except InvalidEvent as exc:
            assert exc.reason and "\n" not in exc.reason
            continue
        assert decode(encode_json(event)) == event


def _with_field(fmt: str, at: int, value) -> bytes:
    """The report (wire format 2) with one value of its fixed header changed (``at``: from the
    header's start)."""
    raw = bytearray(RAW)
    struct.pack_into(fmt, raw, 8 + at, value)
    return bytes(raw)


def _with_fixed_head(head: bytes) -> bytes:
    return RAW[:4] + len(head).to_bytes(4, "little") + head + RAW[BODY:]


HEAD = RAW[8:BODY]
STRINGS = FIXED.size  # where the id starts in the header; then the job (6 bytes), the source (6), the kinds (3)


@pytest.mark.parametrize(("raw", "reason"), [
    (_with_field("<I", 0, 4), "schema_version 4 does not travel with this header (this build reads 5 here)"),
    (_with_field("<q", 4, -1), "seq = -1 is outside 0 … 9,007,199,254,740,992"),
    (_with_field("<d", 12, float("nan")), "time_s = nan is outside 0 … 1e+10"),
    (_with_field("<d", 12, -0.5), "time_s = -0.5 is outside"),
    (_with_field("<i", 20, -1), "epoch = -1 is below 0"),
    (_with_field("<q", 24, 2**53 + 1), "iteration = 9007199254740993 is outside"),
    (_with_field("<i", 32, -7), "rank = -7 is below 0"),
    (_with_field("<i", 36, -2), "node = -2 is below -1 (-1: unknown)"),
    (_with_field("<i", 48, -1), "coords.dp = -1 is below 0"),
    (_with_field("<d", 56, float("inf")), "wall_s = inf is outside 0 … 1e+06"),
    (_with_field("<I", 64, 2**16 + 1), "chunks = 65,537 is above 65,536"),
    (_with_field("<I", 72, 2**20 + 1), "communications = 1,048,577 is above 1,048,576"),
    (_with_field("<B", 76, 4), "flags = 4 name columns this build does not know"),
    (_with_field("<H", 79, 7), "strings (32 + 7 + 6 bytes) and 3 chunk kinds make"),
    (_with_fixed_head(HEAD[:-1]), "truncated or corrupt"),
    (_with_fixed_head(HEAD[:-1] + b"X"), "chunk kinds hold a letter other than F, B or W"),
    (_with_fixed_head(HEAD[:STRINGS] + b"\xff" + HEAD[STRINGS + 1:]), "id, job or source is not UTF-8"),
    (_with_fixed_head(HEAD[:77] + struct.pack("<H", 0) + HEAD[79:STRINGS] + HEAD[STRINGS + 32:]),
     "id of 0 characters is outside 1 … 64"),
    (RAW[:8 + 40], "header runs past"),
    (_with_fixed_head(HEAD[:50]), "header of 50 bytes is shorter than its 83-byte fixed part"),
    (_with_field("<I", 68, 4), "columns hold 190 bytes but its header names 194"),
    (_with_field("<B", 76, 1), "columns hold 190 bytes but its header names 188"),
], ids=["schema", "seq", "time-nan", "time-negative", "epoch", "iteration", "rank", "node", "dp", "wall-inf", "chunks",
        "waits", "flags", "string-lengths", "cut", "kind-letter", "utf8", "empty-id", "prefix-runs-past", "short",
        "seq-lens", "flags-vs-blob"])
def test_a_corrupt_fixed_rank_header_is_refused_naming_the_field_and_its_bound(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=re.escape(reason)) as err:
        decode(raw)
    assert "\n" not in err.value.reason
    assert header_json(raw) == b"" or json.loads(header_json(raw))["kind"] == "telemetry.iteration"  # never raises


def test_a_fixed_header_reads_the_same_report_as_its_json_header_and_its_json() -> None:
    """Every field the fixed header carries, at its bounds: the same event from wire format 2,
    from format 1 (the JSON header written before) and from JSON."""
    edge = RankIteration(epoch=2**31 - 1, iteration=COUNT_MAX, rank=0, node=None,
                         coords=Coords(tp=2**31 - 1, pp=0, dp=5, cp=3), wall_s=DURATION_MAX_S,
                         chunks=[Chunk(kind=ChunkKind.WEIGHT, microbatch=0, start_s=0.0, duration_s=0.0)])
    for event in (EventFactory("j" * 200, "é" * 200, first_seq=COUNT_MAX).make(edge, time_s=1e10, event_id="x" * 64),
                  EventFactory("job", "rank-0").make(edge, time_s=0.0, event_id="☃")):
        raw = encode(event)
        assert raw[3] == RANK_FORMAT
        head = struct.unpack_from("<I", raw, 4)[0]
        v1 = binary_record(header_json(raw), raw[8 + head:])
        assert decode(raw) == decode(v1) == decode(encode_json(event)) == event
        assert payload_as(decode(raw), RankIteration).node is None and decode(raw).model_fields_set >= {"id", "payload"}


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=FIXED.size, max_size=FIXED.size), st.integers(0, len(HEAD)), st.binary(max_size=16))
def test_any_bytes_in_a_fixed_rank_header_are_refused_or_read_as_a_report_its_json_form_accepts(fixed, cut, noise):
    """Random fixed parts before the real strings and kinds, and the real header cut or overwritten
    with noise: whatever the binary reader accepts, the JSON reader (pydantic's checks) accepts too,
    as the same event; everything else is an InvalidEvent with one line."""
    for head in (fixed + HEAD[FIXED.size:], HEAD[:cut] + noise + HEAD[cut + len(noise):], HEAD[:cut] + noise):
        raw = _with_fixed_head(head)
        try:
            event = decode(raw)
        except InvalidEvent as exc:
            assert exc.reason and "\n" not in exc.reason
            assert header_json(raw) == b"" or json.loads(header_json(raw))["kind"] == "telemetry.iteration"
            continue
        assert decode(encode_json(event)) == event == decode(encode(event))
        assert json.loads(header_json(raw))["id"] == event.id


_I32 = st.sampled_from((-(2**31), -2, -1, 0, 1, 2**31 - 1)) | st.integers(-(2**31), 2**31 - 1)
_I64 = st.sampled_from((-(2**63), -1, 0, COUNT_MAX, COUNT_MAX + 1, 2**63 - 1)) | st.integers(-(2**63), 2**63 - 1)
_F8 = st.sampled_from((-0.0, 0.0, -1e-300, DURATION_MAX_S, 1e10, 1e10 * (1 + 2**-52), float("nan"), float("inf"))) \
    | st.floats(allow_nan=True, allow_infinity=True)
_TEXT = st.text(max_size=3) | st.text(min_size=60, max_size=210)
# the header's fields, each in range, and what any one of them may be changed to
_FIELDS = {"schema": (st.just(5), st.integers(0, 2**32 - 1)), "seq": (st.integers(0, COUNT_MAX), _I64),
           "time_s": (st.floats(0, 1e10), _F8), "epoch": (st.integers(0, 2**31 - 1), _I32),
           "iteration": (st.integers(0, COUNT_MAX), _I64), "rank": (st.integers(0, 2**31 - 1), _I32),
           "node": (st.integers(-1, 2**31 - 1), _I32), "tp": (st.integers(0, 9), _I32), "pp": (st.integers(0, 9), _I32),
           "dp": (st.integers(0, 9), _I32), "cp": (st.integers(0, 2**31 - 1), _I32),
           "wall_s": (st.floats(0, DURATION_MAX_S), _F8), "id": (st.text(min_size=1, max_size=64), _TEXT),
           "job": (st.text(min_size=1, max_size=200), _TEXT), "source": (st.text(min_size=1, max_size=200), _TEXT)}


@st.composite
def _header_fields(draw) -> dict:
    fields = {name: draw(valid) for name, (valid, _) in _FIELDS.items()}
    changed = draw(st.none() | st.sampled_from(sorted(_FIELDS)))
    if changed is not None:
        fields[changed] = draw(_FIELDS[changed][1])
    return fields


@settings(max_examples=500, deadline=None)
@given(_header_fields())
def test_a_fixed_header_accepts_exactly_what_its_json_header_accepts_as_the_same_report(f: dict) -> None:
    """Every field of the fixed header in range, or one of them at or around its bounds (any
    string, any number of its type): wire format 2 accepts a header exactly when pydantic accepts
    the same fields as format 1's JSON header (node -1: unknown, null in JSON), as the same event."""
    texts = [f[name].encode() for name in ("id", "job", "source")]
    fixed = FIXED.pack(f["schema"], f["seq"], f["time_s"], f["epoch"], f["iteration"], f["rank"], f["node"], f["tp"],
                       f["pp"], f["dp"], f["cp"], f["wall_s"], 3, 3, 2, 3, *map(len, texts))
    raw = _with_fixed_head(fixed + b"".join(texts) + b"FBW")
    doc = json.loads(header_json(RAW))
    doc.update(id=f["id"], schema_version=f["schema"], job=f["job"], source=f["source"], seq=f["seq"], time_s=f["time_s"])
    doc["payload"].update(epoch=f["epoch"], iteration=f["iteration"], rank=f["rank"], wall_s=f["wall_s"],
                          node=None if f["node"] == -1 else f["node"], coords={k: f[k] for k in ("tp", "pp", "dp", "cp")})
    outcomes: list = []
    for record in (raw, binary_record(json.dumps(doc).encode(), RAW[BODY:])):
        try:
            outcomes.append(decode(record))
        except InvalidEvent as exc:
            assert exc.reason and "\n" not in exc.reason
            outcomes.append(None)
    fixed_read, json_read = outcomes
    assert (fixed_read is None) == (json_read is None), (f, fixed_read, json_read)
    assert fixed_read == json_read


_INT64_EDGES = (-(2**63), -2**32 - 1, -256, -2, -1, 0, 1, 2**40 - 1, TOKENS_MAX, TOKENS_MAX + 1, COUNT_MAX,
                COUNT_MAX + 1, 2**63 - 1)


def _one_changed(values: list[int], change: tuple[int, int] | None) -> list[int]:
    if change is not None:
        values[change[0]] = change[1]
    return values


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.just(-1), st.integers(0, TOKENS_MAX)), min_size=3, max_size=3),
       st.lists(st.one_of(st.just(-1), st.integers(0, COUNT_MAX)), min_size=2, max_size=2),
       st.none() | st.tuples(st.integers(0, 4),
                             st.sampled_from(_INT64_EDGES) | st.integers(-(2**63), 2**63 - 1)))
def test_token_and_byte_counts_read_exactly_with_minus_one_unknown_and_every_other_negative_or_too_large_refused(
        tokens: list[int], nbytes: list[int], change: tuple[int, int] | None) -> None:
    """The report's int64 columns (3 token counts, 2 byte counts), in range or -1 (unknown), and
    at most one of them changed to any number: read back exactly when each is -1 or within its
    bound, refused naming the column and row otherwise, whichever test (bytes, Python ints,
    numpy) looks at them."""
    values = _one_changed(tokens + nbytes, change)
    tokens, nbytes = values[:3], values[3:]
    readable_ = (all(v == -1 or 0 <= v <= TOKENS_MAX for v in tokens)
                 and all(v == -1 or 0 <= v <= COUNT_MAX for v in nbytes))
    body = bytearray(RAW[BODY:])
    struct.pack_into("<5q", body, I8, *values)
    try:
        got = payload_as(decode(RAW[:BODY] + bytes(body)), RankIteration)
    except InvalidEvent as exc:
        assert not readable_, exc.reason
        assert re.fullmatch(r"rank report's (chunk tokens|comm bytes)\[\d\] = -?\d+ is "
                            r"(below -1 \(-1: unknown\)|above [\d,]+)", exc.reason), exc.reason
        return
    assert readable_, values
    assert got.chunk_table.tokens == [None if v == -1 else v for v in tokens]
    assert got.waits().bytes == [None if v == -1 else v for v in nbytes]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 2**31 - 1), min_size=4, max_size=4),
       st.none() | st.tuples(st.integers(0, 3), st.sampled_from((-(2**31), -256, -2)) | st.integers(-(2**31), -2)))
def test_peers_and_comm_microbatches_read_exactly_with_minus_one_unknown_and_other_negatives_refused(
        values: list[int], change: tuple[int, int] | None) -> None:
    values = _one_changed(values, change)
    body = bytearray(RAW[BODY:])
    struct.pack_into("<4i", body, I4 + 4 * 12, *values)
    try:
        got = payload_as(decode(RAW[:BODY] + bytes(body)), RankIteration)
    except InvalidEvent as exc:
        assert min(values) < -1 and re.fullmatch(r"rank report's comm (peer|microbatch)\[\d\] = -\d+ is below -1 "
                                                 r"\(-1: unknown\)", exc.reason), exc.reason
        return
    assert min(values) >= -1
    waits = got.waits()
    assert [*waits.peer, *waits.microbatch] == [None if v == -1 else v for v in values]


def test_random_bytes_after_a_rank_report_header_are_dead_lettered_and_the_consumer_carries_on(bus_factory) -> None:
    bus = bus_factory()
    corrupt = RAW[:BODY] + bytes(np.random.default_rng(3).integers(0, 256, 190, dtype=np.uint8))
    bus.publish_raw([RawMessage(topics.TELEMETRY, b"job-rc/rank-3", corrupt)])
    bus.publish([EVENT])
    stream = EventStream(bus, "analytics", [topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps})
    got: list = []
    for _ in range(40):
        got += stream.poll(timeout_s=0.5)
        if got:
            break
    stream.close()
    assert [d.event for d in got] == [EVENT] and stream.counters.dead_letters == 1
    letters = EventStream(bus, "reader", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps})
    found: list = []
    for _ in range(40):
        found += letters.poll(timeout_s=0.5)
        if found:
            break
    letters.close()
    (letter,) = [d.event.payload for d in found if isinstance(d.event.payload, DeadLetter)]
    assert base64.b64decode(letter.raw_b64) == corrupt and letter.reason.startswith("rank report's ")


def test_a_frame_built_from_binary_reports_equals_the_one_built_from_their_json() -> None:
    """The frame joins the arrays of reports read from the wire; from JSON it reads the values.
    Both must give the detector the same numbers, bit for bit."""
    from analytics.detection.frame import build_frame

    reports = [report().model_copy(update={"rank": r, "coords": Coords(tp=r % 2, pp=r // 2, dp=0)}) for r in range(4)]
    events = [FACTORY.make(r) for r in reports]
    from_wire = build_frame([payload_as(decode(encode(e)), RankIteration) for e in events])
    from_json = build_frame([payload_as(decode(encode_json(e)), RankIteration) for e in events])
    assert isinstance(payload_as(decode(encode(events[0])), RankIteration).chunk_table.start_s, ArrayColumn)
    for name, value in vars(from_json).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(from_wire, name), value, err_msg=name)
    assert np.isnan(from_wire.c_tokens[1]) and np.isnan(from_wire.c_s2[1]) and from_wire.c_s2[0] == 300**2 + 400**2


def test_a_frames_communications_joined_from_binary_reports_equal_those_read_from_their_json() -> None:
    """The frame keeps some communications (TP all-reduces, p2p sends, DP all-reduces) and drops
    the rest; from the wire it picks them by op code over the joined columns, from JSON value by
    value. Reports that say includes_wait or group and reports that do not, a report without
    communications, unknown peers and byte counts: the same rows, bit for bit."""
    from analytics.detection.frame import _joined_comm_rows, build_frame

    def wait(op: CommOp, start_s: float, **kw) -> CommWait:
        return CommWait(op=op, start_s=start_s, duration_s=0.001 + start_s / 10, **kw)

    comms = [
        None,  # report()'s own: a fused p2p timer that says its wait and group, a DP all-reduce
        [],
        [wait(CommOp.PP_RECV, 0.001, peer=5, microbatch=0, bytes=None),
         wait(CommOp.TP_ALLREDUCE, 0.025, bytes=64, group="tp"),
         wait(CommOp.PP_SEND, 0.04, peer=9, microbatch=1, bytes=None),
         wait(CommOp.ALL_GATHER, 0.06, group="fsdp")],
        [wait(CommOp.TP_ALLREDUCE, 0.005, includes_wait=True), wait(CommOp.PP_RECV, 0.03, peer=1, microbatch=0),
         wait(CommOp.DP_ALLREDUCE, 0.09, bytes=2**40)],
    ]
    reports = []
    for r, comm in enumerate(comms):
        base = report()
        update: dict = {"rank": r, "coords": Coords(tp=r % 2, pp=r // 2, dp=0)}
        if comm is not None:
            update["comm_table"] = CommTable.of(comm)
        reports.append(base.model_copy(update=update))
    events = [FACTORY.make(r) for r in reports]
    wire = [payload_as(decode(encode(e)), RankIteration) for e in events]
    json_ = [payload_as(decode(encode_json(e)), RankIteration) for e in events]
    assert _joined_comm_rows([r.waits() for r in wire]) is not None  # joined, not read value by value
    assert _joined_comm_rows([r.waits() for r in json_]) is None
    from_wire, from_json = build_frame(wire), build_frame(json_)
    for name, value in vars(from_json).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(from_wire, name), value, err_msg=name)
    assert from_wire.k_op.tolist() == [4, 3, 0, 1, 0, 3]  # sendrecv, dp; tp, send; tp, dp (pp_recv, all_gather dropped)
    assert from_wire.k_wait.tolist() == [True, False, False, False, True, False]
    assert from_wire.k_group.tolist() == [1, -1, 0, -1, -1, -1] and np.isnan(from_wire.k_bytes[[1, 3]]).all()
    assert from_wire.c_own[2 * 3 + 1] < from_wire.c_dur[2 * 3 + 1]  # rank 2's TP wait inside its second chunk


def test_the_chunks_table_from_binary_reports_equals_the_one_from_their_json() -> None:
    """DuckDB's chunks rows: joined from the arrays of reports read from the wire, read value by
    value from JSON; the same Arrow table either way, unknown tokens and lengths NULL."""
    from analytics.projections.tables import chunk_rows

    reports = [report().model_copy(update={"rank": r, "coords": Coords(tp=r % 2, pp=r // 2, dp=0)}) for r in range(4)]
    events = [FACTORY.make(r) for r in reports]
    from_wire = chunk_rows([("j", payload_as(decode(encode(e)), RankIteration)) for e in events])
    from_json = chunk_rows([("j", payload_as(decode(encode_json(e)), RankIteration)) for e in events])
    assert from_wire.equals(from_json)
    rows = from_wire.to_pylist()
    n = len(reports[0].chunk_table.kind)
    assert len(rows) == 4 * n and [r["rank"] for r in rows[n - 1:n + 1]] == [0, 1]
    assert rows[1]["tokens"] is None and rows[1]["sum_sq_len"] is None and rows[1]["n_seqs"] is None
    assert rows[0]["sum_sq_len"] == 300**2 + 400**2 and rows[0]["n_seqs"] == 2 and rows[0]["tokens"] is not None
