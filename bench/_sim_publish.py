"""``resihp bench sim --publish``: seconds to build and publish one step of a simulated job.

Per backend and publisher count: the scenario's engine (``healthy_100k``: 99,968 ranks) stepped
open loop as ``resihp simulate --publish --publishers N`` runs it (trainer/sim/publishers.py), each
step timed from the engine's step to the last record on the bus (a publish returns once the log
holds it durably, or Kafka acknowledged it with acks=all). The first step (the plan, the first
heartbeats of every rank) is left out; every later step's time is listed as min / median / max,
so the steps that carry a heartbeat of every rank (one in five at a ~1.9 s step) show as the max.

Beside them, the raw client on the same bytes: one step's records (rank reports and heartbeats as
published) inserted into a SQLite table of the embedded log's shape in one transaction, or sent
by kafka-python's producer alone with the bus's settings, from one process. That is the floor a
single producer meets; several publishers may go under it where the library's own work (not the
disk or the broker) is what limits it.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench._broker import kafka_bootstrap


def _engine(scenario: str, wire_owns_all: bool):
    from trainer.sim.engine import SimEngine
    from trainer.sim.publishers import parent_wire, whole_job_wire
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(scenario)
    engine = SimEngine(sc.sim_config(), sc.all_faults())
    engine.rank_wire = whole_job_wire(engine) if wire_owns_all else parent_wire(engine)
    return engine, sc


def _steps(engine, bus, publishers, steps: int) -> list[float]:
    """Seconds per step, the first (plan and first heartbeats) left out."""
    from trainer.sim.publishers import run_split_open_loop

    out = []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        run_split_open_loop(engine, bus, publishers, iterations=1)
        if k:
            out.append(time.perf_counter() - t0)
    return out


def measure(scenario: str, spec, publishers: int, steps: int) -> dict:
    from trainer.sim.publishers import SplitPublisher

    engine, sc = _engine(scenario, publishers == 1)
    with contextlib.closing(spec.open()) as bus:
        if publishers == 1:
            times = _steps(engine, bus, None, steps)
        else:
            with SplitPublisher(engine.config, sc.all_faults(), spec, publishers) as split:
                times = _steps(engine, bus, split, steps)
    return {"publishers": publishers, "min_s": round(min(times), 3), "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3), "steps": len(times), "ranks": engine.config.cluster.gpus}


def one_step_records(scenario: str) -> list:
    """The ranks' records of the job's second step, as published (a step without heartbeats)."""
    engine, _ = _engine(scenario, True)
    for _ in range(2):
        engine.step()
        records = engine.rank_wire.take()
    return records


def raw_sqlite_s(records: list, directory: str) -> float:
    import sqlite3

    conn = sqlite3.connect(Path(directory) / "raw.sqlite", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # the embedded log's default (RESIHP_EMBEDDED_SYNC)
    conn.execute("CREATE TABLE log (offset INTEGER PRIMARY KEY, key BLOB, value BLOB NOT NULL, ts REAL NOT NULL)")
    t0 = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    now = time.time()
    conn.executemany("INSERT INTO log (offset, key, value, ts) VALUES (?, ?, ?, ?)",
                     ((i, m.key, m.value, now) for i, m in enumerate(records)))
    conn.execute("COMMIT")
    took = time.perf_counter() - t0
    conn.close()
    return took


def raw_kafka_s(records: list, bootstrap: str) -> float:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from collector import topics
    from collector.kafka_bus import PRODUCER_SETTINGS

    topic = f"bench{uuid.uuid4().hex[:8]}.raw"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, topics.PARTITIONS[topics.TELEMETRY], 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER_SETTINGS)  # the bus's settings
    producer.send(topic, value=b"warm-up").get(timeout=30)
    t0 = time.perf_counter()
    futures = [producer.send(topic, key=m.key, value=m.value) for m in records]
    producer.flush()
    for f in futures:
        f.get()
    took = time.perf_counter() - t0
    producer.close()
    return took


def run(args) -> list[dict]:
    from trainer.sim.publishers import BusSpec

    counts = [int(x) for x in args.publishers.split(",")]
    backends = ["embedded", "kafka"] if args.backend == "both" else [args.backend]
    rows: list[dict] = []
    records = one_step_records(args.scenario)
    size_mb = sum(len(m.value) for m in records) / 1e6
    with contextlib.ExitStack() as stack:
        bootstrap = kafka_bootstrap(stack, args.bootstrap) if "kafka" in backends else ""
        for backend in backends:
            for rnd in range(args.rounds):
                for n in counts:
                    if backend == "embedded":
                        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="resihp-bench-pub-"))
                        spec = BusSpec("embedded", path=f"{directory}/bus.sqlite")
                    else:
                        spec = BusSpec("kafka", bootstrap=bootstrap, namespace=f"bench{uuid.uuid4().hex[:8]}.")
                    rows.append({"backend": backend, "round": rnd, **measure(args.scenario, spec, n, args.steps)})
                with tempfile.TemporaryDirectory(prefix="resihp-bench-raw-") as directory:
                    raw = raw_sqlite_s(records, directory) if backend == "embedded" else raw_kafka_s(records, bootstrap)
                rows.append({"backend": backend, "round": rnd, "publishers": "raw client", "min_s": round(raw, 3),
                             "median_s": round(raw, 3), "max_s": round(raw, 3), "steps": 1,
                             "ranks": len(records)})
    print(f"{'backend':<9} {'round':>5} {'publishers':>11} {'min s':>7} {'median s':>9} {'max s':>7} {'steps':>6}")
    for r in rows:
        print(f"{r['backend']:<9} {r['round']:>5} {r['publishers']!s:>11} {r['min_s']:>7.3f} {r['median_s']:>9.3f} "
              f"{r['max_s']:>7.3f} {r['steps']:>6}")
    print(f"({args.scenario}: {rows[0]['ranks']:,} ranks; one step's rank records {len(records):,}, {size_mb:,.0f} MB; "
          "seconds from the engine's step to the last record on the bus, the first step left out; raw client: "
          "those records through SQLite or kafka-python alone, one process)")
    return rows
