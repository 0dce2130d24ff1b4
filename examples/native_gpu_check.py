"""Exercise the native executor's CUDA / NCCL path on a GPU machine (a few minutes at most).

    PYTHONPATH=. python examples/native_gpu_check.py

With two or more GPUs: TP2 across two GPUs for 3 iterations, then a live TP 2→1 reshape onto
the first GPU and 3 more iterations. With one GPU (NCCL allows one rank per GPU): one rank, a
live reshape to the same layout at the next epoch (export → new group → rebuild → restore on
the GPU), then more iterations. Either way the losses are compared with the single-process CPU
reference (float32, so to 1e-4 relative) and the reshape phases are printed. Exits non-zero if
no GPU is visible, a rank fails, or a loss differs.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict

import torch


def main() -> int:
    from collector.plan import PipelinePlan, Plan, StagePlan
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings, reference_losses
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native, read_results

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no GPU visible: nothing to check (the CPU/gloo path is covered by tests/test_native_*.py)")
        return 2
    cfg = LlamaConfig(dim=64, n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256)
    settings = TrainSettings(block_size=64)

    def plan(epoch: int, devices: tuple[int, ...]) -> Plan:
        return Plan(epoch=epoch, num_layers=cfg.n_layers, pipelines=(PipelinePlan(
            replica=0, microbatches=4, stages=(StagePlan(devices=devices, first_layer=0, end_layer=cfg.n_layers),)),))

    start, after = (plan(0, (0, 1)), plan(1, (0,))) if gpus >= 2 else (plan(0, (0,)), plan(1, (0,)))
    out = tempfile.mkdtemp(prefix="native-gpu-check-")
    spec = NativeRunSpec(job="native-gpu-check", model=asdict(cfg), settings=asdict(settings), plan=start,
                         reshapes=[ScheduledReshape(at_iteration=3, plan=after)], iterations=6, out_dir=out,
                         device="cuda", timeout_s=120)
    codes = launch_native(spec)
    ranks, _ = read_results(out)
    print(f"{gpus} GPU(s); {start.shape()} -> {after.shape()}; exit codes {codes}")
    ref, _ = reference_losses(cfg, settings, [4] * 6)
    ok = all(c == 0 for c in codes.values())
    for device, r in sorted(ranks.items()):
        print(f"device {device}: backend {r['backend']}, released {r.get('released', False)}")
        for rep in r["reshapes"]:
            print("  reshape phases s:", {k: round(v, 4) for k, v in rep["phases_s"].items()}, "source", rep["source"])
        for it, loss in sorted(r["losses"].items(), key=lambda kv: int(kv[0])):
            close = abs(loss - ref[int(it)]) <= 1e-4 * abs(ref[int(it)])
            ok &= close
            print(f"  iteration {it}: loss {loss:.6f} reference {ref[int(it)]:.6f} {'ok' if close else 'DIFFERS'}")
        ok &= r["backend"] == "nccl"
    print("native GPU check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
