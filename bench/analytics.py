"""Analytics cost: chunk records/s into DuckDB, and detector work per iteration at 1k and 16k ranks.

Ingestion: RankIteration events (32 chunks each, with packed sequence lengths, and the waits a
pipeline rank records) go through the
chunks/rank_iterations/ranks projection in one Arrow batch per transaction, exactly as
``resihp analytics`` applies them (decoding from bytes is timed apart, it is the bus's cost).
Detector: synthetic TP8 layouts (1,024 ranks = PP8·DP16, 16,384 ranks = PP16·DP128, 16
micro-batches, F and B chunks); per iteration, building the frame from the events and scoring it
(cost-model predict + fit, CUSUMs, localisation, schedule prediction, cost-model publication) are
timed separately. Reports are in the wire's column form (``RankIteration.chunk_table`` and
``comm_table``). Wire: a report's bytes and decode time as binary columns (schema 5) with its
fixed header (wire format 2) and with a JSON header (format 1), as JSON columns (schema 4) and with
its communications as objects (schema 3), the same reports.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _reports(tp: int, pp: int, dp: int, microbatches: int, iteration: int, seed: int) -> list:
    """One iteration's reports of a TP·PP·DP job, as a pipeline rank records them: a forward and a
    backward chunk per micro-batch, the wait for each one's input from the neighbouring stage
    (``pp_recv``; none into stage 0's forwards nor the last stage's backwards) and the DP
    all-reduce of its gradients."""
    from collector.events import Chunk, ChunkKind, ChunkTable, CommOp, CommTable, CommWait, Coords, RankIteration

    rng = np.random.default_rng([seed, iteration])
    out = []
    for d in range(dp):
        lens = [list(rng.integers(64, 2048, size=rng.integers(2, 8))) for _ in range(microbatches)]
        for s in range(pp):
            for t in range(tp):
                rank = (d * pp + s) * tp + t
                noise = np.exp(rng.normal(0, 0.03, size=2 * microbatches))
                chunks, waits = [], []
                for m, ls in enumerate(lens):
                    n, s2 = sum(ls), sum(x * x for x in ls)
                    base = 2e-6 * n + 4e-11 * s2 + 1e-3
                    for j, (kind, mult) in enumerate(((ChunkKind.FORWARD, 1.0), (ChunkKind.BACKWARD, 2.0))):
                        start = 0.004 * (2 * m + j)
                        chunks.append(Chunk.model_construct(
                            kind=kind, microbatch=m, virtual_stage=0, tokens=n, seq_lens=[int(x) for x in ls],
                            start_s=start, duration_s=float(base * mult * noise[2 * m + j])))
                        peer_stage = s - 1 if j == 0 else s + 1
                        if 0 <= peer_stage < pp:
                            waits.append(CommWait.model_construct(
                                op=CommOp.PP_RECV, peer=(d * pp + peer_stage) * tp + t, microbatch=m, bytes=None,
                                start_s=max(0.0, start - 5e-4), duration_s=float(2e-4 * noise[2 * m + j]),
                                includes_wait=False, group=None))
                waits.append(CommWait.model_construct(op=CommOp.DP_ALLREDUCE, peer=None, microbatch=None,
                                                      bytes=50_000_000, start_s=0.9, duration_s=0.05,
                                                      includes_wait=False, group=None))
                out.append(RankIteration.model_construct(
                    epoch=0, iteration=iteration, rank=rank, node=rank // 8, coords=Coords(tp=t, pp=s, dp=d),
                    wall_s=1.0, chunk_table=ChunkTable.of(chunks), comm_table=CommTable.of(waits), comm=[]))
    return out


def bench_wire(reports: list) -> dict:
    """A rank report's bytes and decode time in each form a log may hold, the same reports in the
    same run: binary columns (schema 5) with a fixed header (wire format 2, what producers write)
    and with a JSON header (format 1, older logs and signed reports), JSON columns (schema 4,
    traces and older logs) and JSON with the communications as objects (schema 3, older logs)."""
    import struct

    from collector.codec import binary_record, decode, encode, encode_json, header_json
    from collector.events import EventFactory

    f = EventFactory("bench", "rank-0")
    events = [f.make(r) for r in reports]
    binary = [encode(e) for e in events]
    json_header = [binary_record(header_json(b), b[8 + struct.unpack_from("<I", b, 4)[0]:]) for b in binary]
    columns, objects = [], []
    for report, event in zip(reports, events):
        body = json.loads(encode_json(event))
        body["schema_version"] = 4
        columns.append(json.dumps(body, separators=(",", ":")).encode())
        body["schema_version"] = 3
        body["payload"].pop("comm_table", None)
        body["payload"]["comm"] = [w.model_dump(mode="json") for w in report.waits().rows()]
        objects.append(json.dumps(body, separators=(",", ":")).encode())
    out: dict = {"reports": len(reports), "waits_per_report": round(sum(len(r.waits()) for r in reports) / len(reports), 1)}
    forms = (("objects", objects), ("columns", columns), ("json_header", json_header), ("binary", binary))
    for name, records in forms:
        decode(records[0])  # warm-up
        out[name] = {"bytes": sum(len(b) for b in records) / len(records), "decode_us": float("inf")}
    for _ in range(5):  # alternating rounds, the best of each: a shared machine slows one round, not a form
        for name, records in forms:
            t0 = time.perf_counter()
            for b in records:
                decode(b)
            out[name]["decode_us"] = min(out[name]["decode_us"], 1e6 * (time.perf_counter() - t0) / len(records))
    return out


def bench_ingest(events: int, batch: int) -> dict:
    import duckdb

    from analytics.projections.tables import TelemetryProjection
    from collector.codec import decode, encode
    from collector.events import EventFactory
    from collector.stream import Delivery

    reports: list = []
    it = 0
    while len(reports) < events:
        reports += _reports(8, 4, 4, 16, it, 1)
        it += 1
    reports = reports[:events]
    f = EventFactory("bench", "rank-0")
    envelopes = [f.make(r) for r in reports]
    raw = [encode(e) for e in envelopes]
    t0 = time.perf_counter()
    decoded = [decode(b) for b in raw]
    decode_s = time.perf_counter() - t0
    deliveries = [Delivery("resihp.telemetry", 0, i, e) for i, e in enumerate(decoded)]
    chunks = sum(len(r.chunks) for r in reports)
    with tempfile.TemporaryDirectory() as tmp:
        conn = duckdb.connect(str(Path(tmp) / "bench.duckdb"))
        proj = TelemetryProjection()
        proj.create(conn)
        conn.begin()  # warm-up (lazy imports, DuckDB's first registration), rolled back
        proj.apply(conn, deliveries[:batch])
        conn.rollback()
        t0 = time.perf_counter()
        for i in range(0, len(deliveries), batch):
            conn.begin()
            proj.apply(conn, deliveries[i:i + batch])
            conn.commit()
        ingest_s = time.perf_counter() - t0
        (stored,) = conn.execute("SELECT count(*) FROM chunks").fetchall()[0]
        conn.close()
    assert stored == chunks, f"stored {stored} chunk rows, expected {chunks}"
    return {"events": len(reports), "chunks": chunks, "batch_events": batch,
            "ingest_chunks_per_s": chunks / ingest_s, "decode_chunks_per_s": chunks / decode_s}


def bench_detector(tp: int, pp: int, dp: int, microbatches: int, iterations: int) -> dict:
    from analytics.detection.detector import Detector
    from analytics.detection.frame import LayerLookup, build_frame
    from collector.events import EventFactory, PlanCurrent
    from collector.plan import Plan

    det = Detector("bench")
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4 * pp, microbatches_per_replica=microbatches)
    det.on_event(EventFactory("bench", "trainer").make(PlanCurrent(plan=plan)))  # layer-range classes, fits out
    layers = LayerLookup(plan)
    build, score = [], []
    base = [_reports(tp, pp, dp, microbatches, i, 2) for i in range(min(iterations, 3))]
    for i in range(iterations):
        reports = base[i % len(base)]
        for r in reports:
            object.__setattr__(r, "iteration", i)
        t0 = time.perf_counter()
        frame = build_frame(reports, layers)
        t1 = time.perf_counter()
        det.process_frame(frame)
        t2 = time.perf_counter()
        if i >= 2:  # the first iterations fit the model from scratch
            build.append(t1 - t0)
            score.append(t2 - t1)
    return {"ranks": tp * pp * dp, "chunks_per_iteration": tp * pp * dp * microbatches * 2,
            "frame_ms": 1e3 * float(np.median(build)), "detector_ms": 1e3 * float(np.median(score)),
            "total_ms": 1e3 * float(np.median(np.add(build, score))), "false_incidents": det.book.opened_total,
            "on_event_ms": bench_detector_events(tp, pp, dp, microbatches, iterations)}


def bench_detector_events(tp: int, pp: int, dp: int, microbatches: int, iterations: int) -> float:
    """Median ms per iteration of the whole event path, as ``resihp analytics`` drives it: every
    report and a heartbeat per rank through ``Detector.on_event`` (liveness bookkeeping, arrival,
    then the frame and its scoring once the iteration is complete), decoding aside."""
    from analytics.detection.detector import Detector
    from collector.events import EventFactory, Heartbeat, PlanCurrent
    from collector.plan import Plan

    det = Detector("bench")
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4 * pp, microbatches_per_replica=microbatches)
    det.on_event(EventFactory("bench", "trainer").make(PlanCurrent(plan=plan), time_s=0.0))
    ranks = tp * pp * dp
    factories = [EventFactory("bench", f"rank-{r}") for r in range(ranks)]
    base = [_reports(tp, pp, dp, microbatches, i, 2) for i in range(min(iterations, 3))]
    times = []
    for i in range(iterations):
        reports = base[i % len(base)]
        for r in reports:
            object.__setattr__(r, "iteration", i)
        events = [factories[r.rank].make(r, time_s=1.0 + i) for r in reports]
        events += [factories[r].make(Heartbeat(rank=r, epoch=0, iteration=i + 1, interval_s=10.0), time_s=1.5 + i)
                   for r in range(ranks)]
        t0 = time.perf_counter()
        for e in events:
            det.on_event(e)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=8_000, help="RankIteration events to ingest")
    parser.add_argument("--batch", type=int, default=2_000, help="events per transaction")
    parser.add_argument("--iterations", type=int, default=12, help="detector iterations per size (the first 2 are not timed)")
    parser.add_argument("--skip-16k", action="store_true", help="only 1,024 ranks (the 16k layout takes a minute)")
    parser.add_argument("--shards", default=None, metavar="N[,N...]",
                        help="instead: sharded analytics, per-shard work and merge time for these shard counts "
                             "(bench/_analytics_shards.py)")
    parser.add_argument("--ranks", type=int, default=100_000, help="with --shards: job size (TP8·PP16 replicas)")
    parser.add_argument("--kafka", default=None, metavar="BOOTSTRAP",
                        help="with --shards: also measure the sustained rate of shard processes on this broker "
                             "(a backlog of --kafka-replicas TP8·PP16 replicas × --kafka-iterations)")
    parser.add_argument("--kafka-replicas", type=int, default=32, help="with --kafka: DP replicas of the backlog")
    parser.add_argument("--kafka-iterations", type=int, default=30, help="with --kafka: iterations of the backlog")
    parser.add_argument("--kafka-repeats", type=int, default=2,
                        help="with --kafka: runs of each shard count, in turn; the fastest counts")


def run(args: argparse.Namespace) -> int:
    if args.shards:
        from bench._analytics_shards import bench_shards, print_table

        counts = [int(n) for n in str(args.shards).split(",")]
        r = bench_shards(args.ranks, counts)
        print_table(r)
        if args.kafka:
            from bench._analytics_shards import bench_kafka_shards

            dp, its = args.kafka_replicas, args.kafka_iterations
            r["kafka"] = bench_kafka_shards(args.kafka, counts, dp=dp, iterations=its, repeats=args.kafka_repeats)
            base, base_own = r["kafka"][0]["replicas_per_s"], r["kafka"][0]["replicas_per_s_own"]
            print(f"\non Kafka ({args.kafka}): `resihp analytics --role shard` processes and the merge, one numeric "
                  f"thread each, on a backlog of {8 * 16 * dp:,} ranks (TP8·PP16·DP{dp}) × {its} iterations; the fastest of "
                  f"{args.kafka_repeats} runs each")
            for k in r["kafka"]:
                print(f"  {k['shards']:2d} shard(s): {k['replicas_per_s']:7.1f} replica summaries/s "
                      f"(×{k['replicas_per_s'] / base:.2f}; {k['in_window']} of {k['summaries']} in "
                      f"{k['window_s']:.1f} s, {k['copies']} copies after the join), "
                      f"{k['replicas_per_s'] / k['shards']:.1f} per shard; load (1 min) "
                      f"{k['load_before'][0]:.2f} before, {k['load_after'][0]:.2f} after; every run "
                      f"{', '.join(f'{x:.1f}' for x in k['all_replicas_per_s'])}")
                print(f"      of the window, {k['round_trips_s']:.1f} s from an iteration's last summary to the merge's "
                      f"fits after it (median {1e3 * k['round_trip_median_s']:.0f} ms); without those "
                      f"{k['replicas_per_s_own']:.1f} summaries/s (×{k['replicas_per_s_own'] / base_own:.2f})")
                rest = ", ".join(f"{name} {c:.2f}" for name, c in k["window_cores_others"].items() if c is not None)
                print(f"      CPU in the window, in cores: the shards {k['window_cores']:.2f}; {rest}")
                print(f"      CPU seconds over each process's life (start-up and warm-up included): shards "
                      f"{' + '.join(f'{c:.1f}' for c in k['shard_cpu_s'])}, merge {k['merge_cpu_s']:.1f}; shards' peak "
                      f"memory {' + '.join(f'{m:,.0f}' for m in k['shard_peak_mb'])} MB")
        if args.json:
            print(json.dumps(r))
        return 0
    ingest = bench_ingest(args.events, args.batch)
    wire = bench_wire(_reports(8, 4, 4, 16, 0, 2))
    sizes = [(8, 8, 16, 16)] + ([] if args.skip_16k else [(8, 16, 128, 16)])
    det = [bench_detector(*s, iterations=args.iterations) for s in sizes]
    print(f"ingest: {ingest['chunks']:,} chunk rows from {ingest['events']:,} events, "
          f"{ingest['batch_events']:,} events per transaction")
    print(f"  {'into DuckDB (Arrow)':28} {ingest['ingest_chunks_per_s']:>12,.0f} chunks/s")
    print(f"  {'decode from bytes (apart)':28} {ingest['decode_chunks_per_s']:>12,.0f} chunks/s")
    o, c, h, b = wire["objects"], wire["columns"], wire["json_header"], wire["binary"]
    print(f"\na rank report on the wire ({wire['reports']} reports, 32 chunks and {wire['waits_per_report']} waits each):")
    print(f"  {'JSON, comm as objects (3)':28} {o['bytes']:>8,.0f} bytes {o['decode_us']:8.1f} µs to decode")
    print(f"  {'JSON, comm as columns (4)':28} {c['bytes']:>8,.0f} bytes {c['decode_us']:8.1f} µs to decode")
    print(f"  {'binary, JSON header (5, 1)':28} {h['bytes']:>8,.0f} bytes {h['decode_us']:8.1f} µs to decode")
    print(f"  {'binary, fixed header (5, 2)':28} {b['bytes']:>8,.0f} bytes {b['decode_us']:8.1f} µs to decode "
          f"(×{c['decode_us'] / b['decode_us']:.2f} faster than JSON columns)")
    print(f"\n{'ranks':>7} {'chunks/iter':>12} {'frame ms':>9} {'detector ms':>12} {'total ms':>9} {'incidents':>9} "
          f"{'on_event ms':>12}")
    for d in det:
        print(f"{d['ranks']:7,d} {d['chunks_per_iteration']:12,d} {d['frame_ms']:9.1f} {d['detector_ms']:12.1f} "
              f"{d['total_ms']:9.1f} {d['false_incidents']:9d} {d['on_event_ms']:12.1f}")
    print("on_event: the whole event path per iteration (every report and a heartbeat per rank through "
          "Detector.on_event: liveness, arrival, frame, scoring), decoding aside")
    if args.json:
        print(json.dumps({"ingest_chunks_per_s": round(ingest["ingest_chunks_per_s"]),
                          "decode_chunks_per_s": round(ingest["decode_chunks_per_s"]),
                          "wire": wire,
                          "detector": {str(d["ranks"]): {k: round(v, 2) if isinstance(v, float) else v
                                                         for k, v in d.items()} for d in det}}))
    return 0
