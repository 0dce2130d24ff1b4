"""A rank report's columns as bytes: the binary body of ``telemetry.iteration`` from schema 5.

Why binary: rank reports are the bus's bulk (one per rank per iteration, tens of chunks each, and
hundreds of packed sequence lengths). As JSON, pydantic built and range-checked a Python object per
value: a 32-chunk report with 345 sequence lengths took 39 µs to decode, 15 µs of it the lengths
alone. As arrays the same checks (ranges, finiteness, lengths) are a few vectorised passes over
one array per dtype, whatever the row count.

The blob follows the binary record's header (collector/codec.py), whose payload says what it holds
(``RankColumns``: the chunk kinds, how many sequence lengths, how many communications, and
whether ``includes_wait`` / ``group`` columns are present). Arrays are grouped by dtype, so each
group is read and checked once (n chunks, m sequence lengths, k communications; little-endian):

    f8  chunk start_s[n], chunk duration_s[n], comm start_s[k], comm duration_s[k]   0 … 1e6
    i8  chunk tokens[n] (-1: unknown) 0 … 2^40, comm bytes[k] (-1: unknown) 0 … 2^53
    i4  chunk microbatch[n], virtual_stage[n], seq_lens[m]                          0 … 2^31-1
    i4  chunk seq_count[n] (-1: not reported; they sum to m), comm peer[k],
        comm microbatch[k] (-1: none)
    u1  comm op[k] (index into ``COMM_OPS``), includes_wait[k] (0/1, when said),
        group[k] (index into ``GROUPS``, 255: unknown; when said)

Why not Arrow IPC: one report is a one-row batch of list columns; its schema flatbuffer alone
is larger than a report's arrays (the same finding as for the replica summaries, codec.py), and
reading it back costs more than ``np.frombuffer`` over the blob. The layout above is fixed by
the schema version, so a reader needs nothing but the counts in the header.

``decode_columns`` never raises anything but ``ValueError`` with one line naming the column, the
row and the bound; the codec turns it into ``InvalidEvent`` (a dead letter).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple, cast, get_args

import numpy as np

from collector.events import (
    CHUNKS_MAX, COUNT_MAX, DURATION_MAX_S, NO_COMM, TOKENS_MAX, ChunkTable, CommOp, CommTable, ProcessGroupName,
    RankColumns, construct_checked,
)

COMM_OPS: tuple[CommOp, ...] = tuple(CommOp)  # u1 op codes, in the enum's order (append only)
GROUPS: tuple[str, ...] = get_args(ProcessGroupName)  # u1 group codes, in the contract's order (append only)
_OP_CODE = {op: i for i, op in enumerate(COMM_OPS)}
_GROUP_CODE = {g: i for i, g in enumerate(GROUPS)}
_NO_GROUP = 255
_F8, _I8, _I4, _U1 = np.dtype("<f8"), np.dtype("<i8"), np.dtype("<i4"), np.dtype("<u1")
_STRUCT_CODE = {_F8: "d", _I8: "q", _I4: "i", _U1: "B"}  # each dtype's struct letter (little-endian, standard sizes)
_BELOW_0X41 = bytes(range(0x41))
_OP_CODES = bytes(range(len(COMM_OPS)))
_GROUP_CODES = bytes(range(len(GROUPS))) + bytes([_NO_GROUP])
_FLAGS = (False, True)  # includes_wait codes
_GROUP_NAMES: tuple[str | None, ...] = GROUPS + (None,) * (256 - len(GROUPS))  # group codes (255: unknown)
_CHUNK_FIELDS, _COMM_FIELDS = set(ChunkTable.model_fields), set(CommTable.model_fields)  # every field, set


class RankLayout(NamedTuple):
    """What a report's blob holds, as the header of either wire format says it (``RankColumns``
    in a JSON header, the fixed header's counts in collector/rank_header.py)."""

    kind: str  # one letter per chunk, F B W
    seq_lens: int  # sequence lengths, all chunks together
    waits: int  # communications
    includes_wait: bool  # the blob holds an includes_wait column
    group: bool  # the blob holds a group column


