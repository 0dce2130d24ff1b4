"""A rank report's fixed binary header: how ``telemetry.iteration`` travels on the bus (wire format 2).

Why not the JSON header of wire format 1: a rank report is the bus's bulk, and its JSON header
(the envelope and the payload's scalars, ~600 bytes) took pydantic ~13 µs a record to parse and
check at the consumer, more than the columns after it, and ~3 µs to write. Its fields are a fixed
set of numbers and three strings, so one ``struct`` reads them and a few comparisons check the
ranges the models check (``collector/events.py``): the same record is read in a few microseconds.

Layout (little-endian), after the record's prefix (magic, wire format 2, header length H):

    u32  schema_version     a rank report's schema that travels binary (5)
    i64  seq                0 … 2^53
    f8   time_s             0 … 1e10
    i32  epoch              0 … 2^31-1
    i64  iteration          0 … 2^53
    i32  rank, node, tp, pp, dp, cp     0 … 2^31-1 (node -1: unknown)
    f8   wall_s             0 … 1e6
    u32  chunks n (≤ 65,536), sequence lengths m, communications k (≤ 2^20 each)
    u8   flags              1: the blob holds an includes_wait column, 2: a group column
    u16  bytes of id, job, source
    the id, job and source in UTF-8 (1–64, 1–200, 1–200 characters), then the n chunk kinds (F B W)

H must be exactly the fixed part, the three strings and the kinds. The blob after the header is
the columns of ``collector/rank_columns.py``, as in wire format 1. What this layout cannot carry
(a signed report, a string that is not UTF-8, a value outside its field's type) travels with
format 1's JSON header, which every reader still reads; so do the records written before.

``read_rank_report`` never raises anything but ``ValueError`` with one line naming the field and its
bound; the codec turns it into ``InvalidEvent``.
"""

from __future__ import annotations

import struct
from typing import Any

from collector.events import (
    CHUNKS_MAX, COUNT_MAX, DURATION_MAX_S, EVENT_TYPES, LIST_MAX, NO_COMM, TIME_MAX_S, ChunkTable, Coords, Envelope,
    RankIteration, construct_checked,
)
from collector.rank_columns import RankLayout, decode_columns

RANK_FORMAT = 2  # the wire format byte of a rank report with this header
BINARY_RANK_SCHEMA = 5  # telemetry.iteration travels binary from this schema version on
SCHEMAS = tuple(v for v in RankIteration.VERSIONS if v >= BINARY_RANK_SCHEMA)
FIXED = struct.Struct("<IqdiqiiiiiidIIIBHHH")
_KIND = RankIteration.KIND
_EVENT = EVENT_TYPES[_KIND]
_FBW = b"FBW"
# What ``model_fields_set`` answers for a report read here: every field. Shared by every report: a
# frozen model never adds to it, and ``model_copy`` copies it before it adds the updated names.
_EVENT_FIELDS, _PAYLOAD_FIELDS, _COORDS_FIELDS = set(_EVENT.model_fields), set(RankIteration.model_fields), \
    set(Coords.model_fields)
_EMPTY_CHUNKS = ChunkTable.model_construct(kind="", microbatch=[], virtual_stage=[], tokens=[], seq_lens=[], start_s=[],
                                           duration_s=[])
_ID_MAX, _TEXT_MAX = 64, 200  # characters, as the envelope's fields


def pack_header(event: Envelope, layout: RankLayout) -> bytes | None:
    """The fixed header of a rank report ``event`` whose columns ``layout`` describes; None when
    the event does not fit it (signed, a string not UTF-8, a number outside its field's type):
    the codec then writes format 1's JSON header."""
    if event.signature is not None:
        return None
    p: Any = event.payload
    try:
        c = p.coords
        return pack_fields(event.schema_version, event.seq, event.time_s, p.epoch, p.iteration, p.rank, p.node,
                           (c.tp, c.pp, c.dp, c.cp), p.wall_s, layout, event.id, event.job, event.source)
    except AttributeError:
        return None


def pack_fields(schema_version: int, seq: int, time_s: float, epoch: int, iteration: int, rank: int, node: int | None,
                coords: tuple[int, int, int, int], wall_s: float, layout: RankLayout, ident: str, job: str,
                source: str) -> bytes | None:
    """A fixed header from its fields (``coords``: tp, pp, dp, cp); None when one does not fit its
    type. The simulator's publishers write rank reports through it without building their events."""
    try:
        texts = (ident.encode(), job.encode(), source.encode())
        fixed = FIXED.pack(schema_version, seq, time_s, epoch, iteration, rank, -1 if node is None else node, *coords,
                           wall_s, len(layout.kind), layout.seq_lens, layout.waits,
                           layout.includes_wait | layout.group << 1, *map(len, texts))
    except (struct.error, UnicodeEncodeError, TypeError, AttributeError):
        return None
    return b"".join((fixed, *texts, layout.kind.encode()))


