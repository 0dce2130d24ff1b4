"""``resihp demo``: the whole platform on one machine, telling one story end to end.

Each component is its own process on one bus: the workload (the 8-rank CPU torch trainer, or with
--scale N the cluster simulator at N GPUs), ``resihp analytics`` (DuckDB projections and the
detector), ``resihp remediate`` (the planner, with the auto-apply policy) and, unless --headless,
``resihp ui`` (the console). The demo injects a fail-slow and later a fail-stop; the platform
detects, localises, plans, applies and verifies. A status line says what is happening; the end
prints incidents, plans, pauses and tokens/s before, during and after each fault, and leaves the
whole log as a trace under the workdir (``resihp replay``, or the console's Replay page).

--bus kafka runs the same through Apache Kafka: $RESIHP_KAFKA_BOOTSTRAP, or the local broker
(started if needed); every run gets a fresh topic namespace. See docs/quickstart.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the platform end to end: inject faults, watch them detected and fixed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    story = p.add_argument_group("the story")
    story.add_argument("--bus", choices=["embedded", "kafka"], default="embedded",
                       help="embedded log in the workdir (default) or Apache Kafka")
    story.add_argument("--workload", choices=["torch", "sim"], default=None,
                       help="torch: the 8-rank CPU torch trainer with emulated device speed (the default without "
                            "--scale); sim: the cluster simulator (the default with --scale)")
    story.add_argument("--short", action="store_true", help="a shorter story (fewer iterations per phase; for tests)")
    story.add_argument("--workdir", type=Path, default=None,
                       help="where the bus, DuckDB file, logs and trace go (default .resihp/demo/<time>; must be new)")
    story.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    story.add_argument("--timeout", type=float, default=1200.0, metavar="SECONDS",
                       help="give up if the workload has not finished by then (default 1200)")
    story.add_argument("--tp", type=int, default=None, help="TP degree of the layout (default 2)")
    torch = p.add_argument_group("the torch workload")
    torch.add_argument("--trainer", choices=["reference", "native", "torchtitan"], default="reference",
                       help="the reference trainer (8 ranks, a fail-slow and a fail-stop), the PyTorch-native "
                            "executor (trainer/native/: 4 CPU ranks, DP4, a fail-slow answered by the DP changes it "
                            "declares it can run) or torchtitan's own trainer under resihp run (4 CPU ranks, "
                            "a fail-slow answered by a restart at a smaller layout: docs/torchtitan.md)")
    torch.add_argument("--torchtitan-layout", choices=["replicas", "fsdp", "pp"], default="replicas",
                       help="with --trainer torchtitan: its four ranks as DDP-style replicas (default), FSDP2 "
                            "shards, or two pipelines of two stages")
    torch.add_argument("--pace", type=float, default=None, metavar="S",
                       help="emulated device seconds per layer-token, so 8 ranks on few cores behave like devices "
                            "of a set speed; a stage's TP ranks split a layer's time (default 4e-4; 0: raw CPU)")
    sim = p.add_argument_group("the simulator")
    sim.add_argument("--scale", type=int, default=None, metavar="N",
                     help="tell the story on the simulator at N GPUs (N ≥ 8), e.g. --scale 256")
    sim.add_argument("--speed", type=float, default=1.0,
                     help="simulated seconds per wall second (default 1: real time)")
    console = p.add_argument_group("the console")
    console.add_argument("--headless", action="store_true", help="do not start the console")
    console.add_argument("--port", type=int, default=8501, help="console port (default 8501)")
    console.add_argument("--linger", type=float, default=None, metavar="SECONDS",
                         help="keep it up this long after the story ends (default: until Ctrl-C)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from resihp.demo.run import DemoOptions, run_demo

    if args.scale is not None and args.scale < 8:
        raise SystemExit(f"--scale {args.scale}: the demo needs at least 8 GPUs")
    workload = args.workload or ("sim" if args.scale is not None else "torch")
    if args.trainer != "reference" and (workload != "torch" or args.scale is not None or args.tp not in (None, 1)):
        raise SystemExit(f"--trainer {args.trainer} runs its own story on the torch workload; drop --workload sim, "
                         "--scale and --tp")
    if workload == "torch" and args.scale not in (None, 8):
        raise SystemExit("the torch trainer runs 8 CPU ranks; use --workload sim for --scale "
                         f"{args.scale}")
    return run_demo(DemoOptions(
        bus=args.bus, scale=args.scale, workload=workload, headless=args.headless, json=args.json,
        workdir=args.workdir, speed=args.speed, short=args.short, port=args.port, linger_s=args.linger,
        timeout_s=args.timeout, tp=args.tp, pace=args.pace, trainer=args.trainer,
        titan_layout=args.torchtitan_layout,
    ))