def layout_json(layout: RankLayout) -> bytes:
    """A JSON header's ``columns`` for ``layout`` (wire format 1). ``kind`` is validated [FBW]*,
    the rest numbers and flags: the JSON is written as it reads."""
    return (f'{{"kind":"{layout.kind}","seq_lens":{layout.seq_lens},"waits":{layout.waits},'
            f'"includes_wait":{str(layout.includes_wait).lower()},"group":{str(layout.group).lower()}}}').encode()


def blob_bytes(columns: RankColumns | RankLayout) -> int:
    """How long the blob after a header saying ``columns`` must be."""
    n, m, k = len(columns.kind), columns.seq_lens, columns.waits
    return 16 * n + 16 * k + 8 * n + 8 * k + 4 * (3 * n + m) + 4 * 2 * k + k * (
        1 + int(columns.includes_wait) + int(columns.group))


def encode_columns(chunks: ChunkTable, comm: CommTable) -> tuple[RankLayout, bytes]:
    """What the blob holds and the blob of a report's tables (validated values,
    as lists or as the columns a binary report was read into). One ``struct.pack`` over the
    values: on a rank's thread it costs a third of building a numpy array per column."""
    lens = chunks.seq_lens
    n, k = len(chunks), len(comm)
    said_wait, said_group = bool(comm.includes_wait), bool(comm.group)
    flags = k * (int(said_wait) + int(said_group))
    # Lists concatenated, then unpacked once (a chain of iterators unpacks slower). Only token and
    # byte counts, peers and comm micro-batches may be None (unknown): the other columns are
    # taken as they are, and one that holds a None fails the pack below.
    if not k:
        values = (_wire(chunks.start_s, False) + _wire(chunks.duration_s, False) + _wire(chunks.tokens)
                  + _wire(chunks.microbatch, False) + _wire(chunks.virtual_stage, False))
    else:
        values = (_wire(chunks.start_s, False) + _wire(chunks.duration_s, False) + _wire(comm.start_s, False)
                  + _wire(comm.duration_s, False) + _wire(chunks.tokens) + _wire(comm.bytes)
                  + _wire(chunks.microbatch, False) + _wire(chunks.virtual_stage, False))
    before = len(values)
    if type(lens) is SeqLensColumn:
        values += lens.flat.tolist()
        counts: list[int] = lens.counts.tolist()
    else:
        try:  # every chunk's lengths, chunk after chunk: one extend each costs less than a chain
            for x in lens:
                values += x  # type: ignore[arg-type]  # None (not reported) raises, handled below
            counts = list(map(len, lens))  # type: ignore[arg-type]
        except TypeError:  # a chunk whose lengths are not reported (None)
            del values[before:]
            for x in lens:
                if x:
                    values += x
            counts = [-1 if x is None else len(x) for x in lens]
    m = len(values) - before
    values += counts
    if k:
        values += (_wire(comm.peer) + _wire(comm.microbatch) + [_OP_CODE[op] for op in comm.op]
                   + ([int(w) for w in comm.includes_wait] if said_wait else [])
                   + ([_NO_GROUP if g is None else _GROUP_CODE[g] for g in comm.group] if said_group else []))
    try:
        blob = struct.pack(f"<{2 * n + 2 * k}d{n + k}q{3 * n + m + 2 * k}i{k + flags}B", *values)
    except struct.error as exc:  # a table built without validation holds what its wire type cannot
        raise ValueError(f"rank report's columns do not fit their wire types: {exc}") from None
    return RankLayout(chunks.kind, m, k, said_wait, said_group), blob


