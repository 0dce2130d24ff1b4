"""Traces: a recorded slice of the event log, as Parquet that any tool can read.

One Parquet file (or a directory of them, read in name order) with one row per event: the
envelope's columns — ``id, kind, schema_version, job, source, seq, time_s`` — plus where the bus
puts it (``topic``, ``key``) and ``value``, the event's JSON (a UTF-8 string column, so DuckDB's
``json`` functions and pandas read it directly): the exact bytes the bus carries, except for the
binary records (replica summaries, liveness batches; collector/codec.py), kept in their JSON form. Rows are in publication order.
The simulator records its full log plus ground truth (``truth.fault`` on ``resihp.truth``); the
torch trainer records the same format. Schema-level metadata ``resihp.trace`` names the version.

What can go wrong: a file without the ``resihp.trace`` metadata or with a newer version is refused
with the versions this build reads; a file that is not Parquet (or is cut short) is a ``TraceError``
naming it; a row whose ``value`` no longer decodes is kept as raw bytes by ``TraceReader.records``
and only fails in ``TraceReader.events`` (a ``TraceError`` naming file and row; replay sends raw
bytes, so bad rows reach the consumers' dead-letter path just as they did live). Every
``TraceError`` message is one line a command can print as it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from collector.bus import Bus, RawMessage
from collector.codec import InvalidEvent, decode, encode_json, header_json, readable
from collector.events import COUNT_MAX, ENVELOPE_HEADER, INT32_MAX, TIME_MAX_S, Envelope
from collector.topics import key_for, topic_for

TRACE_FORMAT = "resihp-trace/1"
READABLE_FORMATS = ("resihp-trace/1",)

SCHEMA = pa.schema(
    [
        ("id", pa.string()), ("kind", pa.string()), ("schema_version", pa.int32()), ("job", pa.string()),
        ("source", pa.string()), ("seq", pa.int64()), ("time_s", pa.float64()), ("topic", pa.string()),
        ("key", pa.string()), ("value", pa.string()),
    ],
    metadata={b"resihp.trace": TRACE_FORMAT.encode()},
)


class TraceError(ValueError):
    """A trace this build cannot read: the message is one line naming the file and the problem."""


def _arrow_problem(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class EventHeader(NamedTuple):
    """An event's envelope columns (``ENVELOPE_HEADER``), without its payload."""

    id: str
    kind: str
    schema_version: int
    job: str
    source: str
    seq: int
    time_s: float

    @classmethod
    def parse(cls, raw: bytes) -> EventHeader | None:
        """The header of an encoded event (JSON or binary), read without validating its payload
        (None if unreadable)."""
        try:
            d = json.loads(header_json(raw))
            header = cls(d["id"], d["kind"], d["schema_version"], d["job"], d["source"], d["seq"], d["time_s"])
        except (ValueError, KeyError, TypeError):
            return None
        return header if header.well_formed() else None

    def well_formed(self) -> bool:
        """The envelope's own rules on each column (collector/events.py ``Envelope``): a header that
        breaks one is not an event's, and a trace column (int64, a topic per kind) cannot hold it."""
        try:
            topic_for(self.kind)
        except (ValueError, AttributeError):
            return False
        return (_text(self.id, 64) and _text(self.job, 200) and _text(self.source, 200)
                and _integer(self.schema_version, INT32_MAX) and _integer(self.seq, COUNT_MAX)
                and isinstance(self.time_s, int | float) and not isinstance(self.time_s, bool)
                and 0 <= self.time_s <= TIME_MAX_S)


def _text(value: object, longest: int) -> bool:
    return isinstance(value, str) and 1 <= len(value) <= longest


def _integer(value: object, largest: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= largest


class TraceRecord(NamedTuple):
    header: EventHeader
    topic: str
    key: str
    value: bytes  # the encoded event, as on the bus


class TraceWriter:
    """Appends events to a Parquet trace, a row group every ``rows_per_group`` events.

    Use as a context manager (or call ``close``): Parquet writes its footer on close, and a file
    whose writer never closed cannot be read.
    """

    def __init__(self, path: str | Path, *, rows_per_group: int = 50_000) -> None:
        self.path = Path(path)
        if self.path.suffix != ".parquet" and not self.path.exists():
            self.path.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir():
            self.path = self.path / "part-00000.parquet"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(self.path, SCHEMA, compression="zstd")
        self._rows_per_group = rows_per_group
        self._buf: dict[str, list] = {name: [] for name in SCHEMA.names}
        self.count = 0

    def write(self, events: Iterable[Envelope]) -> None:
        for e in events:
            self.write_encoded(e, encode_json(e))

    def write_encoded(self, event: Envelope | EventHeader, value: bytes) -> None:
        """Record an event whose bus bytes are already at hand (a recorder that also publishes); a
        binary record is kept as its JSON (raises InvalidEvent when it does not decode)."""
        text = readable(value).decode("utf-8")  # first: a record that raises leaves no partial row
        b = self._buf
        for name in ENVELOPE_HEADER:
            b[name].append(getattr(event, name))
        b["topic"].append(topic_for(event.kind))
        b["key"].append(key_for(event.job, event.source).decode())
        b["value"].append(text)
        self.count += 1
        if len(b["id"]) >= self._rows_per_group:
            self.flush()

    def flush(self) -> None:
        if self._buf["id"]:
            self._writer.write_table(pa.Table.from_pydict(self._buf, schema=SCHEMA))
            self._buf = {name: [] for name in SCHEMA.names}

    def close(self) -> None:
        self.flush()
        self._writer.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"trace directory {p} holds no .parquet files")
        return files
    if not p.exists():
        raise FileNotFoundError(f"no trace at {p}; record one with `resihp simulate SCENARIO --out {p}`")
    return [p]


