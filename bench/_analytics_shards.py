"""Sharded analytics cost (``resihp bench analytics --ranks N --shards 1,2,...``).

What it measures, per iteration of a TP8·PP16 job of about ``--ranks`` ranks (16 micro-batches, F and B
chunks, as bench/analytics.py's detector table):

* per replica, what a shard does (analytics/sharding/shards.py): decode the replica's rank reports and a
  heartbeat per rank from their bus bytes, fold them, flatten them into a frame, score it with the merge's fits and encode the
  ReplicaSummary. Measured on a few replicas and multiplied by the replicas a shard holds
  (ceil(DP / N)): shards share nothing, so per-shard work is that product, and it falls as 1/N
  while N divides the replicas;
* the merge (analytics/sharding/merge.py), measured whole at the full size: decode every replica's
  LivenessBatch and ReplicaSummary, apply the batches' heartbeats and report progress to the
  fail-stop watch as arrays (``JobMerge.settle``), and judge the job (``JobMerge.judge``: centring, the cost-model fit on the summaries' unit rows, CUSUMs,
  incidents, the fits for the next iteration). The merge is fed the binary records the shards
  publish; the same events are also encoded as JSON (base64 arrays, as ``encode_json`` and the
  logs before binary records have them) and decoded in the same run, the two decodes interleaved
  and repeated (the fastest of ``DECODE_REPEATS`` each, the garbage collector paused during each
  pass), so both costs and both sizes come from one job on one machine load;
* bytes on the wire per iteration: rank reports (binary columns, telemetry schema 5), and ReplicaSummaries with LivenessBatches
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
    from analytics.sharding.replica_summary import pack, unpack

    arrays = {k: v.copy() for k, v in unpack(summary.layout, summary.blob).items()}
    shift = (replica - template) * tp * pp
    for name in ("rank", "u_rank", "l_src", "l_dst"):
        arrays[name] += shift
    arrays["dp"][:] = replica
    layout, blob = pack(arrays)
    return summary.model_copy(update={"replica": replica, "layout": layout, "blob": blob})


def _clone_liveness(batch, shift: int):
    """A template replica's LivenessBatch with its ranks shifted."""
    from analytics.sharding.replica_summary import pack, unpack

    arrays = {k: v.copy() for k, v in unpack(batch.layout, batch.blob).items()}
    arrays["rank"] += shift
    layout, blob = pack(arrays)
    return batch.model_copy(update={"layout": layout, "blob": blob})


def bench_shards(ranks: int, shards: list[int], iterations: int = 4, microbatches: int = 16) -> dict:
    from analytics.detection.frame import LayerLookup
    from analytics.sharding.merge import JobMerge
    from analytics.sharding.shards import ReplicaShard
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
    # What a plan costs a shard, once per plan (epoch), not per iteration: its replicas' members
    # and the layer lookup its frames use.
    setup = []
    for _ in range(3):
        t0 = time.perf_counter()
        ReplicaShard("bench").on_event(plan_event)
        LayerLookup(plan)
        setup.append(time.perf_counter() - t0)
    held = [ReplicaShard("bench") for _ in range(TEMPLATES)]  # one per template, living as a shard does
    for shard in held:
        shard.on_event(plan_event)
    for it in range(iterations):
        templates = []
        for t, shard in enumerate(held):
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
            if it >= 1:  # the first builds the shard's layer lookup for the plan (timed apart, above)
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
    return {"ranks": tp * pp * dp, "replicas": dp, "replica_ms": 1e3 * replica_s,
            "plan_setup_ms": 1e3 * float(np.median(setup)), "merge_s": float(np.median(merge_s)),
            "report_bytes_per_iteration": report_bytes * dp, "summary_bytes_per_iteration": summary_bytes,
            "summary_json_bytes_per_iteration": summary_json_bytes, "decode_json_s": float(np.median(decode_json_s)),
            "rows": rows, "merge_split_s": [float(x) for x in np.median(np.array(split), axis=0)]}


