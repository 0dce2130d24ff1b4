"""Binary rank reports (telemetry.iteration schema 5): their columns round trip as arrays, the JSON
forms of every schema still decode, and any byte string in a binary report's body is either a
report the JSON form would accept too or refused with one line naming the column, and
dead-lettered while the consumer carries on."""

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
from collector.codec import BINARY_MAGIC, InvalidEvent, decode, encode, encode_json, header_json, readable
from collector.events import (
    DURATION_MAX_S, Chunk, ChunkKind, CommOp, CommWait, Coords, DeadLetter, EventFactory, RankIteration,
)
from collector.rank_columns import ArrayColumn, SeqLensColumn
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


def test_a_rank_report_travels_as_binary_columns_and_reads_back_as_arrays_equal_to_its_json() -> None:
    assert EVENT.schema_version == 5 and RAW.startswith(BINARY_MAGIC)
    got = decode(RAW)
    assert got == EVENT == decode(encode_json(EVENT))
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
    assert decode(encode(signed)) == signed
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
    head = json.loads(header_json(RAW))
    change(head)
    text = json.dumps(head).encode()
    return RAW[:4] + len(text).to_bytes(4, "little") + text + RAW[BODY:]


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
        "tokens", "op", "wait-flag", "group", "schema-4", "no-columns", "bad-columns", "rows-in-header"])
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
