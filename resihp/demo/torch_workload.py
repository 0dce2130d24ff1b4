"""The demo's torch workload: ``resihp train`` with emulated device speed (``--pace``).

Why not ``resihp train`` itself: the demo runs 8 CPU ranks on a machine that may have 2 cores.
At raw CPU speed the ranks fight over the cores, and a slowed rank (which *sleeps* its extra
time) frees CPU for the other seven, so a ×3 fail-slow barely shows in the iteration time.
Device pacing (RunSpec.pace_s_per_layer_token, docs/trainer.md) pads every chunk to a set
emulated device time, so each rank behaves like a device of known speed and a slowed rank is
really ×3 slower. Everything else is the stock launcher: telemetry to the bus, commands from the
control topic, acknowledgements, live reshapes, a killed rank reshaped around.

Run as ``python -m resihp.demo.torch_workload --tp 2 --pp 2 --dp 2 ... [bus flags]``.
"""

from __future__ import annotations

import argparse
import sys

from collector.settings import environment
from resihp.options import add_bus_flags

DEFAULT_PACE_S_PER_LAYER_TOKEN = 4e-4  # one device; a TP-2 rank takes half: 2e-4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resihp.demo.torch_workload", description=__doc__)
    add_bus_flags(p)
    p.add_argument("--job", default="demo")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per replica")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--model", default="tiny", help="trainer preset (trainer/reference/model.py)")
    p.add_argument("--faults", default=None, help="fault list YAML (trainer/faults.py)")
    p.add_argument("--pace", type=float, default=DEFAULT_PACE_S_PER_LAYER_TOKEN,
                   help="emulated device seconds per layer-token (0: raw CPU)")
    p.add_argument("--pg-timeout", type=float, default=10.0,
                   help="collective timeout, s: how long a survivor waits on a dead peer before it notices")
    args = p.parse_args(argv)

    from dataclasses import asdict

    from collector.plan import Plan
    from trainer.fault_spec import FaultList
    from trainer.reference.launcher import launch
    from trainer.reference.model import PRESETS
    from trainer.reference.spec import RunSpec
    from trainer.spec import BusSpec

    if args.model not in PRESETS:
        raise SystemExit(f"unknown model preset {args.model!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[args.model]
    plan = Plan.uniform(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=cfg.n_layer,
                        microbatches_per_replica=args.microbatches)
    ranks = max(plan.devices) + 1
    bus = BusSpec(backend=args.bus, path=args.bus_path, bootstrap=args.bootstrap,
                  namespace=environment().kafka_namespace if args.bus == "kafka" else "")
    spec = RunSpec(job=args.job, model=asdict(cfg), iterations=args.iterations, pg_timeout_s=args.pg_timeout,
                   faults=FaultList.load(args.faults, "trainer").faults if args.faults else [], bus=bus,
                   pace_s_per_layer_token=args.pace)
    print(f"job {args.job}: {plan.shape()} on {ranks} CPU ranks, {cfg.n_layer} layers, {args.iterations} "
          f"iterations, pace {args.pace:g} s/layer-token", flush=True)
    result = launch(spec, plan, ranks, on_death="wait", echo=lambda line: print(line, flush=True))
    final = result.final_plan
    if final is None:
        print(f"no plan ran; exit codes {result.exit_codes}", flush=True)
        return 1
    print(f"final plan epoch {final.epoch}: {final.shape()}; exit codes {result.exit_codes}", flush=True)
    survivors_ok = all(result.exit_codes.get(d) == 0 for d in final.devices)
    return 0 if survivors_ok else 1


if __name__ == "__main__":
    sys.exit(main())