def read_rank_report(head: bytes, blob: bytes | None) -> tuple[Envelope, RankLayout]:
    """The rank report of a fixed header and its blob, every field checked as the models check it,
    and what the blob holds. ``blob`` None: the header alone, with empty tables (``header_json``)."""
    if len(head) < FIXED.size:
        raise ValueError(f"rank report's header of {len(head)} bytes is shorter than its {FIXED.size}-byte fixed part")
    (schema, seq, time_s, epoch, iteration, rank, node, tp, pp, dp, cp, wall_s, n, m, k, flags, id_len, job_len,
     source_len) = FIXED.unpack_from(head)
    job_at = FIXED.size + id_len
    source_at = job_at + job_len
    at = source_at + source_len
    if not (schema in SCHEMAS and 0 <= seq <= COUNT_MAX and 0 <= iteration <= COUNT_MAX
            and 0.0 <= time_s <= TIME_MAX_S and 0.0 <= wall_s <= DURATION_MAX_S  # NaN fails both
            and min(epoch, rank, tp, pp, dp, cp, node + 1) >= 0 and n <= CHUNKS_MAX and m <= LIST_MAX
            and k <= LIST_MAX and flags <= 3 and at + n == len(head)):
        raise ValueError("rank report's header: " + _problem(head))
    kind = head[at:]
    if kind.translate(None, _FBW):
        raise ValueError("rank report's header: chunk kinds hold a letter other than F, B or W")
    try:
        ident, job, source = head[FIXED.size:job_at].decode(), head[job_at:source_at].decode(), head[source_at:at].decode()
    except UnicodeDecodeError as bad:
        raise ValueError(f"rank report's header: id, job or source is not UTF-8 ({bad.reason})") from None
    if not (0 < len(ident) <= _ID_MAX and 0 < len(job) <= _TEXT_MAX and 0 < len(source) <= _TEXT_MAX):
        for name, text, longest in (("id", ident, _ID_MAX), ("job", job, _TEXT_MAX), ("source", source, _TEXT_MAX)):
            if not 1 <= len(text) <= longest:
                raise ValueError(f"rank report's header: {name} of {len(text)} characters is outside 1 … {longest}")
    layout = RankLayout(kind.decode("ascii"), m, k, flags & 1 == 1, flags & 2 == 2)
    chunks, comm = (_EMPTY_CHUNKS, NO_COMM) if blob is None else decode_columns(layout, blob)
    payload = construct_checked(RankIteration, {
        "epoch": epoch, "iteration": iteration, "rank": rank, "node": None if node < 0 else node,
        "coords": construct_checked(Coords, {"tp": tp, "pp": pp, "dp": dp, "cp": cp}, _COORDS_FIELDS),
        "wall_s": wall_s, "chunk_table": chunks, "comm_table": comm, "columns": None, "comm": []}, _PAYLOAD_FIELDS)
    return construct_checked(_EVENT, {
        "id": ident, "kind": _KIND, "schema_version": schema, "job": job, "source": source, "seq": seq,
        "time_s": time_s, "payload": payload, "signature": None}, _EVENT_FIELDS), layout


def _problem(head: bytes) -> str:
    """Which field of a fixed header is out of its range (the first found)."""
    (schema, seq, time_s, epoch, iteration, rank, node, tp, pp, dp, cp, wall_s, n, m, k, flags, id_len, job_len,
     source_len) = FIXED.unpack_from(head)
    if schema not in SCHEMAS:
        return (f"schema_version {schema} does not travel with this header (this build reads {', '.join(map(str, SCHEMAS))} "
                "here); upgrade the consumer")
    for name, value, top in (("seq", seq, COUNT_MAX), ("iteration", iteration, COUNT_MAX), ("time_s", time_s, TIME_MAX_S),
                             ("wall_s", wall_s, DURATION_MAX_S)):
        if not 0 <= value <= top:  # NaN fails
            return f"{name} = {value!r} is outside 0 … {top:,g}" if isinstance(value, float) else \
                f"{name} = {value} is outside 0 … {top:,}"
    for name, value, low in (("epoch", epoch, 0), ("rank", rank, 0), ("node", node, -1), ("coords.tp", tp, 0),
                             ("coords.pp", pp, 0), ("coords.dp", dp, 0), ("coords.cp", cp, 0)):
        if value < low:
            return f"{name} = {value} is below {low}" + (" (-1: unknown)" if low else "")
    for name, value, top in (("chunks", n, CHUNKS_MAX), ("sequence lengths", m, LIST_MAX), ("communications", k, LIST_MAX)):
        if value > top:
            return f"{name} = {value:,} is above {top:,}"
    if flags > 3:
        return f"flags = {flags} name columns this build does not know (1: includes_wait, 2: group)"
    want = FIXED.size + id_len + job_len + source_len + n
    return (f"{len(head):,} bytes long, but its fixed part, strings ({id_len} + {job_len} + {source_len} bytes) and "
            f"{n} chunk kinds make {want:,}; the record is truncated or corrupt")
