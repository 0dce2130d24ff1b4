"""Where Replay gets its events: a recorded trace file, or this console's bus.

A trace is a recorded slice of the log (ARCHITECTURE.md): collector/trace.py's Parquet files (or
directories of them); any other file is read as JSON lines, one encoded event per line — the bus's
own wire format. Undecodable rows are counted and shown, not fatal.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collector import topics
from collector.bus import Bus
from collector.codec import InvalidEvent, decode
from collector.events import Envelope
from collector.stream import EventStream



@dataclass
class LoadedTrace:
    events: list[Envelope]
    skipped: int
    source: str


def list_traces(trace_dir: str) -> list[Path]:
    root = Path(trace_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _read_parquet(path: Path, with_telemetry: bool) -> tuple[list[Envelope], int]:
    """A collector/trace.py Parquet trace: filter on the ``kind`` column before decoding, since
    per-rank telemetry is most of a trace and Replay does not draw it."""
    from collector.trace import TraceReader

    table = TraceReader(path).table(columns=["kind", "value"])
    events: list[Envelope] = []
    skipped = 0
    for kind, value in zip(table.column("kind").to_pylist(), table.column("value").to_pylist()):
        if kind == "telemetry.iteration" and not with_telemetry:
            continue
        try:
            events.append(decode(value.encode() if isinstance(value, str) else value))
        except InvalidEvent:
            skipped += 1
    return events, skipped


def _read_json_lines(path: Path, with_telemetry: bool) -> tuple[list[Envelope], int]:
    events: list[Envelope] = []
    skipped = 0
    with path.open("rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                event = decode(line)
            except InvalidEvent:
                skipped += 1
                continue
            if with_telemetry or event.kind != "telemetry.iteration":
                events.append(event)
    return events, skipped


def load_trace(path: str | Path, *, with_telemetry: bool = False) -> LoadedTrace:
    """Every event of the trace in time order (telemetry.iteration left out unless asked for).

    Parquet files and directories (collector/trace.py's format) go through its reader, which refuses
    a file of another format version with a message; anything else is read as JSON lines."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        events, skipped = _read_parquet(path, with_telemetry)
    else:
        events, skipped = _read_json_lines(path, with_telemetry)
    events.sort(key=lambda e: e.time_s)
    return LoadedTrace(events, skipped, str(path))


def load_bus(bus_factory: Callable[[], Bus]) -> LoadedTrace:
    """This console's bus, from its beginning, without per-rank telemetry (too large to replay here)."""
    bus = bus_factory()
    group = "ui-replay-" + uuid.uuid4().hex[:8]
    stream = EventStream(bus, group, [topics.ANALYTICS, topics.CONTROL, topics.TRUTH],
                         on_assign=lambda tps: {tp: 0 for tp in tps})
    events: list[Envelope] = []
    try:
        while True:
            batch = stream.poll(50_000, 0.05)
            events.extend(d.event for d in batch)
            if stream.last_polled == 0:
                break
    finally:
        stream.close()
        bus.close()
    events.sort(key=lambda e: e.time_s)
    return LoadedTrace(events, 0, "bus")