def _wire(values: Sequence, nullable: bool = True) -> list:
    """A column's values for the wire: None (unknown) as -1 in a ``nullable`` one."""
    if type(values) is not list:  # not isinstance: a check against an ABC's subclass costs a rank ~1 µs a column
        return values.array.tolist() if isinstance(values, ArrayColumn) else list(values)
    if nullable and None in values:
        return [-1 if v is None else v for v in values]
    return values


def decode_columns(columns: RankColumns | RankLayout, blob: bytes) -> tuple[ChunkTable, CommTable]:
    """The report's tables from its blob, every value checked as the JSON form checks it.

    One pass per dtype group over all its columns (ranges, finiteness, counts against lengths),
    first by the bytes that carry sign and magnitude: ``bytes`` checks a strided slice in a
    fraction of a microsecond, where numpy takes 1–2 µs a reduction on a report's few hundred
    values. When those bytes say "look closer" (an unknown count or peer, -1; a duration over
    131,072 s) the group is checked exactly, and ``_problem`` then names the column, the row and
    the bound. Every column stays bytes until a reader asks for its arrays or values: the analytics
    frame joins them (``joined``, ``joined_codes``), and a report's communications were most of its
    Python values (a pipeline rank's ``pp_recv`` waits, which the frame drops)."""
    n, m, k = len(columns.kind), columns.seq_lens, columns.waits
    want = blob_bytes(columns)
    if len(blob) != want:
        raise ValueError(f"rank report's columns hold {len(blob):,} bytes but its header names {want:,} "
                         f"({n} chunks, {m} sequence lengths, {k} communications); the record is truncated or corrupt")
    f, i = 16 * (n + k), 24 * (n + k)  # where the int64 and the int32 groups start
    s = i + 4 * (2 * n + m)  # the int32 values that may be -1: sequence counts, comm peers and micro-batches
    u = s + 4 * (n + 2 * k)  # the bytes: comm op codes and flags
    signed = struct.unpack_from(f"<{n + 2 * k}i", blob, s)
    counts = signed[:n]
    ok = ((not blob[7:f:8].translate(None, _BELOW_0X41)  # top bytes < 0x41: +0.0 … 131,072, finite
           or _doubles_in_range(np.frombuffer(blob, _F8, 2 * (n + k))))
          and (blob[f + 5:i:8].count(0) == blob[f + 6:i:8].count(0) == blob[f + 7:i:8].count(0) == n + k  # < 2^40
               or _int64_in_range(blob, f, n, k))
          and blob[i + 3:s:4].isascii()  # top bytes < 0x80: none negative
          and (blob[s + 3:u:4].isascii() or sorted(signed)[0] >= -1)  # sorted: see ArrayColumn.extent
          and (not n or (max(counts) <= CHUNKS_MAX and sum(counts) + counts.count(-1) == m))
          and (not k or (not blob[u:u + k].translate(None, _OP_CODES)
                         and not blob[u + k:u + k + k * columns.includes_wait].translate(None, b"\x00\x01")
                         and not blob[u + k + k * columns.includes_wait:].translate(None, _GROUP_CODES))))
    if not ok:
        problem = _problem(columns, blob)
        if problem:
            raise ValueError("rank report's " + problem)
    chunk_table = construct_checked(ChunkTable, {
        "kind": columns.kind, "microbatch": ArrayColumn(blob, _I4, i, n), "virtual_stage": ArrayColumn(blob, _I4, i + 4 * n, n),
        "tokens": ArrayColumn(blob, _I8, f, n, nullable=True), "seq_lens": SeqLensColumn(blob, i + 8 * n, m, counts),
        "start_s": ArrayColumn(blob, _F8, 0, n), "duration_s": ArrayColumn(blob, _F8, 8 * n, n)}, _CHUNK_FIELDS)
    if not k:
        return chunk_table, NO_COMM
    w = u + k  # where the includes_wait flags start, when said
    g = w + k * columns.includes_wait  # where the group codes start, when said
    return chunk_table, construct_checked(CommTable, {
        "op": CodedColumn(blob, u, k, COMM_OPS), "peer": ArrayColumn(blob, _I4, s + 4 * n, k, True),
        "microbatch": ArrayColumn(blob, _I4, s + 4 * (n + k), k, True),
        "bytes": ArrayColumn(blob, _I8, f + 8 * n, k, True), "start_s": ArrayColumn(blob, _F8, 16 * n, k),
        "duration_s": ArrayColumn(blob, _F8, 16 * n + 8 * k, k),
        "includes_wait": CodedColumn(blob, w, k, _FLAGS) if columns.includes_wait else [],
        "group": CodedColumn(blob, g, k, _GROUP_NAMES) if columns.group else []}, _COMM_FIELDS)


