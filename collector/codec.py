"""Bytes on the bus <-> events, and the one error every bad record becomes.

JSON (UTF-8) is the wire format of every event but the high-volume analytics records: any tool can
read a topic, and pydantic-core parses and validates it in one pass. A payload whose bulk is
numeric arrays (``PackedArrays``: replica summaries, liveness batches) travels as a binary record
instead: the arrays are most of those records, and base64 made them a third larger and added a
decoding pass over 1,562 of them an iteration at the merge of a 100k-rank job:

    0xFF 'R' 'B'   magic (0xFF never occurs in UTF-8, so no record is both)
    u8             wire format (BINARY_FORMAT)
    u32 LE         header length H
    H bytes        the envelope as JSON, schema version included, with the payload's blob empty
    the rest       the blob: the layout's arrays, little-endian, back to back

The header is validated as any JSON record is; the blob must be exactly as long as its layout
says. A rank report (``telemetry.iteration`` from schema 5, the bus's bulk) has a second wire format,
2: the same prefix, a fixed binary header instead of the JSON one (``collector/rank_header.py``),
then its columns (``collector/rank_columns.py``); a signed report, or one whose header that layout
cannot carry, keeps format 1's JSON header. ``encode_json`` gives any event's JSON (traces keep that
form), and ``decode`` reads all three, so logs written before either binary form still decode.
``decode`` never raises anything but ``InvalidEvent``, whose message names the problem; consumers
send such records to the dead-letter topic instead of crashing.

Why not Arrow IPC for the binary records: a summary's arrays have four different lengths (one
list column each in a one-row batch), and on this machine an IPC stream of that shape was 25 %
larger than the raw arrays (schema flatbuffers per record) and took ~4x as long to read back as
``np.frombuffer`` over the blob (126 µs against 33 µs per record): the merge reads 1,562 an iteration.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct

from pydantic import ValidationError

from collector.events import (
    ATTACHED_BLOB, DEADLETTER_REASON_MAX, EVENT_ADAPTER, NO_COMM, ChunkTable, DeadLetter, Envelope, PackedArrays,
    RankColumns, RankIteration,
)
from collector.rank_columns import decode_columns, encode_columns, layout_json
from collector.rank_header import BINARY_RANK_SCHEMA, RANK_FORMAT, pack_header, read_rank_report

MAX_EVENT_BYTES = 1_000_000  # Kafka's default message.max.bytes is ~1 MB; stay under it.
DEADLETTER_RAW_PREFIX = 64 * 1024  # bytes of a bad record a dead letter carries whole (base64: ~87 KB)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InvalidEvent(ValueError):
    """A record that is not a valid event. ``reason`` is one line an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


BINARY_MAGIC = b"\xffRB"
BINARY_FORMAT = 1  # the binary record's layout with a JSON header; the payload's schema version is the envelope's
_EMPTY_CHUNKS = ChunkTable.model_construct(kind="", microbatch=[], virtual_stage=[], tokens=[], seq_lens=[], start_s=[],
                                           duration_s=[])
_PREFIX = struct.Struct("<3sBI")  # magic, wire format, header length


def encode(event: Envelope) -> bytes:
    """The bus bytes of ``event``: a binary record for a PackedArrays payload and a rank report of
    schema 5 on, JSON otherwise."""
    payload = event.payload
    if isinstance(payload, PackedArrays):
        header = event.model_copy(update={"payload": payload.model_copy(update={"blob": b""})})
        head, blob = header.__pydantic_serializer__.to_json(header), payload.blob
    elif isinstance(payload, RankIteration) and event.schema_version >= BINARY_RANK_SCHEMA and not payload.comm:
        try:
            layout, blob = encode_columns(payload.chunk_table, payload.waits())
        except (ValueError, KeyError) as exc:  # a table built without validation
            raise InvalidEvent(f"rank report's columns do not fit their wire types: {exc}") from None
        fixed = pack_header(event, layout)
        if fixed is not None:
            return _bounded(event, rank_record(fixed, blob))
        head = _rank_header(event, layout_json(layout))
    else:
        return _bounded(event, event.__pydantic_serializer__.to_json(event))
    return _bounded(event, binary_record(head, blob))


