"""SIGKILL one rank of a native job and watch the survivors recover (CPU, gloo, a few seconds).

    PYTHONPATH=. python examples/native_kill_recovery.py [--layout dp3|pp2-dp2|tp2-dp2] [--timeout S]

Three or four CPU ranks train a 4-layer float64 decoder with replicated data parallelism; the
last device SIGKILLs itself inside its first forward chunk of iteration 2. The survivors drop its
replica, take its micro-batches and redo the iteration. Prints each survivor's recovery phases and
step times and exits non-zero unless every loss and the final parameters equal one process
training the same global batches. In pp2-dp2 and tp2-dp2 one survivor waits on the dead rank's
live partner until the collective timeout (``--timeout``, default 15 s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict

import torch


def main() -> int:
    from collector.plan import PipelinePlan, Plan, StagePlan
    from trainer.fault_spec import FaultSpec
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings, reference_losses
    from trainer.native.worker import NativeRunSpec, launch_native, read_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("dp3", "pp2-dp2", "tp2-dp2"), default="dp3")
    parser.add_argument("--timeout", type=float, default=15.0, help="collective timeout, seconds")
    args = parser.parse_args()
    cfg = LlamaConfig(dim=32, n_layers=4, n_heads=4, ffn_hidden=64, vocab_size=64, dtype="float64")
    settings = TrainSettings(block_size=16, dp_mode="replicate")
    replicas = {"dp3": [(2, [((0,), 0, 4)]), (1, [((1,), 0, 4)]), (1, [((2,), 0, 4)])],
                "pp2-dp2": [(2, [((0,), 0, 2), ((1,), 2, 4)]), (2, [((2,), 0, 2), ((3,), 2, 4)])],
                "tp2-dp2": [(2, [((0, 1), 0, 4)]), (2, [((2, 3), 0, 4)])]}[args.layout]
    plan = Plan(epoch=0, num_layers=cfg.n_layers, pipelines=tuple(
        PipelinePlan(replica=r, microbatches=n, stages=tuple(StagePlan(devices=d, first_layer=a, end_layer=b)
                                                             for d, a, b in stages))
        for r, (n, stages) in enumerate(replicas)))
    killed, iterations = max(plan.devices), 4
    with tempfile.TemporaryDirectory() as out:
        spec = NativeRunSpec(model=asdict(cfg), settings=asdict(settings), plan=plan, iterations=iterations,
                             out_dir=out, timeout_s=args.timeout, device="cpu",
                             faults=[FaultSpec(kind="stop_device", device=killed, at_iteration=2)])
        started = time.perf_counter()
        codes = launch_native(spec)
        print(f"{args.layout}: device {killed} SIGKILLed in iteration 2; exit codes {codes} "
              f"({time.perf_counter() - started:.1f} s)")
        ranks, params = read_results(out)
    ref_losses, ref_params = reference_losses(cfg, settings, [plan.global_microbatches] * iterations)
    ok = all(codes[d] == 0 for d in plan.devices if d != killed)
    for device, r in sorted(ranks.items()):
        if r.get("released"):
            print(f"device {device}: released (its replica was dropped)")
            continue
        for rec in r["reshapes"]:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in rec["phases_s"].items())
            print(f"device {device}: lost {rec['lost']}, state from {rec['source']}; {phases} s")
        print(f"device {device}: step times " + ", ".join(f"{float(w):.3f}" for w in r["walls"].values()) + " s")
        ok &= all(abs(loss - ref_losses[int(it)]) <= 1e-9 * abs(ref_losses[int(it)]) for it, loss in r["losses"].items())
    ok &= sorted(params) == sorted(ref_params) and all(
        torch.allclose(params[k], v, rtol=1e-9, atol=1e-9) for k, v in ref_params.items())
    print("losses and final parameters equal the single-process reference" if ok else "MISMATCH or failed rank")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