def _doubles_in_range(values: np.ndarray) -> bool:
    return bool(((values >= 0.0) & (values <= DURATION_MAX_S)).all())  # NaN fails both


def _int64_in_range(blob: bytes, at: int, n: int, k: int) -> bool:
    """Whether the ``n`` token counts at ``at`` are 0 … 2^40 and the ``k`` byte counts after them
    0 … 2^53, or -1 (unknown), exactly. Read as Python ints: the byte test in ``decode_columns``
    cannot tell -1 (every byte 0xff) from other negatives, and a pipeline rank's ``pp_recv`` waits
    carry -1 in every report; a report's few dozen values cost a fifth of numpy's three
    reductions."""
    values = struct.unpack_from(f"<{n + k}q", blob, at)
    tokens, nbytes = sorted(values[:n]), sorted(values[n:])  # sorted: see ArrayColumn.extent
    return ((not n or -1 <= tokens[0] and tokens[-1] <= TOKENS_MAX)
            and (not k or -1 <= nbytes[0] and nbytes[-1] <= COUNT_MAX))


def _nullable(values: Sequence[int]) -> list[int | None]:
    """-1 read as None (unknown)."""
    return [None if v < 0 else v for v in values]


def _problem(columns: RankColumns | RankLayout, blob: bytes) -> str | None:
    """What is wrong with a report's columns, naming the column, the row and the bound (None: nothing)."""
    n, m, k = len(columns.kind), columns.seq_lens, columns.waits
    f8 = np.frombuffer(blob, _F8, 2 * (n + k))
    i8 = np.frombuffer(blob, _I8, n + k, 16 * (n + k))
    i4 = np.frombuffer(blob, _I4, 3 * n + m + 2 * k, 24 * (n + k))
    u1 = np.frombuffer(blob, _U1, len(blob) - 24 * (n + k) - 4 * len(i4), 24 * (n + k) + 4 * len(i4))
    natural, signed = i4[:2 * n + m], i4[2 * n + m:]
    floats = (("chunk start_s", f8[:n]), ("chunk duration_s", f8[n:2 * n]), ("comm start_s", f8[2 * n:2 * n + k]),
              ("comm duration_s", f8[2 * n + k:]))
    for name, values in floats:
        bad = np.flatnonzero(~((values >= 0.0) & (values <= DURATION_MAX_S)))
        if len(bad):
            return f"{name}[{int(bad[0])}] = {float(values[bad[0]])!r} is outside 0 … {DURATION_MAX_S:g} (or not finite)"
    ints: tuple[tuple[str, np.ndarray, int, int | None], ...] = (("chunk microbatch", natural[:n], 0, None), ("chunk virtual_stage", natural[n:2 * n], 0, None),
            ("seq_lens", natural[2 * n:], 0, None), ("sequence count", signed[:n], -1, CHUNKS_MAX),
            ("comm peer", signed[n:n + k], -1, None), ("comm microbatch", signed[n + k:], -1, None),
            ("chunk tokens", i8[:n], -1, TOKENS_MAX), ("comm bytes", i8[n:], -1, COUNT_MAX),
            ("comm op code", u1[:k], 0, len(COMM_OPS) - 1))
    for name, column, low, high in ints:
        bad = np.flatnonzero((column < low) | (column > high if high is not None else False))
        if len(bad):
            value = int(column[bad[0]])
            bound = f"below {low}" + (" (-1: unknown)" if low else "") if value < low else f"above {high:,}"
            return f"{name}[{int(bad[0])}] = {value} is {bound}"
    counts = signed[:n]
    if int(np.maximum(counts, 0).sum()) != m:
        return f"sequence counts sum to {int(np.maximum(counts, 0).sum()):,}, not the header's {m:,}"
    flags = u1[k:]
    waits = flags[:k] if columns.includes_wait else flags[:0]
    groups = flags[len(waits):]
    if len(waits) and waits.max() > 1:
        return f"includes_wait holds {int(waits.max())}, not 0 or 1"
    if len(groups) and ((groups >= len(GROUPS)) & (groups != _NO_GROUP)).any():
        return f"comm group codes go past {len(GROUPS) - 1} (255: unknown)"
    return None


