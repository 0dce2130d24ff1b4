"""The demo's native workload: the PyTorch-native executor taking commands from the bus.

``resihp demo --trainer native`` runs this instead of the reference trainer: DP replicas of the
Llama-style decoder (trainer/native/) on CPU ranks with gloo, telemetry from torch's own
schedule, the story's fail-slow injected on one device (trainer/native/faults.py), and the
launcher announcing the plan and the executor's capabilities, then applying the engine's
commands live and acknowledging them (trainer/native/intake.py).

Run as ``python -m resihp.demo.native_workload --dp 4 --microbatches 2 --iterations 80 [bus flags]``.
"""

from __future__ import annotations

import argparse
import sys

from collector.settings import environment
from resihp.options import add_bus_flags

# Emulated device seconds per layer-token. Higher than the reference trainer's demo (4e-4): a
# native chunk at raw CPU speed on a loaded 2-core machine often exceeds 4e-4's 51 ms forward,
# and the padding only hides the raw time below it.
NATIVE_PACE_S_PER_LAYER_TOKEN = 1e-3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resihp.demo.native_workload", description=__doc__)
    add_bus_flags(p)
    p.add_argument("--job", default="demo")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per replica")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--faults", default=None, help="fault list YAML (slow_compute only: trainer/native/faults.py)")
    p.add_argument("--timeout", type=float, default=60.0, help="collective and rendezvous timeout, s")
    p.add_argument("--pace", type=float, default=NATIVE_PACE_S_PER_LAYER_TOKEN,
                   help="emulated device seconds per layer-token (0: raw CPU)")
    args = p.parse_args(argv)

    from dataclasses import asdict

    from collector.plan import Plan
    from trainer.fault_spec import FaultList
    from trainer.native.faults import native_fault_problem
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec, launch_native
    from trainer.spec import BusSpec

    cfg, settings = LlamaConfig(), TrainSettings()
    plan = Plan.uniform(tp=1, pp=1, dp=args.dp, num_layers=cfg.n_layers, microbatches_per_replica=args.microbatches)
    faults = FaultList.load(args.faults, "trainer").faults if args.faults else []
    if problem := native_fault_problem(faults):
        raise SystemExit(f"{args.faults}: {problem}")
    bus = BusSpec(backend=args.bus, path=args.bus_path, bootstrap=args.bootstrap,
                  namespace=environment().kafka_namespace if args.bus == "kafka" else "")
    spec = NativeRunSpec(job=args.job, model=asdict(cfg), settings=asdict(settings), plan=plan,
                         iterations=args.iterations, timeout_s=args.timeout, device="cpu", bus=bus, commands=True,
                         faults=faults, tokens_per_microbatch=settings.block_size, echo=True,
                         pace_s_per_layer_token=args.pace)
    print(f"job {args.job} (native): {plan.shape()} on {len(plan.devices)} CPU ranks, {cfg.n_layers} layers, "
          f"{args.iterations} iterations, pace {args.pace:g} s/layer-token", flush=True)
    codes = launch_native(spec)
    print(f"exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