def print_table(r: dict, step_s: float = 5.0) -> None:
    print(f"\nsharded: {r['ranks']:,} ranks = {r['replicas']:,} replicas of TP8·PP16; "
          f"one replica's shard work {r['replica_ms']:.1f} ms per iteration (decode, fold, frame, score, encode); "
          f"a new plan costs each shard {r['plan_setup_ms']:.1f} ms once (members, layer lookup)")
    print(f"{'shards':>7} {'replicas/shard':>15} {'shard s/iter':>13} {'+ merge s':>10} {'keeps up with 5 s?':>19}")
    for row in r["rows"]:
        # shards and the merge overlap (a pipeline): the slower of the two sets the rate
        lag_free = max(row["shard_s"], r["merge_s"]) <= step_s
        print(f"{row['shards']:7d} {row['replicas_per_shard']:15,d} {row['shard_s']:13.2f} {r['merge_s']:10.2f} "
              f"{'yes' if lag_free else 'no':>19}")
    dec, live, judge = r["merge_split_s"]
    print(f"merge per iteration: {r['merge_s']:.3f} s = decode {r['replicas']:,} ReplicaSummaries and "
          f"LivenessBatches {dec:.3f} s + fail-stop watch {live:.3f} s + judge the job (JobMerge.judge) {judge:.3f} s")
    print(f"bytes on the wire per iteration: rank reports (binary columns) {r['report_bytes_per_iteration'] / 1e6:,.1f} MB, "
          f"ReplicaSummaries + LivenessBatches {r['summary_bytes_per_iteration'] / 1e6:,.1f} MB binary "
          f"({r['summary_json_bytes_per_iteration'] / 1e6:,.1f} MB as JSON)")
    print(f"the merge's decode of them, same run: binary {dec:.3f} s, JSON {r['decode_json_s']:.3f} s")


KAFKA_WARMUP = 3  # iterations before the window: the shards' start-up and group join happen in them
KAFKA_STALL_S = 60.0  # a run with nothing new on the analytics topic this long is reported stuck
KAFKA_TEMPLATES = 4  # distinct replicas generated per iteration for the Kafka backlog (the rest are copies)
PINNED_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def kafka_backlog(dp: int, iterations: int) -> list:
    """A TP8·PP16·DP``dp`` job's telemetry, encoded and keyed once (``RawMessage``s): per
    iteration every rank's report and a heartbeat saying it started the next one. The same bytes
    go into each run's fresh namespace, so 1 and N shards read identical logs and generating them
    (seconds per replica template) stays out of every run."""
    from collector.bus import RawMessage
    from collector.codec import encode
    from collector.events import EventFactory, Heartbeat
    from collector.topics import PartitionKeys, topic_for

    fac, keys, out = EventFactory("bench", "rank"), PartitionKeys(), []
    for it in range(iterations):
        templates = [_replica_reports(8, 16, t, 16, it) for t in range(min(KAFKA_TEMPLATES, dp))]
        for d in range(dp):
            shift = (d - d % KAFKA_TEMPLATES) * 8 * 16
            reports = [r.model_copy(update={"rank": r.rank + shift, "node": (r.rank + shift) // 8,
                                            "coords": r.coords.model_copy(update={"dp": d})})
                       for r in templates[d % KAFKA_TEMPLATES]]
            events = [fac.make(r, time_s=float(it)) for r in reports]
            events += [fac.make(Heartbeat(rank=r.rank, epoch=0, iteration=it + 1, interval_s=10.0), time_s=it + 0.5)
                       for r in reports]
            out += [RawMessage(topic_for(e.kind), keys.key(e.job, e.source, e.kind, e.payload), encode(e))
                    for e in events]
    return out


