"""``resihp bench sim --live``: a simulated job through Kafka, its shards and the merge, live.

The scenario (default ``healthy_100k``) is published open loop at ``--speed`` (simulated seconds
per wall second; ``--speed 0.1`` steps a 1.9 s step every 19 s) by ``--publishers`` processes
(trainer/sim/publishers.py), while ``--shards`` ``resihp analytics --role shard`` processes in one
consumer group and one ``--role merge`` judge it (docs/analytics-scaling.md). The analytics
processes start first, on a fresh namespace of the broker, and the publisher starts once the
shards' group holds every partition.

Lag of iteration i: from the moment the publisher had iteration i on the bus (every record
acknowledged) to the moment the merge published its fits after judging i (``DetectorFits``, the
record's broker timestamp). Both clocks are this machine's. ``behind_s`` is how late the
publisher put the iteration out against the pace (the pacer's due time). A pace is sustained when
the lag does not grow over the run; the table says the slope of lag over iterations.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid

import numpy as np

from bench._broker import kafka_bootstrap


def run(args) -> dict:
    from bench._analytics_shards import PINNED_THREADS, _reap, _start, _wait_for_group
    from collector import topics
    from collector.codec import InvalidEvent, decode
    from collector.events import DetectorFits
    from collector.kafka_bus import KafkaBus
    from trainer.sim.engine import SimEngine
    from trainer.sim.publishers import BusSpec, SplitPublisher, parent_wire, run_split_open_loop, whole_job_wire
    from trainer.sim.runner import Pacer
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(args.scenario)
    job = sc.sim_config().job
    with contextlib.ExitStack() as stack:
        bootstrap = kafka_bootstrap(stack, args.bootstrap)
        run_id = uuid.uuid4().hex[:8]
        ns = f"live{run_id}."
        bus = stack.enter_context(contextlib.closing(KafkaBus(bootstrap, namespace=ns)))
        env = dict(os.environ, RESIHP_KAFKA_NAMESPACE=ns, **{k: "1" for k in PINNED_THREADS})
        cmd = [sys.executable, "-m", "resihp.cli", "analytics", "--bus", "kafka", "--bootstrap", bootstrap]
        procs = [_start(cmd + ["--role", "shard", "--job", job, "--group", f"live-shards-{run_id}",
                               "--instance-id", f"s{i}"], env) for i in range(args.shards)]
        try:
            _wait_for_group(bootstrap, bus.security, f"live-shards-{run_id}", args.shards, procs)
            procs.append(_start(cmd + ["--role", "merge", "--group", f"live-merge-{run_id}"], env))
            engine = SimEngine(sc.sim_config(), sc.all_faults())
            published: dict[int, float] = {}
            due: dict[int, float] = {}
            pacer: Pacer | None = None

            def progress(done: int) -> None:
                assert pacer is not None
                published[engine.iteration - 1] = time.time()
                due[engine.iteration - 1] = time.time() + (pacer.due() - time.monotonic())

            with contextlib.ExitStack() as publishing:
                if args.publishers_live == 1:
                    engine.rank_wire = whole_job_wire(engine)
                    split = None
                else:
                    engine.rank_wire = parent_wire(engine)
                    spec = BusSpec("kafka", bootstrap=bootstrap, namespace=ns)
                    split = publishing.enter_context(SplitPublisher(engine.config, sc.all_faults(), spec,
                                                                    args.publishers_live))
                t0 = time.time()  # the pace starts once the publishers are up
                pacer = Pacer(engine, args.speed)
                run_split_open_loop(engine, bus, split, iterations=args.iterations_live, progress=progress, pacer=pacer)
            judged: dict[int, float] = {}
            last = args.iterations_live - 1
            with bus.consumer(f"live-reader-{run_id}", [topics.ANALYTICS]) as reader:
                quiet = time.monotonic()
                while last not in judged and time.monotonic() - quiet < args.stall_s:
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"an analytics process exited ({[p.returncode for p in procs]})")
                    for record in reader.poll(10_000, 0.5):
                        quiet = time.monotonic()
                        try:
                            e = decode(record.value)
                        except InvalidEvent:
                            continue
                        if isinstance(e.payload, DetectorFits):
                            judged.setdefault(e.payload.iteration, record.timestamp_s)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                _reap(p)
    rows: list[dict] = [{"iteration": i, "published_s": round(published[i] - t0, 2), "behind_s": round(max(0.0, published[i] - due[i]), 2),
             "judged_s": round(judged[i] - t0, 2) if i in judged else None,
             "lag_s": round(judged[i] - published[i], 2) if i in judged else None} for i in sorted(published)]
    lagged = [r for r in rows if r["lag_s"] is not None]
    slope = (float(np.polyfit([r["iteration"] for r in lagged], [r["lag_s"] for r in lagged], 1)[0])
             if len(lagged) >= 3 else float("nan"))
    step_s = float(np.mean(np.diff(sorted(published.values())))) if len(published) > 1 else float("nan")
    print(f"{'iteration':>9} {'published s':>12} {'behind s':>9} {'judged s':>9} {'lag s':>7}")
    for r in rows:
        print(f"{r['iteration']:>9} {r['published_s']:>12.2f} {r['behind_s']:>9.2f} "
              f"{'-' if r['judged_s'] is None else format(r['judged_s'], '.2f'):>9} "
              f"{'-' if r['lag_s'] is None else format(r['lag_s'], '.2f'):>7}")
    print(f"({args.scenario}: {engine.config.cluster.gpus:,} ranks at ×{args.speed:g} (a step every {step_s:.1f} s of "
          f"wall time), {args.publishers_live} publisher(s), {args.shards} shard(s) and the merge on Kafka; lag: "
          f"iteration on the bus -> the merge's fits after judging it; lag grows {slope:+.2f} s an iteration; "
          f"{len(judged)} of {len(rows)} iterations judged; load {os.getloadavg()[0]:.1f})")
    return {"rows": rows, "lag_slope_s_per_iteration": slope, "step_s": step_s, "speed": args.speed,
            "publishers": args.publishers_live, "shards": args.shards, "ranks": engine.config.cluster.gpus}
