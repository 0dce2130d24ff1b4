"""The CPU each native reshape costs: process time per phase, summed over the 8 ranks.

Why beside ``resihp bench reshape``: on a shared 2-core machine a pause's wall time swings 2–3×
with the load, while its CPU (what the protocol costs the machine: stage build, state moved and
landed) is what a cut in the native executor changes. One unpaced ``launch_native`` run, no fault,
on the same model and starting TP1·PP2·DP4 as ``bench reshape``'s native side, applies the same
changes in the same order (``bench.reshape._native_plans``: the plans a DeviceMesh refuses are left
out), ``--gap`` iterations apart; each rank reports each phase's process time
(trainer/native/executor.py), its gloo threads' included.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

PHASES = ("agree", "export", "new_mesh", "stages_rebuilt", "redistribute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--gap", type=int, default=2, help="iterations between two changes (at least 1)")


def run(args: argparse.Namespace) -> int:
    from bench.reshape import _native_plans
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native, read_results

    if args.gap < 1:
        raise SystemExit(f"--gap {args.gap}: changes must be at least one iteration apart")
    cfg = LlamaConfig(vocab_size=256, dim=args.embd, n_layers=args.layers, n_heads=4, ffn_hidden=2 * args.embd)
    base, changes = _native_plans(args.layers, cfg)
    applied = [(kind, plan) for kind, plan, reason in changes if reason is None]
    first = 3  # the first iterations' lazy set-up is not a reshape's
    reshapes = [ScheduledReshape(at_iteration=first + i * args.gap, plan=p) for i, (_, p) in enumerate(applied)]
    tmp = Path(tempfile.mkdtemp(prefix="resihp-bench-reshape-cpu-"))
    try:
        spec = NativeRunSpec(job="bench-reshape-cpu", model=asdict(cfg), settings=asdict(TrainSettings(block_size=args.block)),
                             plan=base, reshapes=reshapes, iterations=first + len(applied) * args.gap,
                             out_dir=str(tmp), device="cpu")
        codes = launch_native(spec)
        ranks, _ = read_results(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if any(codes.values()):
        raise SystemExit(f"bench reshape_cpu: ranks exited with {codes}")
    cpu: dict[str, dict[str, float]] = {}
    for kind, plan in applied:
        reports = [rep for r in ranks.values() for rep in r["reshapes"] if rep["epoch"] == plan.epoch]
        per_phase = {p: sum(rep["cpu_s"].get(p, 0.0) for rep in reports) for p in PHASES}
        cpu[kind] = {"ranks": len(reports), "total": sum(per_phase.values()),
                     **{p: v for p, v in per_phase.items() if v}}
    print(f"bench reshape_cpu: {len(ranks)} CPU ranks, {args.layers} layers × {args.embd} wide, {args.block}-token "
          "micro-batches; process time per phase summed over ranks (s)")
    print(f"{'change':<14} {'plan after':<12} {'total':>7}  " + " ".join(f"{p:>14}" for p in PHASES))
    for kind, plan in applied:
        row = cpu[kind]
        print(f"{kind:<14} {plan.shape():<12} {row['total']:>7.3f}  "
              + " ".join(f"{row.get(p, 0.0):>14.3f}" for p in PHASES))
    if args.json:
        print(json.dumps({"cpu_s": cpu}))
    return 0