def binary_record(head: bytes, blob: bytes) -> bytes:
    """A binary record from its header's JSON and its blob (no size check: ``encode`` bounds it).
    The simulator's publishers write rank reports through it without building their events."""
    return b"".join((_PREFIX.pack(BINARY_MAGIC, BINARY_FORMAT, len(head)), head, blob))


def rank_record(head: bytes, blob: bytes) -> bytes:
    """A rank report's record (wire format 2) from its fixed header (``collector/rank_header.py``)
    and its columns' blob (no size check: ``encode`` bounds it)."""
    return b"".join((_PREFIX.pack(BINARY_MAGIC, RANK_FORMAT, len(head)), head, blob))


_TABLES = {"payload": {"chunk_table": True, "comm_table": True}}
_EMPTY_CHUNKS_JSON = _EMPTY_CHUNKS.__pydantic_serializer__.to_json(_EMPTY_CHUNKS)


def _rank_header(event: Envelope, columns: bytes) -> bytes:
    """A binary rank report's header: the envelope's JSON with empty tables and ``columns``. An
    unsigned envelope's JSON ends with its payload's and its own closing braces, so the tables'
    stand-ins are written in before them (two model copies cost a rank more than its columns)."""
    if event.signature is None:
        head = event.__pydantic_serializer__.to_json(event, exclude=_TABLES)
        if head.endswith(b"}}"):
            return b"".join((head[:-2], b',"chunk_table":', _EMPTY_CHUNKS_JSON, b',"columns":', columns, b"}}"))
    payload = event.payload.model_copy(update={"chunk_table": _EMPTY_CHUNKS, "comm_table": NO_COMM,
                                               "columns": RankColumns.model_validate_json(columns)})
    header = event.model_copy(update={"payload": payload})
    return header.__pydantic_serializer__.to_json(header)


def encode_json(event: Envelope) -> bytes:
    """The JSON bytes of any event (the readable form: traces, tools), binary kinds included."""
    return _bounded(event, event.__pydantic_serializer__.to_json(event))


def _bounded(event: Envelope, raw: bytes) -> bytes:
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidEvent(
            f"{event.kind} event of {len(raw):,} bytes exceeds the {MAX_EVENT_BYTES:,}-byte limit; "
            "split it (telemetry: one message per rank per iteration)"
        )
    return raw


def decode(raw: bytes) -> Envelope:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidEvent(f"record value is {type(raw).__name__}, not bytes")
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidEvent(f"record of {len(raw):,} bytes exceeds the {MAX_EVENT_BYTES:,}-byte limit")
    if not raw:
        raise InvalidEvent("empty record")
    if raw[:3] != BINARY_MAGIC:
        event = _validate(raw, None)
        if isinstance(event.payload, RankIteration) and event.payload.columns is not None:
            raise InvalidEvent("a JSON rank report names payload.columns, which only a binary record's header "
                               "carries; give the columns inline (chunk_table, comm_table)")
        return event
    fmt, head, blob = _split_binary(bytes(raw))
    if fmt == RANK_FORMAT:
        return _rank_report(head, blob)
    event = _validate(head, {ATTACHED_BLOB: blob})
    if isinstance(event.payload, RankIteration):
        return _with_columns(event, blob)
    if not isinstance(event.payload, PackedArrays):
        raise InvalidEvent(f"binary record of kind {event.kind}: only payloads of packed arrays (analytics."
                           "replica_summary, analytics.liveness) and rank reports travel binary; publish it as JSON")
    return event


def _with_columns(event: Envelope, blob: bytes) -> Envelope:
    """A binary rank report with its tables read from the blob after its header."""
    p = event.payload
    assert isinstance(p, RankIteration)
    if event.schema_version < BINARY_RANK_SCHEMA:
        raise InvalidEvent(f"binary rank report of schema {event.schema_version}: rank reports travel binary from "
                           f"schema {BINARY_RANK_SCHEMA}; publish older ones as JSON")
    if p.columns is None:
        raise InvalidEvent("binary rank report without payload.columns: its header must say what its blob holds")
    if len(p.chunk_table) or len(p.comm_table) or p.comm:
        raise InvalidEvent("binary rank report's header carries table rows; its columns belong in the blob")
    try:
        chunks, comm = decode_columns(p.columns, blob)
    except ValueError as exc:
        raise InvalidEvent(str(exc)) from None
    # The event was built by this call and is not shared yet: fill in its tables rather than copy
    # it twice (a frozen model's fields live in its __dict__).
    p.__dict__.update(chunk_table=chunks, comm_table=comm, columns=None)
    return event