class ArrayColumn(Sequence):
    """A column read from a binary report: its array (``.array``: what vectorised readers take,
    read from the record's bytes on first use) and a read-only sequence of Python values, built
    only when someone iterates. Why: building a Python object per value was most of a JSON
    report's decode; the analytics frame and the DuckDB ingest want arrays. ``nullable``: -1 reads
    as None (unknown)."""

    __slots__ = ("_array", "_blob", "_count", "_dtype", "_offset", "_values", "nullable")

    def __init__(self, blob: bytes, dtype: np.dtype, offset: int, count: int, nullable: bool = False) -> None:
        self._blob, self._dtype, self._offset, self._count, self.nullable = blob, dtype, offset, count, nullable
        self._array: np.ndarray | None = None
        self._values: list | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self._blob, self._dtype, self._count, self._offset)
        return self._array

    def extent(self) -> tuple[int, int] | None:
        """(lowest, highest) of an integer column's numbers as the record holds them (-1 where a
        nullable one is unknown); None when it is empty. From the record's bytes, without a
        Python value per row kept: what a bound on the column (admission) needs. Sorted, not
        ``min`` and ``max``: CPython sorts small ints with a compare made for them, and a report's
        few dozen sort in a third of the time of the two generic passes."""
        if not self._count:
            return None
        numbers = sorted(self._values if self._values is not None and not self.nullable else struct.unpack_from(
            f"<{self._count}{_STRUCT_CODE[self._dtype]}", self._blob, self._offset))
        return numbers[0], numbers[-1]

    def values(self) -> list:
        if self._values is None:
            self._values = _nullable(self.array.tolist()) if self.nullable else self.array.tolist()
        return self._values

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # int or slice, as a list answers
        return self.values()[index]

    def __iter__(self) -> Iterator:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, Sequence)) and not isinstance(other, str) and self.values() == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, compared by value, as a list

    def __repr__(self) -> str:
        return repr(self.values())


class CodedColumn(ArrayColumn):
    """A column of one-byte codes read from a binary report (comm ops, flags, groups): ``.array``
    holds the codes, and its values are ``names[code]``, built only when someone iterates."""

    __slots__ = ("names",)

    def __init__(self, blob: bytes, offset: int, count: int, names: Sequence) -> None:
        super().__init__(blob, _U1, offset, count)
        self.names = names

    def values(self) -> list:
        if self._values is None:
            names = self.names
            self._values = [names[c] for c in self._blob[self._offset:self._offset + self._count]]
        return self._values


