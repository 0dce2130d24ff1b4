"""Bus throughput and latency: trainer telemetry through each backend into a consumer.

The load is what the trainer sends: one ``telemetry.iteration`` message per rank per iteration,
each holding a forward and a backward chunk for every micro-batch with its packed sequence lengths.
A producer (this process) publishes a batch per iteration — all ranks' messages — and a consumer
(a second process, as in production) decodes and validates every record through ``EventStream``.

Beside each backend, its raw client on the same bytes: the encoded events, published and read back
by kafka-python's producer and consumer alone, or inserted into and selected from a SQLite table of
the embedded log's shape alone, with no decoding. ``ratio`` is the platform's rate over the raw
client's, measured in the same run: a slowdown of ours shows on any machine as a falling ratio.

Per backend:
- warm-up: one short throughput phase of the bus and one of its raw client, not counted (a broker
  the bench started answers its first seconds from a cold JVM);
- throughput, ``--repeats`` rounds of the bus then its raw client: publish everything as fast as
  possible; chunk records per second from the first publish to the last record decoded (read, for
  the raw client) by the consumer. Medians are reported, and the median of the rounds' ratios;
- latency: publish at half the measured throughput; publish-to-consume latency per message
  (``time_s`` stamped at publish, read at decode — one machine, one clock), p50 and p99.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
import uuid
from pathlib import Path

from bench._broker import kafka_bootstrap
from collector import topics
from collector.codec import encode
from collector.events import Chunk, ChunkKind, Coords, EventFactory, RankIteration
from collector.topics import PartitionKeys, replica_partition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["embedded", "kafka", "both"], default="both")
    parser.add_argument("--ranks", type=int, default=64, help="ranks publishing (one message each per iteration)")
    parser.add_argument("--microbatches", type=int, default=16, help="micro-batches per iteration (2 chunks each)")
    parser.add_argument("--iterations", type=int, default=200, help="iterations in the throughput phase")
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="length of the paced latency phase")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: the broker up on the default data dir, else one started for the bench and stopped after)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="throughput rounds of the bus and its raw client, alternately (medians reported)")
    parser.add_argument("--path", default=None, help="folder for the embedded logs (default: a fresh temporary one)")


def make_payloads(ranks: int, microbatches: int, seed: int = 0) -> list[RankIteration]:
    """One iteration's telemetry for every rank, with realistic packed sequence lengths."""
    rng = random.Random(seed)
    out = []
    for r in range(ranks):
        chunks, t = [], 0.0
        for m in range(microbatches):
            lens, budget = [], 8192
            while budget > 64:
                n = min(budget, int(rng.paretovariate(1.2) * 256))
                lens.append(n)
                budget -= n
            for kind, dur in ((ChunkKind.FORWARD, 0.011), (ChunkKind.BACKWARD, 0.023)):
                chunks.append(Chunk(kind=kind, microbatch=m, tokens=sum(lens), seq_lens=lens, start_s=t, duration_s=dur))
                t += dur
        out.append(RankIteration(epoch=0, iteration=0, rank=r, node=r // 8,
                                 coords=Coords(tp=r % 2, pp=(r // 2) % 4, dp=r // 8), wall_s=t, chunks=chunks))
    return out


def _open(spec: dict):
    from collector.bus import open_bus

    if spec["backend"] == "kafka":
        from collector.kafka_bus import KafkaBus

        return KafkaBus(spec["bootstrap"], namespace=spec["namespace"])
    return open_bus("embedded", path=spec["path"])


def _consume(spec: dict, expect: int, ready, results) -> None:
    """Consumer process: decode ``expect`` messages, report when it finished and the latencies. A
    spawned interpreter starts with CPython's collector settings; every ``resihp`` process runs with
    the platform's (collector/gc_policy.py), and so does this one, or it measures another program."""
    from collector.gc_policy import tune_for_streaming
    from collector.stream import EventStream

    _child_of(spec["parent"])
    tune_for_streaming()

    bus = _open(spec)
    stream = EventStream(bus, f"bench-{uuid.uuid4().hex[:8]}", [topics.TELEMETRY])
    stream.poll(1, 0.5)  # join the group before the producer starts
    stream.seek_to_beginning()
    ready.set()
    seen, latencies_ms = 0, []
    while seen < expect:
        batch = stream.poll(20_000, 1.0)
        now = time.time()
        for d in batch:
            latencies_ms.append((now - d.event.time_s) * 1000.0)
        seen += len(batch)
    results.put((time.time(), latencies_ms))
    stream.close()
    bus.close()


def _child_of(parent: int) -> None:
    """A consumer waits for records only its parent publishes: it dies with the parent, however the
    parent ends (a daemon process outlives a SIGKILLed one)."""
    from resihp.demo.guard import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL, parent)


def _phase(spec: dict, payloads: list[RankIteration], iterations: int, rate_msgs_per_s: float | None) -> dict:
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    expect = iterations * len(payloads)
    consumer = ctx.Process(target=_consume, args=({**spec, "parent": os.getpid()}, expect, ready, results),
                           daemon=True)
    consumer.start()
    if not ready.wait(120):
        raise RuntimeError("the benchmark consumer did not start")
    bus = _open(spec)
    factories = [EventFactory("bench", f"rank-{p.rank}") for p in payloads]
    start = time.time()
    for it in range(iterations):
        bus.publish([f.make(p) for f, p in zip(factories, payloads)])
        if rate_msgs_per_s:
            due = start + (it + 1) * len(payloads) / rate_msgs_per_s
            time.sleep(max(0.0, due - time.time()))
    finished, latencies_ms = results.get(timeout=600)
    consumer.join(30)
    bus.close()
    chunks = expect * len(payloads[0].chunks)
    latencies_ms.sort()
    return {
        "records_per_s": chunks / (finished - start),
        "messages_per_s": expect / (finished - start),
        "p50_ms": latencies_ms[len(latencies_ms) // 2],
        "p99_ms": latencies_ms[min(len(latencies_ms) - 1, int(len(latencies_ms) * 0.99))],
    }


def measure(backend: str, args: argparse.Namespace, bootstrap: str = "") -> dict:
    """Throughput of the bus and of its raw client, ``repeats`` times each, alternately, after a
    warm-up of both that counts for nothing; then the bus's latency. The warm-up matters on Kafka:
    a broker the bench starts for itself answers its first seconds from a cold JVM, which the
    phase measured first (the bus's) would otherwise pay alone."""
    import statistics
    import tempfile

    repeats = max(1, getattr(args, "repeats", 1))
    folder = Path(args.path or tempfile.mkdtemp(prefix="resihp-bench-"))
    namespace = f"bench{uuid.uuid4().hex[:8]}."

    def spec(name: str) -> dict[str, str]:  # a fresh log (or namespace) for each phase
        return {"backend": backend, "path": str(folder / f"{name}.sqlite") if backend == "embedded" else "",
                "bootstrap": bootstrap, "namespace": f"{namespace}{name}."}

    payloads = make_payloads(args.ranks, args.microbatches)
    events = [EventFactory("bench", f"rank-{p.rank}").make(p) for p in payloads]
    keys = PartitionKeys()  # the keys, and so the partitions, the bus gives these records
    records = [(encode(e), keys.key(e.job, e.source, e.kind, e.payload)) for e in events]
    chunks_per_message = len(payloads[0].chunks)
    warm_iterations = max(1, args.iterations // 4)
    _phase(spec("warm"), payloads, warm_iterations, None)
    _raw_phase(spec("warm-raw"), records, warm_iterations, chunks_per_message)
    ours, raw, throughput = [], [], None
    for r in range(repeats):
        throughput = _phase(spec(f"bus{r}"), payloads, args.iterations, None)
        ours.append(throughput["records_per_s"])
        raw.append(_raw_phase(spec(f"raw{r}"), records, args.iterations, chunks_per_message))
    assert throughput is not None
    messages_per_s = statistics.median(ours) / chunks_per_message
    paced_iterations = max(1, int(args.latency_seconds * messages_per_s / 2 / args.ranks))
    latency = _phase(spec("latency"), payloads, paced_iterations, messages_per_s / 2)
    return {
        "backend": backend,
        "records_per_s": round(statistics.median(ours)),
        "raw_records_per_s": round(statistics.median(raw)),
        # each round's two phases ran back to back: their ratios, not the medians', are like for like
        "ratio_to_raw": round(statistics.median(o / w for o, w in zip(ours, raw)), 3),
        "rounds": [[round(o), round(w)] for o, w in zip(ours, raw)],  # (ours, raw client) chunk records/s
        "records_per_s_range": [round(min(ours)), round(max(ours))],
        "raw_records_per_s_range": [round(min(raw)), round(max(raw))],
        "repeats": repeats,
        "messages_per_s": round(messages_per_s),
        "p50_ms": round(latency["p50_ms"], 2),
        "p99_ms": round(latency["p99_ms"], 2),
        "chunks_per_message": 2 * args.microbatches,
    }


RAW_TOPIC_PARTITIONS = topics.PARTITIONS[topics.TELEMETRY]


def _raw_consume(spec: dict, expect: int, ready, results) -> None:  # ready, results: multiprocessing's Event, Queue
    """The raw client's consumer process: read ``expect`` records' bytes, decode nothing (under the
    same collector settings as the bus's consumer)."""
    from collector.gc_policy import tune_for_streaming

    _child_of(spec["parent"])
    tune_for_streaming()
    seen = 0
    if spec["backend"] == "kafka":
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(spec["topic"], bootstrap_servers=spec["bootstrap"], group_id=None,
                                 auto_offset_reset="earliest", max_partition_fetch_bytes=8 << 20)
        consumer.poll(timeout_ms=500)
        ready.set()
        while seen < expect:
            seen += sum(len(rs) for rs in consumer.poll(timeout_ms=1000, max_records=20_000).values())
        consumer.close()
    else:
        import sqlite3

        conn = sqlite3.connect(spec["path"])
        ready.set()
        while seen < expect:
            rows = conn.execute("SELECT offset, value FROM log WHERE offset >= ? ORDER BY offset LIMIT 20000",
                                (seen,)).fetchall()
            seen += len(rows)
            if not rows:
                time.sleep(0.001)
        conn.close()
    results.put(time.time())


def _raw_phase(spec: dict, records: list[tuple[bytes, bytes]], iterations: int, chunks_per_message: int) -> float:
    """Chunk records per second through the raw client alone: the same bytes under the same keys, in
    the same partitions (``replica_partition``'s, as the bus's producer places a replica's
    reports) and the same batches."""
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    raw = {**spec, "parent": os.getpid()}
    if spec["backend"] == "kafka":
        from kafka import KafkaProducer
        from kafka.admin import KafkaAdminClient, NewTopic

        raw["topic"] = f"{spec['namespace']}raw"
        admin = KafkaAdminClient(bootstrap_servers=spec["bootstrap"])
        admin.create_topics([NewTopic(raw["topic"], RAW_TOPIC_PARTITIONS, 1)])
        admin.close()
    else:
        import sqlite3

        from collector.embedded import PAGE_SIZE

        conn = sqlite3.connect(raw["path"], isolation_level=None)
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # the embedded log's page size
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # the embedded log's default (RESIHP_EMBEDDED_SYNC)
        conn.execute("CREATE TABLE log (offset INTEGER PRIMARY KEY, key BLOB, value BLOB NOT NULL, ts REAL NOT NULL)")
    consumer = ctx.Process(target=_raw_consume, args=(raw, iterations * len(records), ready, results), daemon=True)
    consumer.start()
    if not ready.wait(120):
        raise RuntimeError("the raw client's consumer did not start")
    start = time.time()
    if spec["backend"] == "kafka":
        from collector.kafka_bus import PRODUCER_SETTINGS

        producer = KafkaProducer(bootstrap_servers=spec["bootstrap"], **PRODUCER_SETTINGS)  # the bus's settings
        for _ in range(iterations):
            futures = [producer.send(raw["topic"], value=v, key=k, partition=replica_partition(k, RAW_TOPIC_PARTITIONS))
                       for v, k in records]
            producer.flush()
            for f in futures:
                f.get()
        producer.close()
    else:
        offset = 0
        for _ in range(iterations):
            conn.execute("BEGIN IMMEDIATE")
            now = time.time()
            conn.executemany("INSERT INTO log (offset, key, value, ts) VALUES (?, ?, ?, ?)",
                             ((offset + i, k, v, now) for i, (v, k) in enumerate(records)))
            conn.execute("COMMIT")
            offset += len(records)
        conn.close()
    finished = results.get(timeout=600)
    consumer.join(30)
    return iterations * len(records) * chunks_per_message / (finished - start)


def run(args: argparse.Namespace) -> int:
    backends = ["embedded", "kafka"] if args.backend == "both" else [args.backend]
    with contextlib.ExitStack() as stack:
        bootstrap = kafka_bootstrap(stack, args.bootstrap) if "kafka" in backends else ""
        rows = [measure(b, args, bootstrap) for b in backends]
    print(f"{'backend':<10} {'chunk records/s':>16} {'raw client':>11} {'ratio':>6} {'messages/s':>11} "
          f"{'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['backend']:<10} {r['records_per_s']:>16,} {r['raw_records_per_s']:>11,} {r['ratio_to_raw']:>6.2f} "
              f"{r['messages_per_s']:>11,} {r['p50_ms']:>8} {r['p99_ms']:>8}")
    for r in rows:
        (lo, hi), (raw_lo, raw_hi) = r["records_per_s_range"], r["raw_records_per_s_range"]
        print(f"{r['backend']}: {r['repeats']} rounds, bus {lo:,}–{hi:,}, raw client {raw_lo:,}–{raw_hi:,} chunk records/s")
    print(f"({args.ranks} ranks × {args.microbatches} micro-batches × F/B = {2 * args.microbatches} chunks per message; "
          f"medians of the rounds, after a warm-up of both; ratio: the median of each round's ours over the raw "
          f"client's (the same bytes through kafka-python or SQLite alone, no decoding); latency measured at half "
          f"the throughput)")
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"runs": rows}))
    return 0
