"""Killing ``resihp analytics`` with SIGKILL at any instant and restarting it yields exactly the
chunk tables of one clean run, on both bus backends (offsets live in the same DuckDB transaction)."""

from __future__ import annotations

import pytest
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb

from analytics.projections.control_tables import ControlProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.projector import Projector
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.events import Chunk, CommWait, Coords, EventFactory, Heartbeat, IterationSummary, RankIteration

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

TABLES = {
    "chunks": "job, epoch, iteration, rank, kind, microbatch, virtual_stage",
    "rank_iterations": "job, epoch, iteration, rank",
    "iterations": "job, epoch, iteration",
    "heartbeats": "job, rank, iteration, time_s",
    "ranks": "job, epoch, rank",
}


def _telemetry(iterations: int, ranks: int) -> list:
    rng = random.Random(7)
    events = []
    for it in range(iterations):
        for r in range(ranks):
            f = EventFactory("killjob", f"rank-{r}", first_seq=it * 2)
            chunks = []
            for m in range(4):
                lens = [rng.randint(64, 2048) for _ in range(3)]
                for kind in ("F", "B"):
                    chunks.append(Chunk(kind=kind, microbatch=m, tokens=sum(lens), seq_lens=lens,
                                        start_s=0.05 * m, duration_s=rng.uniform(0.01, 0.02)))
            events.append(f.make(RankIteration(
                epoch=0, iteration=it, rank=r, node=r // 8, coords=Coords(tp=r % 2, pp=(r // 2) % 2, dp=r // 4),
                wall_s=1.0, chunks=chunks,
                comm=[CommWait(op="pp_send", peer=(r + 2) % ranks, microbatch=0, start_s=0.0, duration_s=0.001)],
            ), time_s=1000.0 + it))
            events.append(f.make(Heartbeat(rank=r, epoch=0, iteration=it, interval_s=1.0), time_s=1000.0 + it))
        events.append(EventFactory("killjob", "launcher", first_seq=it).make(
            IterationSummary(epoch=0, iteration=it, tokens=1000, wall_s=1.0), time_s=1000.0 + it))
    return events


def _command(spec: dict, db: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "resihp.cli", "analytics", "--bus", spec["backend"], "--db", str(db),
           "--batch", "25", "--exit-when-idle", "1.5", "--no-detect", "--log-batches"]
    if spec["backend"] == "embedded":
        cmd += ["--bus-path", spec["path"]]
    else:
        cmd += ["--bootstrap", spec["bootstrap"], "--instance-id", "killed-0"]
    env = dict(os.environ, RESIHP_KAFKA_NAMESPACE=spec["namespace"])
    return cmd, env


def _snapshot(db: Path) -> dict[str, list[tuple]]:
    with duckdb.connect(str(db), read_only=True) as conn:
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY {key}").fetchall() for t, key in TABLES.items()}


def test_sigkill_mid_batch_and_restart_gives_the_tables_of_a_clean_run(bus_factory, tmp_path: Path) -> None:
    spec = bus_factory.spec
    events = _telemetry(iterations=40, ranks=8)
    with bus_factory() as bus:
        bus.publish(events)
    total_chunks = 40 * 8 * 8

    killed_db = tmp_path / "killed.duckdb"
    cmd, env = _command(spec, killed_db)
    partial_counts = []
    rng = random.Random(3)
    for _ in range(3):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        wanted = rng.randint(1, 6)  # committed transactions before the kill, so it lands mid-stream
        seen = 0
        for line in proc.stderr:
            if b'"event": "batch"' in line:
                seen += 1
                if seen >= wanted:
                    break
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside the next batch
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        with duckdb.connect(str(killed_db), read_only=True) as conn:
            row = conn.execute("SELECT count(*) FROM chunks").fetchone()
            assert row is not None
            partial_counts.append(row[0])
    assert any(0 < c < total_chunks for c in partial_counts), f"no kill landed mid-stream: {partial_counts}"
    finished = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()[-2000:]

    clean_db = tmp_path / "clean.duckdb"  # one uninterrupted run, in this process
    with bus_factory() as bus:
        projector = Projector(bus, clean_db, "clean", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                              [EventLogProjection(), TelemetryProjection(), ControlProjection()])
        projector.run(idle_exit_s=1.5)
        projector.close()

    killed, clean = _snapshot(killed_db), _snapshot(clean_db)
    assert len(clean["chunks"]) == total_chunks
    assert len(clean["heartbeats"]) == 40 * 8
    for table in TABLES:
        assert len(killed[table]) == len(clean[table]), f"table {table}: {len(killed[table])} rows after kills {partial_counts}, {len(clean[table])} clean"
        assert killed[table] == clean[table], f"table {table} differs after kills {partial_counts}"


def test_sigint_mid_stream_stops_at_a_step_boundary_without_a_traceback_and_a_restart_finishes_the_log(
        tmp_path: Path) -> None:
    """SIGINT is ``resihp analytics``'s clean stop: the loop ends after the step it is in, with what
    it read committed, exit 130. It must not reach DuckDB as an interrupt (which dies with "Query
    interrupted" mid-transaction); a restart then reads the rest, and the tables are one clean run's."""
    from collector.embedded import EmbeddedBus

    spec = {"backend": "embedded", "path": str(tmp_path / "bus.sqlite"), "namespace": ""}
    with EmbeddedBus(spec["path"]) as bus:
        bus.publish(_telemetry(iterations=40, ranks=8))
    db = tmp_path / "stopped.duckdb"
    cmd, env = _command(spec, db)
    stops = []
    for wanted in (2, 5):  # signalled while it projects (its batches are 25 records)
        # SIGINT at its default in the child, whatever this run inherited (a shell's background job,
        # `make test`'s other stream, ignores it, and a process started with it ignored keeps it so)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert proc.stderr is not None
        seen, said = 0, list[bytes]()
        for line in proc.stderr:
            said.append(line)
            seen += b'"event": "batch"' in line
            if seen >= wanted:
                break
        proc.send_signal(signal.SIGINT)
        said += proc.stderr.readlines()
        proc.wait(timeout=60)
        proc.stderr.close()
        stops.append((proc.returncode, b"".join(said)))
    for code, output in stops:
        assert code == 130 and b"Traceback" not in output, output.decode()[-3000:]
    finished = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()[-2000:]
    with duckdb.connect(str(db), read_only=True) as conn:
        chunks = conn.execute("SELECT count(*), count(DISTINCT (iteration, rank, kind, microbatch)) FROM chunks").fetchone()
    assert chunks == (40 * 8 * 8, 40 * 8 * 8)