def bench_kafka_shards(bootstrap: str, shards: list[int], dp: int = 32, iterations: int = 30,
                       warmup: int = KAFKA_WARMUP, repeats: int = 2) -> list[dict]:
    """Sustained shard throughput on a broker, per shard count N: a TP8·PP16·DP``dp`` job's
    ``iterations`` (``kafka_backlog``) are in the telemetry topic of a fresh namespace before any
    analytics process starts; then N ``resihp analytics --role shard`` processes in one group and
    the merge start, each pinned to one thread of numeric work (``PINNED_THREADS`` = 1), so N
    against 1 compares per-shard work, not how many threads a process grabs.

    The merge starts once the shards' group is stable with every shard holding partitions: shards
    predict iteration i with the merge's fits of i−1, so until then none gets past iteration 0.
    The window opens at the first summary of iteration ``warmup`` (the backlog holds ``warmup`` more
    iterations), and not before every shard published one: process start-up and the group's join
    (a rebalance, whose copies are counted apart) are behind it. Shards and merge run in lock-step
    (docs/analytics-scaling.md), and a shard reads each partition only a few iterations past what waits for fits
    (``analytics.shards.READ_AHEAD``): at the window's start each holds the same few iterations
    whatever N, so the window holds the decoding and scoring of every later iteration, with the
    merge's round trips. It closes at the last new summary; the rate is the new (epoch,
    iteration, replica) summaries in it per second, from the times the shards stamped them.
    The shard counts run in turn ``repeats`` times and each count keeps its fastest run: on a
    shared machine other work comes and goes within minutes, and one pass of each would compare
    the machine's load as much as the shard counts. The
    window's round trips (an iteration's last summary to the next one's first) are summed apart:
    the window less them is what the shards' own work took."""
    import os
    import sys
    import uuid

    from collector import topics
    from collector.auth import Signer
    from collector.events import DetectorFits, EventFactory, PlanCurrent, ReplicaSummary
    from collector.kafka_bus import KafkaBus
    from collector.plan import Plan
    from collector.stream import EventStream

    backlog = kafka_backlog(dp, warmup + iterations)
    plan = Plan.uniform(tp=8, pp=16, dp=dp, num_layers=64, microbatches_per_replica=16)
    want = dp * (warmup + iterations)
    out: list[dict] = []
    for n in [n for _ in range(repeats) for n in shards]:
        run = uuid.uuid4().hex[:8]  # fresh topics and groups: no member of an earlier run is waited for
        ns = f"bench{run}."
        bus = KafkaBus(bootstrap, namespace=ns)
        # the merge waits for the plan, and admits one only as the executor signed it
        bus.publish([Signer(EventFactory("bench", "trainer"), "executor").make(PlanCurrent(plan=plan))])
        for i in range(0, len(backlog), 4096):
            bus.publish_raw(backlog[i:i + 4096])
        env = dict(os.environ, RESIHP_KAFKA_NAMESPACE=ns, **{k: "1" for k in PINNED_THREADS})
        cmd = [sys.executable, "-m", "resihp.cli", "analytics", "--bus", "kafka", "--bootstrap", bootstrap,
               "--role", "shard", "--job", "bench", "--group", f"bench-shards-{run}"]
        load_before = os.getloadavg()
        procs = [_start(cmd + ["--instance-id", f"s{i}"], env) for i in range(n)]
        # The merge starts once every shard holds partitions: until it judges iteration 0 no shard
        # gets past iteration 0 and READ_AHEAD more, whichever shard joined first.
        _wait_for_group(bootstrap, bus.security, f"bench-shards-{run}", n, procs)
        procs.append(_start(cmd[:cmd.index("--role")] + ["--role", "merge", "--group", f"bench-merge-{run}"], env))
        first: dict[str, float] = {}  # shard -> its first summary's time
        seen: dict[tuple[int, int, int], float] = {}  # (epoch, iteration, replica) -> its first copy's time
        copies = 0
        judged = -1
        fits_at: dict[int, float] = {}  # iteration -> when the merge's fits after it were read here
        cpu: list[tuple[float, float]] = []  # (time, the shards' CPU seconds so far)
        others: dict[str, list[tuple[float, float]]] = {"merge": [], "broker": [], "reader": []}  # the rest
        broker = _listener_pid(bootstrap)
        moved = time.monotonic()
        try:
            with EventStream(bus, f"bench-reader-{run}", [topics.ANALYTICS]) as reader:
                while judged < warmup + iterations - 1:
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"an analytics process exited early ({[p.returncode for p in procs]})")
                    if time.monotonic() - moved > KAFKA_STALL_S:
                        raise RuntimeError(f"{n} shard(s): nothing new on the analytics topic for {KAFKA_STALL_S:.0f} s "
                                           f"({len(seen)} of {want} summaries, iteration {judged} judged, missing "
                                           f"{sorted(set((0, i, d) for i in range(warmup + iterations) for d in range(dp)) - set(seen))[:8]})")
                    now = time.time()
                    cpu.append((now, sum(_cpu_s(p.pid) for p in procs[:-1])))
                    others["merge"].append((now, _cpu_s(procs[-1].pid)))
                    others["reader"].append((now, _cpu_s(os.getpid())))
                    if broker is not None:
                        others["broker"].append((now, _cpu_s(broker)))
                    for d in reader.poll(10_000, 0.2):
                        moved = time.monotonic()
                        e, p = d.event, d.event.payload
                        if isinstance(p, ReplicaSummary):
                            first.setdefault(p.shard, e.time_s)
                            key = (p.epoch, p.iteration, p.replica)
                            if key in seen:
                                copies += 1
                            else:
                                seen[key] = e.time_s
                        elif isinstance(p, DetectorFits):
                            judged = max(judged, p.iteration)
                            fits_at.setdefault(p.iteration, time.time())  # as the shards receive it
        finally:
            for p in procs:
                p.terminate()
            cpu_s, peak_mb = zip(*[_reap(p) for p in procs])
            bus.close()
        load_after = os.getloadavg()
        opens = max(min(t for (_, i, _), t in seen.items() if i >= warmup), *first.values())
        inside = sorted(t for (_, i, _), t in seen.items() if i >= warmup and t > opens)
        rate = len(inside) / (inside[-1] - opens) if inside else float("nan")
        # the merge's round trips: from an iteration's last summary to its fits (no shard can score
        # iteration i+1 before the merge judged i and its fits reached the shard)
        last: dict[int, float] = {}
        for (_, i, _), t in seen.items():
            last[i] = max(last.get(i, t), t)
        gaps = [max(0.0, fits_at[i] - last[i]) for i in range(warmup, warmup + iterations - 1)]
        out.append({"shards": n, "summaries": len(seen), "of": want, "copies": copies, "window_s": inside[-1] - opens,
                    "in_window": len(inside), "replicas_per_s": rate, "load_before": load_before,
                    "load_after": load_after, "shard_cpu_s": cpu_s[:-1], "merge_cpu_s": cpu_s[-1],
                    "shard_peak_mb": peak_mb[:-1], "window_cores": _cores(cpu, opens, inside[-1]) if inside else float("nan"),
                    "window_cores_others": {k: _cores(v, opens, inside[-1]) if inside and v else None
                                            for k, v in others.items()},
                    "round_trips_s": float(sum(gaps)), "round_trip_median_s": float(np.median(gaps)),
                    "replicas_per_s_own": len(inside) / (inside[-1] - opens - sum(gaps)) if inside else float("nan")})
    best = []
    for n in shards:
        runs = [r for r in out if r["shards"] == n]
        best.append(max(runs, key=lambda r: r["replicas_per_s"]) | {"all_replicas_per_s": [r["replicas_per_s"] for r in runs]})
    return best