class SeqLensColumn(Sequence):
    """Every chunk's packed sequence lengths from a binary report: ``flat`` (all lengths, chunk
    after chunk) and ``counts`` (per chunk, -1: not reported) as arrays, and as a sequence of
    lists (None where not reported) built only when someone iterates."""

    __slots__ = ("_blob", "_counts", "_flat", "_offset", "_total", "_values")

    def __init__(self, blob: bytes, offset: int, total: int, counts: Sequence[int]) -> None:
        self._blob, self._offset, self._total, self._counts = blob, offset, total, counts
        self._flat: np.ndarray | None = None
        self._values: list | None = None

    @property
    def flat(self) -> np.ndarray:
        if self._flat is None:
            self._flat = np.frombuffer(self._blob, _I4, self._total, self._offset)
        return self._flat

    @property
    def counts(self) -> np.ndarray:
        return np.array(self._counts, np.int64)

    def values(self) -> list[list[int] | None]:
        if self._values is None:
            flat = self.flat.tolist()
            out: list[list[int] | None] = []
            at = 0
            for c in self._counts:
                out.append(None if c < 0 else flat[at:at + c])
                at += max(c, 0)
            self._values = out
        return self._values

    def __len__(self) -> int:
        return len(self._counts)

    def __getitem__(self, index):  # int or slice, as a list answers
        return self.values()[index]

    def __iter__(self) -> Iterator:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, Sequence)) and not isinstance(other, str) and self.values() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.values())


def joined(columns: Sequence[Sequence], dtype: np.dtype | type, total: int, unknown: float | None = None) -> np.ndarray:
    """One column of many reports as one array, in order (``total`` values). When every report
    was read from the wire its arrays are joined, with no Python value per element; otherwise the
    values are read once. ``unknown``: what -1 / None reads as (a float column's NaN)."""
    wire = _same_dtype(columns)
    if wire is not None:
        # the records' bytes joined, then read once: an array per report cost 5 times as much
        size = wire.itemsize
        out = np.frombuffer(b"".join([c._blob[c._offset:c._offset + c._count * size] for c in columns]),  # type: ignore[attr-defined]
                            wire).astype(dtype)
        if unknown is not None:
            out[out < 0] = unknown
        return out
    values = itertools.chain.from_iterable(columns)
    if unknown is None:
        return np.fromiter(values, dtype, total)
    return np.array(list(values), dtype=dtype).reshape(total)  # None reads as NaN in the one conversion


def joined_codes(columns: Sequence[Sequence], counts: Sequence[int], absent: int) -> np.ndarray | None:
    """One code column (comm op, includes_wait, group) of many binary reports as one u1 array of
    their codes, in order; a report whose column is empty (not said) gives ``counts[i]`` codes
    ``absent``. None when some report's column holds Python values (not read from the wire)."""
    parts = []
    for column, count in zip(columns, counts):
        if type(column) is CodedColumn:
            parts.append(column._blob[column._offset:column._offset + column._count])
        elif not len(column):
            parts.append(bytes([absent]) * count)
        else:
            return None
    return np.frombuffer(b"".join(parts), _U1)


def _same_dtype(columns: Sequence[Sequence]) -> np.dtype | None:
    """The dtype of ``columns`` when every one is an ``ArrayColumn`` of it (a field's columns read
    from the wire share the one its layout gives it); None otherwise."""
    first = columns[0] if columns else None
    if type(first) is not ArrayColumn:
        return None
    dtype = first._dtype
    return dtype if all(type(c) is ArrayColumn and c._dtype is dtype for c in columns) else None


def joined_seq_lens(columns: Sequence[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
    """Every report's packed sequence lengths as (all lengths in order, per-chunk count with -1
    where not reported), when every report was read from the wire; None otherwise."""
    if not columns or not all(type(c) is SeqLensColumn for c in columns):
        return None
    lens = cast("Sequence[SeqLensColumn]", columns)
    flat = np.frombuffer(b"".join([c._blob[c._offset:c._offset + 4 * c._total] for c in lens]), _I4).astype(np.int64)
    counts = np.fromiter(itertools.chain.from_iterable(c._counts for c in lens), np.int64)
    return flat, counts