class TraceReader:
    """Reads a trace file or directory, checking its format version."""

    def __init__(self, path: str | Path) -> None:
        self.files = _files(path)
        for f in self.files:
            try:
                meta = pq.read_schema(f).metadata or {}
            except (pa.ArrowException, OSError) as exc:
                raise TraceError(f"{f} is not a ResiHP trace: not a complete Parquet file "
                                 f"({_arrow_problem(exc)}); record one with `resihp simulate` or `resihp import`") from None
            fmt = meta.get(b"resihp.trace", b"").decode(errors="replace")
            if fmt not in READABLE_FORMATS:
                raise TraceError(
                    f"{f} is not a ResiHP trace this build reads (format {fmt or 'missing'!r}; reads "
                    f"{', '.join(READABLE_FORMATS)}); re-record it or upgrade"
                )

    def table(self, columns: list[str] | None = None) -> pa.Table:
        return pa.concat_tables(pq.read_table(f, columns=columns) for f in self.files)

    def records(self) -> Iterator[TraceRecord]:
        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
                batches = pf.iter_batches(batch_size=10_000)
                for batch in batches:
                    cols = batch.to_pydict()
                    for i in range(batch.num_rows):
                        yield TraceRecord(EventHeader(*(cols[name][i] for name in ENVELOPE_HEADER)), cols["topic"][i],
                                          cols["key"][i], cols["value"][i].encode())
            except (pa.ArrowException, OSError, KeyError, AttributeError) as exc:
                raise TraceError(f"{f} is damaged: {_arrow_problem(exc)}") from None

    def events(self) -> Iterator[Envelope]:
        for n, r in enumerate(self.records()):
            try:
                event = decode(r.value)
            except InvalidEvent as exc:
                raise TraceError(f"{self._where(n)}: {exc.reason}") from None
            yield event

    def _where(self, n: int) -> str:
        """'FILE row R' for the n-th record over all files."""
        for f in self.files:
            rows = pq.ParquetFile(f).metadata.num_rows
            if n < rows:
                return f"{f} row {n}"
            n -= rows
        return str(self.files[-1])

    def __len__(self) -> int:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)


def read_trace(path: str | Path) -> list[Envelope]:
    """Every event of a trace, decoded (small traces; iterate ``TraceReader.events`` for big ones)."""
    return list(TraceReader(path).events())


def replay(
    path: str | Path,
    bus: Bus,
    *,
    speed: float = 1.0,
    batch: int = 5_000,
    sleep=time.sleep,  # injectable for tests
    clock=time.monotonic,
) -> int:
    """Publish a trace onto ``bus`` in order: at its original pace (speed 1), ``speed`` times faster,
    or as fast as possible (speed 0 or inf). Returns the number of records published.

    Pacing follows each record's ``time_s`` relative to the first record's; records already due
    are sent together in one batch. The trace's bytes are sent as they are, so replay is
    byte-identical to the log but for binary records, which go out as their JSON (decoded alike).
    """
    fast = speed <= 0 or speed == float("inf")
    pending: list[RawMessage] = []
    sent = 0
    t0: float | None = None
    wall0 = clock()
    for r in TraceReader(path).records():
        if t0 is None:
            t0 = r.header.time_s
        if not fast:
            due = wall0 + max(0.0, r.header.time_s - t0) / speed
            wait = due - clock()
            if wait > 0:
                if pending:
                    bus.publish_raw(pending)
                    sent += len(pending)
                    pending = []
                sleep(wait)
        pending.append(RawMessage(r.topic, r.key.encode(), r.value))
        if len(pending) >= batch:
            bus.publish_raw(pending)
            sent += len(pending)
            pending = []
    if pending:
        bus.publish_raw(pending)
        sent += len(pending)
    return sent
