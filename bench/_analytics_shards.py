"""Sharded analytics cost (``resihp bench analytics --ranks N --shards 1,2,...``).

What it measures, per iteration of a TP8·PP16 job of about ``--ranks`` ranks (16 micro-batches, F and B
chunks, as bench/analytics.py's detector table):

* per replica, what a shard does (analytics/shards.py): decode the replica's rank reports and a
  heartbeat per rank from their bus bytes, fold them, flatten them into a frame, score it with the merge's fits and encode the
  ReplicaSummary. Measured on a few replicas and multiplied by the replicas a shard holds
  (ceil(DP / N)): shards share nothing, so per-shard work is that product, and it falls as 1/N
  while N divides the replicas;
* the merge (analytics/merge.py), measured whole at the full size: decode every replica's
  LivenessBatch and ReplicaSummary, apply the batches' heartbeats and report progress to the
  fail-stop watch as arrays (``JobMerge.settle``), and judge the job (``JobMerge.judge``: centring, the cost-model fit on the summaries' unit rows, CUSUMs,
  incidents, the fits for the next iteration). The merge is fed the binary records the shards
  publish; the same events are also encoded as JSON (base64 arrays, as ``encode_json`` and the
  logs before binary records have them) and decoded in the same run, the two decodes interleaved
  and repeated (the fastest of ``DECODE_REPEATS`` each, the garbage collector paused during each
  pass), so both costs and both sizes come from one job on one machine load;
* bytes on the wire per iteration: rank reports (JSON), and ReplicaSummaries with LivenessBatches
  (binary, and as JSON).

It does not run Kafka: the bus's own throughput is ``resihp bench bus``. Replica templates are
reused with shifted rank numbers, so generating a 100k-rank job takes seconds, not minutes.
"""

from __future__ import annotations

import gc
import math
import time

import numpy as np

TEMPLATES = 4  # distinct replicas measured (and cloned for the merge)
DECODE_REPEATS = 5  # passes of the merge's decode per encoding and iteration