def _rank_report(head: bytes, blob: bytes) -> Envelope:
    """A rank report of wire format 2: its fixed header, then its columns."""
    try:
        return read_rank_report(head, blob)[0]
    except ValueError as exc:
        raise InvalidEvent(str(exc)) from None


def header_json(raw: bytes) -> bytes:
    """The JSON part of a record: the whole of a JSON record, a binary record's header (its blob
    left empty). Never raises: what is not a binary record is returned as it is."""
    if raw[:3] != BINARY_MAGIC:
        return bytes(raw)
    try:
        fmt, head, _ = _split_binary(bytes(raw))
        if fmt != RANK_FORMAT:
            return head
        event, layout = read_rank_report(head, None)  # the JSON header format 1 writes for the same report
        return _rank_header(event, layout_json(layout))
    except (InvalidEvent, ValueError):
        return b""


def readable(raw: bytes) -> bytes:
    """A record's JSON form: a JSON record as it is, a binary one re-encoded (raises InvalidEvent
    when that one does not decode)."""
    return bytes(raw) if raw[:3] != BINARY_MAGIC else encode_json(decode(raw))


def _split_binary(raw: bytes) -> tuple[int, bytes, bytes]:
    """A binary record's wire format, header and blob."""
    if len(raw) < _PREFIX.size:
        raise InvalidEvent(f"binary record of {len(raw)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    _, fmt, head_len = _PREFIX.unpack_from(raw)
    if fmt != BINARY_FORMAT and fmt != RANK_FORMAT:
        raise InvalidEvent(f"binary record in wire format {fmt} (this build reads {BINARY_FORMAT} and {RANK_FORMAT}); "
                           "upgrade the consumer")
    end = _PREFIX.size + head_len
    if end > len(raw):
        raise InvalidEvent(f"binary record's {head_len:,}-byte header runs past its {len(raw):,} bytes: truncated")
    return fmt, raw[_PREFIX.size:end], raw[end:]


def _validate(json_raw: bytes, context: dict | None) -> Envelope:
    try:
        return EVENT_ADAPTER.validate_json(json_raw, context=context)
    except ValidationError as exc:
        try:
            bytes(json_raw).decode("utf-8")
        except UnicodeDecodeError as bad:
            where = "binary record's header" if context is not None else "record"
            raise InvalidEvent(f"{where} is not UTF-8: {bad.reason} at byte {bad.start}") from None
        raise InvalidEvent("invalid event: " + one_line(exc)) from None
    except (ValueError, TypeError, RecursionError) as exc:  # defensive: parser errors outside pydantic
        raise InvalidEvent(f"undecodable record: {exc}") from None


def dead_letter(topic: str, partition: int, offset: int, group: str, reason: str, raw: object) -> DeadLetter:
    """The dead letter of one bad record, bounded so that it always fits on the bus.

    Why bounded: a record just under the bus's limit, base64-encoded inside an envelope, would not
    fit, and a consumer that cannot publish a record's dead letter cannot move past it (it would
    crash-loop on every restart). A record longer than ``DEADLETTER_RAW_PREFIX`` keeps that prefix,
    its length and its SHA-256 (enough to find it in the log and tell two apart); the reason and the
    names keep their first characters. Never raises, whatever ``raw`` is (a Kafka tombstone is None).
    """
    data = bytes(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else b""
    whole = len(data) <= DEADLETTER_RAW_PREFIX
    return DeadLetter(
        topic=_clip(topic, 1000), partition=min(max(partition, 0), 2**31 - 1), offset=min(max(offset, 0), 2**53),
        group=_clip(group, 1000), reason=_clip(reason, DEADLETTER_REASON_MAX) or "invalid record",
        raw_b64=base64.b64encode(data[:DEADLETTER_RAW_PREFIX]).decode("ascii"),
        raw_length=None if whole else len(data),
        raw_sha256=None if whole else hashlib.sha256(data).hexdigest(),
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(exc: ValidationError, root: str = "<record>") -> str:
    """A validation error as one line (a dead letter's reason, a command's error): the first three
    problems, each with its field path (``root`` when the whole input is wrong)."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or root
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    # Field names come from the input: escape control characters so the reason stays one line.
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], "; ".join(parts) + more)
