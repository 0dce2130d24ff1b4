"""Traces: Parquet with the envelope's columns, read back intact, replayed byte-identically."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.events import EventFactory, Heartbeat
from collector.topics import ALL_TOPICS
from collector.trace import SCHEMA, TraceReader, TraceWriter, read_trace, replay


def _events(n: int, dt: float = 1.0):
    f = EventFactory("job-t", "rank-0")
    return [f.make(Heartbeat(rank=0, epoch=0, iteration=i, interval_s=dt), time_s=1000.0 + i * dt) for i in range(n)]


def test_trace_round_trips_events_and_is_plain_parquet(tmp_path: Path) -> None:
    events = _events(25)
    with TraceWriter(tmp_path / "t.parquet", rows_per_group=10) as w:
        w.write(events)
    assert read_trace(tmp_path / "t.parquet") == events
    table = pq.read_table(tmp_path / "t.parquet")  # any Parquet reader sees the envelope columns
    assert table.column_names == SCHEMA.names
    assert table.column("kind").to_pylist() == ["telemetry.heartbeat"] * 25
    assert table.column("topic")[0].as_py() == "resihp.telemetry"
    assert table.column("value")[3].as_py().encode() == encode(events[3])


def test_trace_directory_is_read_in_file_order(tmp_path: Path) -> None:
    events = _events(6)
    with TraceWriter(tmp_path / "trace") as w:
        w.write(events[:3])
    with TraceWriter(tmp_path / "trace" / "part-00001.parquet") as w:
        w.write(events[3:])
    assert read_trace(tmp_path / "trace") == events
    assert len(TraceReader(tmp_path / "trace")) == 6


def test_a_parquet_file_that_is_not_a_trace_is_refused_with_the_reason(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="not a ResiHP trace"):
        TraceReader(tmp_path / "other.parquet")
    with pytest.raises(FileNotFoundError, match="resihp simulate"):
        TraceReader(tmp_path / "missing.parquet")


def test_replay_as_fast_as_possible_publishes_identical_bytes(tmp_path: Path) -> None:
    events = _events(40)
    with TraceWriter(tmp_path / "t.parquet") as w:
        w.write(events)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        assert replay(tmp_path / "t.parquet", bus, speed=0) == 40
        with bus.consumer("check", list(ALL_TOPICS)) as c:
            got = c.poll(timeout_s=0.5)
    assert [r.value for r in got] == [encode(e) for e in events]
    assert got[0].key == b"job-t/rank-0"


@pytest.mark.parametrize("speed,expected_wait_s", [(1.0, 9.0), (3.0, 3.0)])
def test_replay_keeps_the_original_pace_scaled_by_speed(tmp_path: Path, speed: float, expected_wait_s: float) -> None:
    with TraceWriter(tmp_path / "t.parquet") as w:
        w.write(_events(10, dt=1.0))  # spans 9 s
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        sent = replay(tmp_path / "t.parquet", bus, speed=speed, sleep=sleep, clock=lambda: now[0])
    assert sent == 10
    assert sum(slept) == pytest.approx(expected_wait_s)
    assert len(slept) == 9