def _replica_reports(tp: int, pp: int, replica: int, microbatches: int, iteration: int) -> list:
    from bench.analytics import _reports

    out = _reports(tp, pp, 1, microbatches, iteration, seed=100 + replica)
    shift = replica * tp * pp
    for r in out:
        object.__setattr__(r, "rank", r.rank + shift)
        object.__setattr__(r, "node", r.rank // 8)
        object.__setattr__(r, "coords", r.coords.model_copy(update={"dp": replica}))
    return out


def _clone(summary, replica: int, template: int, tp: int, pp: int):
    """A template replica's ReplicaSummary as replica ``replica``: ranks and dp shifted, rest shared."""
    from analytics.replica_summary import pack, unpack

    arrays = {k: v.copy() for k, v in unpack(summary.layout, summary.blob).items()}
    shift = (replica - template) * tp * pp
    for name in ("rank", "u_rank", "l_src", "l_dst"):
        arrays[name] += shift
    arrays["dp"][:] = replica
    layout, blob = pack(arrays)
    return summary.model_copy(update={"replica": replica, "layout": layout, "blob": blob})


def _clone_liveness(batch, shift: int):
    """A template replica's LivenessBatch with its ranks shifted."""
    from analytics.replica_summary import pack, unpack

    arrays = {k: v.copy() for k, v in unpack(batch.layout, batch.blob).items()}
    arrays["rank"] += shift
    layout, blob = pack(arrays)
    return batch.model_copy(update={"layout": layout, "blob": blob})


def bench_shards(ranks: int, shards: list[int], iterations: int = 4, microbatches: int = 16) -> dict:
    from analytics.merge import JobMerge
    from analytics.shards import ReplicaShard
    from collector.codec import decode, encode, encode_json
    from collector.events import DetectorFits, EventFactory, Heartbeat, LivenessBatch, PlanCurrent
    from collector.plan import Plan

    tp, pp = 8, 16
    dp = max(1, ranks // (tp * pp))
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4 * pp, microbatches_per_replica=microbatches)
    merge = JobMerge("bench")
    plan_event = EventFactory("bench", "trainer").make(PlanCurrent(plan=plan))
    merge.on_event(plan_event)
    fac = EventFactory("bench", "rank")
    sfac = EventFactory("bench", "shard")
    mfac = EventFactory("bench", "analytics-merge")
    per_replica_s: list[float] = []
    report_bytes = summary_bytes = summary_json_bytes = 0
    decode_json_s: list[float] = []
    merge_s: list[float] = []
    split: list[tuple[float, float, float]] = []  # decode, fail-stop watch, judge
    fits = None
    for it in range(iterations):
        templates = []
        for t in range(TEMPLATES):
            shard = ReplicaShard("bench")
            shard.on_event(plan_event)
            if fits is not None:
                shard.on_event(mfac.make(fits))
            reports = _replica_reports(tp, pp, t, microbatches, it)
            raw = [encode(fac.make(r, time_s=1.0 + it)) for r in reports]
            # and a heartbeat per rank, as bench/analytics.py's single-process event path
            raw += [encode(fac.make(Heartbeat(rank=r.rank, epoch=0, iteration=it + 1, interval_s=10.0), time_s=1.5 + it))
                    for r in reports]
            t0 = time.perf_counter()
            out = []
            for b in raw:
                out += shard.on_event(decode(b))
            out += shard.flush()
            (payload,) = out
            heard = shard.take_liveness()
            assert heard is not None, "the shard forwarded no liveness"
            wire = encode(sfac.make(payload))
            live_wire = encode(sfac.make(heard))
            per_replica_s.append(time.perf_counter() - t0)
            report_bytes = sum(map(len, raw))
            templates.append((wire, live_wire))
        decoded = [(decode(w).payload, decode(lw).payload) for w, lw in templates]
        wires, json_wires = [], []
        for d in range(dp):
            summary, liveness = decoded[d % TEMPLATES]
            for event in (sfac.make(_clone_liveness(liveness, (d - d % TEMPLATES) * tp * pp)),
                          sfac.make(_clone(summary, d, d % TEMPLATES, tp, pp))):
                wires.append(encode(event))
                json_wires.append(encode_json(event))
        summary_bytes, summary_json_bytes = sum(map(len, wires)), sum(map(len, json_wires))
        # both decodes, interleaved and repeated (the fastest of each counts): on a shared machine a
        # single pass of either is at the mercy of whatever else runs at that moment
        json_s = binary_s = math.inf
        for _ in range(DECODE_REPEATS):
            # each pass keeps what it decoded, as the merge does, with the garbage collector paused:
            # otherwise a pass pays for whichever full collection the other's objects set off, which
            # walks the merge's whole heap
            events = []
            gc.disable()
            try:
                t0 = time.perf_counter()
                events = [decode(w) for w in json_wires]
                json_s = min(json_s, time.perf_counter() - t0)
                events = []
                t0 = time.perf_counter()
                events = [decode(w) for w in wires]
                binary_s = min(binary_s, time.perf_counter() - t0)
            finally:
                gc.enable()
        t1 = time.perf_counter()
        got = []
        for e in events:  # as a poll reads them: the shards' liveness, then their summaries
            if isinstance(e.payload, LivenessBatch):
                got += merge.on_event(e)
        t_live = time.perf_counter()
        got += merge.settle()
        liveness_s = time.perf_counter() - t_live
        for e in events:
            if not isinstance(e.payload, LivenessBatch):
                got += merge.on_event(e)
        t2 = time.perf_counter()
        fits = next(p for p in got if isinstance(p, DetectorFits))
        if it >= 2:  # the first iterations fit the cost model from scratch
            merge_s.append(binary_s + t2 - t1)
            decode_json_s.append(json_s)
            split.append((binary_s, liveness_s, t2 - t1 - liveness_s))
        assert merge.detector.stats.frames == it + 1, "the merge did not judge the iteration"
    replica_s = float(np.median(per_replica_s))
    rows = [{"shards": n, "replicas_per_shard": math.ceil(dp / n), "shard_s": replica_s * math.ceil(dp / n)}
            for n in shards]
    return {"ranks": tp * pp * dp, "replicas": dp, "replica_ms": 1e3 * replica_s, "merge_s": float(np.median(merge_s)),
            "report_bytes_per_iteration": report_bytes * dp, "summary_bytes_per_iteration": summary_bytes,
            "summary_json_bytes_per_iteration": summary_json_bytes, "decode_json_s": float(np.median(decode_json_s)),
            "rows": rows, "merge_split_s": [float(x) for x in np.median(np.array(split), axis=0)]}


def print_table(r: dict, step_s: float = 5.0) -> None:
    print(f"\nsharded: {r['ranks']:,} ranks = {r['replicas']:,} replicas of TP8·PP16; "
          f"one replica's shard work {r['replica_ms']:.1f} ms (decode, fold, frame, score, encode)")
    print(f"{'shards':>7} {'replicas/shard':>15} {'shard s/iter':>13} {'+ merge s':>10} {'keeps up with 5 s?':>19}")
    for row in r["rows"]:
        # shards and the merge overlap (a pipeline): the slower of the two sets the rate
        lag_free = max(row["shard_s"], r["merge_s"]) <= step_s
        print(f"{row['shards']:7d} {row['replicas_per_shard']:15,d} {row['shard_s']:13.2f} {r['merge_s']:10.2f} "
              f"{'yes' if lag_free else 'no':>19}")
    dec, live, judge = r["merge_split_s"]
    print(f"merge per iteration: {r['merge_s']:.3f} s = decode {r['replicas']:,} ReplicaSummaries and "
          f"LivenessBatches {dec:.3f} s + fail-stop watch {live:.3f} s + judge the job (JobMerge.judge) {judge:.3f} s")
    print(f"bytes on the wire per iteration: rank reports (JSON) {r['report_bytes_per_iteration'] / 1e6:,.1f} MB, "
          f"ReplicaSummaries + LivenessBatches {r['summary_bytes_per_iteration'] / 1e6:,.1f} MB binary "
          f"({r['summary_json_bytes_per_iteration'] / 1e6:,.1f} MB as JSON)")
    print(f"the merge's decode of them, same run: binary {dec:.3f} s, JSON {r['decode_json_s']:.3f} s")


def bench_kafka_shards(bootstrap: str, shards: list[int], dp: int = 16, iterations: int = 6) -> list[dict]:
    """Measured on a broker: a TP8·PP16·DP``dp`` job's reports published once per run (fresh
    namespace), then N ``resihp analytics --role shard`` processes in one group and the merge (whose
    fits the shards predict the next iteration with, so shards and merge run in lock-step); the rate
    is summaries per second between the first and the last ReplicaSummary seen on the analytics
    topic (process start and the group join are left out)."""
    import os
    import subprocess
    import sys
    import uuid

    from collector import topics
    from collector.auth import Signer
    from collector.events import EventFactory, PlanCurrent, ReplicaSummary
    from collector.kafka_bus import KafkaBus
    from collector.plan import Plan
    from collector.stream import EventStream

    out = []
    for n in shards:
        ns = f"bench{uuid.uuid4().hex[:8]}."
        bus = KafkaBus(bootstrap, namespace=ns)
        plan = Plan.uniform(tp=8, pp=16, dp=dp, num_layers=64, microbatches_per_replica=16)
        # the merge waits for the plan, and admits one only as the executor signed it
        bus.publish([Signer(EventFactory("bench", "trainer"), "executor").make(PlanCurrent(plan=plan))])
        fac = EventFactory("bench", "rank")
        for it in range(iterations):
            bus.publish([fac.make(r, time_s=float(it)) for d in range(dp) for r in _replica_reports(8, 16, d, 16, it)])
        env = dict(os.environ, RESIHP_KAFKA_NAMESPACE=ns)
        cmd = [sys.executable, "-m", "resihp.cli", "analytics", "--bus", "kafka", "--bootstrap", bootstrap,
               "--role", "shard", "--job", "bench", "--group", "bench-shards", "--exit-when-idle", "15"]
        procs = [subprocess.Popen(cmd + ["--instance-id", f"s{i}"], env=env) for i in range(n)]
        merge_cmd = cmd[:cmd.index("--role")] + ["--role", "merge", "--group", "bench-merge", "--exit-when-idle", "15"]
        procs.append(subprocess.Popen(merge_cmd, env=env))  # shards predict with the merge's fits
        seen: list[float] = []
        with EventStream(bus, "bench-reader", [topics.ANALYTICS]) as reader:
            while len(seen) < dp * iterations and all(p.poll() is None for p in procs):
                for d in reader.poll(10_000, 0.2):
                    if isinstance(d.event.payload, ReplicaSummary):
                        seen.append(time.monotonic())
        for p in procs:
            p.wait()
        bus.close()
        rate = (len(seen) - 1) / (seen[-1] - seen[0]) if len(seen) > 1 else float("nan")
        out.append({"shards": n, "frames": len(seen), "replicas_per_s": rate})
    return out
