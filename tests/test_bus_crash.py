"""Crash safety with real processes and real kills (SIGKILL), on both backends.

- A publisher killed right after ``publish`` returned: everything it was told was durable is there.
- The analytics consumer killed again and again mid-stream: after a final clean run its DuckDB
  table holds every published event exactly once (offsets live in the same transaction as rows).
- A full disk under the embedded bus fails the publish with SQLite's own error and loses nothing
  already written.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest

from collector import topics
from collector.bus import RawMessage
from collector.events import Coords, EventFactory, Heartbeat, RankIteration
from collector.stream import EventStream

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

ROOT = Path(__file__).resolve().parent.parent


def child_env(spec: dict) -> dict[str, str]:
    env = dict(os.environ)
    env["RESIHP_KAFKA_NAMESPACE"] = spec["namespace"]
    env["PYTHONPATH"] = str(ROOT)
    return env


def bus_args(spec: dict) -> list[str]:
    if spec["backend"] == "embedded":
        return ["--bus", "embedded", "--bus-path", spec["path"]]
    return ["--bus", "kafka", "--bootstrap", spec["bootstrap"]]


PUBLISHER = textwrap.dedent(
    """
    import sys, json
    from collector.bus import open_bus
    from collector.events import EventFactory, Heartbeat
    spec = json.loads(sys.argv[1])
    bus = open_bus(spec["backend"], path=spec["path"], bootstrap=spec["bootstrap"])
    f = EventFactory("job-crash", "rank-0")
    i = 0
    while True:
        batch = [f.make(Heartbeat(rank=0, epoch=0, iteration=i + k, interval_s=1.0)) for k in range(50)]
        bus.publish(batch)
        i += 50
        print(json.dumps([e.id for e in batch]), flush=True)
    """
)


def test_a_killed_publisher_loses_nothing_it_was_told_was_durable(bus_factory):
    spec = bus_factory.spec
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, json.dumps(spec)],
        stdout=subprocess.PIPE, text=True, env=child_env(spec), cwd=ROOT,
    )
    assert proc.stdout is not None
    acked: list[str] = []
    try:
        for _ in range(20):  # 20 acknowledged batches, then kill without warning
            line = proc.stdout.readline()
            assert line, f"publisher exited early with {proc.wait()}"
            acked.extend(json.loads(line))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    bus = bus_factory()
    seen: set[str] = set()
    with EventStream(bus, "g-after-kill", [topics.TELEMETRY]) as stream:
        for _ in range(60):
            seen.update(d.event.id for d in stream.poll(10_000, 1.0))
            if seen.issuperset(acked):
                break
    assert len(acked) == 1000
    assert seen.issuperset(acked)


def test_analytics_killed_mid_stream_resumes_without_loss_or_duplicates(bus_factory, tmp_path):
    spec = bus_factory.spec
    bus = bus_factory()
    factories = [EventFactory("job-crash", f"rank-{r}") for r in range(8)]
    published: list[str] = []
    for it in range(150):
        batch = [
            f.make(RankIteration(epoch=0, iteration=it, rank=r, coords=Coords(tp=0, pp=r % 2, dp=r // 2),
                                 wall_s=1.0, chunks=[]))
            for r, f in enumerate(factories)
        ]
        batch.append(factories[0].make(Heartbeat(rank=0, epoch=0, iteration=it, interval_s=1.0)))
        bus.publish(batch)
        published.extend(e.id for e in batch)

    db = tmp_path / "analytics.duckdb"
    cmd = [sys.executable, "-m", "resihp.cli", "analytics", *bus_args(spec), "--db", str(db), "--no-detect",
           "--batch", "13", "--exit-when-idle", "3", "--instance-id", "analytics-crash-test", "--log-batches"]
    rng = random.Random(7)
    for kill in range(4):
        # Let it commit a few transactions, then SIGKILL it at a random instant: before, inside or
        # after the next transaction.
        proc = subprocess.Popen(cmd, env=child_env(spec), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        assert proc.stderr is not None
        committed = 0
        while committed < 3:
            line = proc.stderr.readline()
            assert line, f"the consumer exited before it was killed (kill {kill}): {proc.wait()}"
            committed += line.startswith('{"event": "batch"')
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = subprocess.run(cmd, env=child_env(spec), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]

    conn = duckdb.connect(str(db), read_only=True)
    try:
        rows = conn.execute("SELECT count(*), count(DISTINCT id) FROM events").fetchone()
        ids = {r[0] for r in conn.execute("SELECT id FROM events").fetchall()}
    finally:
        conn.close()
    assert rows == (len(published), len(published)), f"rows, distinct ids = {rows}; published {len(published)}"
    assert ids == set(published)


def test_a_full_disk_on_the_embedded_bus_fails_the_publish_with_its_own_error_and_keeps_the_log(tmp_path):
    """SQLite rolls a transaction back itself when the disk is full (here: a page limit); the
    publish must fail with that error, not with a second ROLLBACK's "no transaction is active",
    and leave the log as it was and usable."""
    from collector.embedded import EmbeddedBus, _table

    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish_raw([RawMessage("t", None, b"first")])
        (pages,) = bus._conn.execute("PRAGMA page_count").fetchone()
        (page_size,) = bus._conn.execute("PRAGMA page_size").fetchone()
        bus._conn.execute(f"PRAGMA max_page_count = {pages + 2}")
        with pytest.raises(sqlite3.OperationalError, match="full"):  # a record of 3 pages does not fit in 2
            bus.publish_raw([RawMessage("t", None, b"lost with the batch"),
                             RawMessage("t", None, b"x" * (3 * page_size))])
        bus._conn.execute("PRAGMA max_page_count = 1073741823")
        bus.publish_raw([RawMessage("t", None, b"second")])
        values = [v for (v,) in bus._conn.execute(f"SELECT value FROM {_table('t')} ORDER BY offset")]
    assert values == [b"first", b"second"]
