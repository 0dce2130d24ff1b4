"""Simulator speed: wall time to simulate 1,000 iterations of 1,024- and 16,384-GPU jobs; with
``--publish``, seconds to build and publish one 100k-rank step over 1 and N publisher processes
(bench/_sim_publish.py).

Truth/timing only: every chunk of every replica is timed through the schedule DAG with workload,
noise, stalls and communication, but no telemetry objects are built (``telemetry: none``; one
IterationSummary per iteration is not built either — ``SimEngine.iteration_durations``). The
100,000-GPU row runs fewer iterations and scales the time linearly (stated in the table).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Literal

JOBS = [  # (gpus label, tp, pp, dp, microbatches per replica, iterations measured)
    (1_024, 8, 8, 16, 16, 1_000),
    (16_384, 8, 16, 128, 32, 1_000),
    (100_000, 8, 16, 781, 32, 100),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=1_000, help="iterations for the 1k and 16k jobs")
    parser.add_argument("--skip-100k", action="store_true", help="leave out the 100,000-GPU estimate")
    parser.add_argument("--telemetry", action="store_true",
                        help="also time 20 iterations of the 1,024-GPU job with full telemetry objects built")
    parser.add_argument("--publish", action="store_true",
                        help="instead: seconds to build and publish a step of --scenario through 1 and N publishers, "
                             "with the raw client on the same bytes")
    parser.add_argument("--scenario", default="healthy_100k", help="with --publish: the scenario (default healthy_100k)")
    parser.add_argument("--publishers", default="1,2", help="with --publish: publisher counts, comma-separated")
    parser.add_argument("--backend", choices=["embedded", "kafka", "both"], default="both", help="with --publish")
    parser.add_argument("--bootstrap", default=None,
                        help="with --publish: Kafka bootstrap (default: the broker up on the default data dir, else "
                             "one started for the bench and stopped after)")
    parser.add_argument("--steps", type=int, default=5, help="with --publish: steps timed per run (after the first)")
    parser.add_argument("--live", action="store_true",
                        help="instead: publish --scenario live through Kafka to --shards shards and the merge at --speed, "
                             "and print the lag per iteration (bench/_sim_live.py)")
    parser.add_argument("--speed", type=float, default=0.1, help="with --live: simulated seconds per wall second")
    parser.add_argument("--shards", type=int, default=2, help="with --live: shard processes")
    parser.add_argument("--live-publishers", dest="publishers_live", type=int, default=2,
                        help="with --live: publisher processes")
    parser.add_argument("--live-iterations", dest="iterations_live", type=int, default=10,
                        help="with --live: iterations published")
    parser.add_argument("--stall-s", type=float, default=300.0,
                        help="with --live: stop reading the merge's output after this long without a record")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --publish: rounds, publisher counts alternating within each (others share the CPU)")


def _engine(tp: int, pp: int, dp: int, mb: int, telemetry: Literal["all", "none"] = "none"):
    from collector.plan import Plan
    from trainer.sim.engine import SimConfig, SimEngine
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    model = MODEL_PRESETS["70b"]
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=model.layers, microbatches_per_replica=mb)
    cfg = SimConfig(model=model, cluster=ClusterSpec(gpus=tp * pp * dp), plan=plan, telemetry=telemetry, job="bench")
    return SimEngine(cfg)


def run(args: argparse.Namespace) -> int:
    if args.live:
        from bench._sim_live import run as run_live

        live = run_live(args)
        if args.json:
            print(json.dumps({"live": live}))
        return 0
    if args.publish:
        from bench._sim_publish import run as run_publish

        rows = run_publish(args)
        if args.json:
            print(json.dumps({"publish": rows}))
        return 0
    runs = []
    print(f"{'GPUs':>8} {'layout':>16} {'iterations':>10} {'wall_s':>8} {'per-iter ms':>11}  note")
    for gpus, tp, pp, dp, mb, iters in JOBS:
        if gpus == 100_000 and args.skip_100k:
            continue
        n = iters if gpus == 100_000 else args.iterations
        engine = _engine(tp, pp, dp, mb)
        t0 = time.perf_counter()
        d = engine.iteration_durations(n)
        wall = time.perf_counter() - t0
        note = "truth/timing only, no telemetry objects"
        row = {"gpus": tp * pp * dp, "iterations": n, "wall_s": round(wall, 3),
               "layout": engine.plan.shape(), "mean_iteration_s": round(float(d.mean()), 3)}
        if gpus == 100_000:
            row["wall_s_per_1000_iterations_est"] = round(wall * 1000 / n, 1)
            note += f"; ≈{wall * 1000 / n:,.0f} s per 1,000 iterations (linear)"
        runs.append(row)
        print(f"{row['gpus']:>8,} {row['layout']:>16} {n:>10,} {wall:>8.2f} {1000 * wall / n:>11.2f}  {note}")
    if args.telemetry:
        engine = _engine(8, 8, 16, 16, telemetry="all")
        t0 = time.perf_counter()
        events = engine.run(20)
        wall = time.perf_counter() - t0
        runs.append({"gpus": 1024, "iterations": 20, "wall_s": round(wall, 3), "telemetry": True, "events": len(events)})
        print(f"{1024:>8,} {engine.plan.shape():>16} {20:>10,} {wall:>8.2f} {1000 * wall / 20:>11.2f}  "
              f"with telemetry: {len(events):,} event objects built (not encoded)")
    if args.json:
        print(json.dumps({"runs": runs}))
    return 0
