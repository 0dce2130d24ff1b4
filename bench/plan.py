"""Planning time of the joint TP/PP/DP planner at 256 to 100,000 GPUs.

Each size runs a uniform TP8 layout (PP 4, 8, 16, 16) with four faults at once — a slow GPU
(×2.5), a slow link (×3), a dead GPU and a dead node — and times one full ``Planner.plan`` call
(candidate search, DP allocation, building the new Plan and its diff), best of ``--repeats``.
The model carries the spreads a fitted one has (the simulator's: micro-batch mix 0.19, replicas
4 %), so every pipeline is scored as an expectation over the mix (256 draws through the DAG).
Goals: ≤ 1 s at 1,024 GPUs, ≤ 10 s at 100,000.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

SIZES = ((256, 4), (1024, 8), (16_384, 16), (100_000, 16))  # (GPUs, PP); TP 8 throughout
MIX_CV, REPLICA_CV = 0.19, 0.04  # what fitted_model finds for the simulator's 7B pretrain job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the best is reported (default 3)")
    parser.add_argument("--sizes", default=",".join(str(n) for n, _ in SIZES),
                        help="comma-separated GPU counts from 256,1024,16384,100000")


def run(args: argparse.Namespace) -> int:
    from collector.events import Location
    from collector.plan import Plan
    from remediation.cluster import ClusterState, DeviceState
    from remediation.model import PlannerModel
    from remediation.planner import Planner

    wanted = {int(s) for s in args.sizes.split(",") if s}
    rows: list[dict] = []
    for gpus, pp in SIZES:
        if gpus not in wanted:
            continue
        tp, layers = 8, 8 * pp
        dp = gpus // (tp * pp)
        plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=layers, microbatches_per_replica=2 * pp)
        model = replace(PlannerModel.uniform(layers), microbatch_cv=MIX_CV, makespan_cv=REPLICA_CV)
        cluster = (ClusterState(gpus)
                   .with_device(13, DeviceState(compute_factor=2.5))
                   .with_device(gpus // 2 + 3, DeviceState(link_factor=3.0))
                   .with_device(gpus // 3 + 1, DeviceState(dead=True))
                   .with_location(Location(target="node", node=(gpus * 3 // 4) // 8), "fail_stop"))
        best = float("inf")
        result = None
        for _ in range(args.repeats):
            planner = Planner(model)  # a fresh scorer cache each run: no help from the last one
            t0 = time.perf_counter()
            result = planner.plan(cluster, plan)
            best = min(best, time.perf_counter() - t0)
        assert result is not None
        rows.append({"gpus": gpus, "layout": f"TP{tp}·PP{pp}·DP{dp}", "plan_s": best,
                     "gain": result.predicted_tokens_per_s / max(result.current_tokens_per_s, 1e-9),
                     "diff_lines": len(result.diff)})
    print(f"{'GPUs':>8}  {'layout':<16} {'plan time':>10}  {'diff lines':>10}")
    for r in rows:
        print(f"{r['gpus']:>8,}  {r['layout']:<16} {r['plan_s']:>9.3f}s  {r['diff_lines']:>10}")
    if args.json:
        print(json.dumps({"plan_s": {str(r["gpus"]): round(float(r["plan_s"]), 4) for r in rows}}))
    return 0