def _start(argv: list[str], env: dict[str, str]):
    """A child that dies with this process, however this one ends."""
    import os
    import signal
    import subprocess

    from resihp.demo.guard import set_parent_death_signal

    me = os.getpid()
    return subprocess.Popen(argv, env=env, preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM, me))


def _cores(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Cores' worth of CPU used between t0 and t1, from (time, CPU seconds so far) samples."""
    times = np.array([t for t, _ in samples])
    used = np.array([c for _, c in samples])
    c0, c1 = np.interp(np.array([t0, t1]), times, used)
    return float(c1 - c0) / (t1 - t0)


def _listener_pid(bootstrap: str) -> int | None:
    """The process listening on ``bootstrap``'s port on this machine (a local broker), from
    ``ss -ltnp``; None when the broker is elsewhere or ss cannot say."""
    import re
    import subprocess

    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if host.strip("[]") not in ("127.0.0.1", "localhost", "::1"):
        return None  # another machine's broker: its CPU is not this machine's
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"pid=(\d+)", out)
    return int(found.group(1)) if found else None


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far (Linux /proc; 0 elsewhere)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _reap(p) -> tuple[float, float]:
    """Wait for a child; the CPU seconds (user + system) it used over its life, and its peak
    resident memory in MB."""
    import os

    try:
        _, status, usage = os.wait4(p.pid, 0)
    except ChildProcessError:  # reaped already (it exited early)
        return float("nan"), float("nan")
    p.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def _wait_for_group(bootstrap: str, security: dict, group: str, members: int, procs: list) -> None:
    """Until the consumer group is stable with ``members`` members, each holding partitions."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, **security)
    deadline = time.monotonic() + KAFKA_STALL_S
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a shard process exited before its group formed ({[p.returncode for p in procs]})")
            try:
                g = admin.describe_groups([group])[group]
            except KafkaError as exc:  # a fresh broker has no group coordinator until its offsets topic exists
                if not exc.retriable:
                    raise
                time.sleep(0.2)
                continue
            held = [m for m in g.get("members", []) if (m.get("member_assignment") or {}).get("assigned_partitions")]
            if g.get("group_state") == "Stable" and len(held) == len(g.get("members", [])) == members:
                return
            time.sleep(0.2)
    finally:
        admin.close()
    raise RuntimeError(f"consumer group {group} did not become stable with {members} members in {KAFKA_STALL_S:.0f} s")
