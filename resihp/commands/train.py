"""``resihp train``: launch the torch trainer's ranks as local processes (gloo on CPU).

The ranks run under the node agent (torch.distributed.elastic, as ``resihp run``), which hosts the
rendezvous store (so any rank may die); the trainer's controller in its monitor loop reads
reconfiguration commands from the bus's control topic and acknowledges them; ranks publish
telemetry to the same bus.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from resihp.options import add_bus_flags

if TYPE_CHECKING:
    from collector.plan import Plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run the torch TP/PP/DP trainer on local processes, reshaping on command",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bus_flags(p)
    p.add_argument("--plan", help="plan JSON file (collector.plan.Plan); overrides --tp/--pp/--dp")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica (uniform layout)")
    p.add_argument("--schedule", choices=["1f1b", "interleaved", "zero_bubble"], default="1f1b",
                   help="pipeline schedule (uniform layout; a --plan names its own)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per stage for --schedule interleaved (micro-batches must be a multiple of --pp)")
    p.add_argument("--ranks", type=int, default=None, help="processes to start (default: the plan's devices)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--model", default="tiny", help="preset: tiny, small, gpt2, gpt2-medium")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job", default="resihp", help="job name on the bus (commands for other jobs are ignored)")
    p.add_argument("--faults", default=None, help="a scenario or fault-list YAML: its faults: list is injected (docs/scenarios.md)")
    p.add_argument("--on-death", choices=["wait", "drop-replica"], default="wait",
                   help="after a rank dies: wait for a command, or drop its replica right away (spares take "
                        "the dead devices' places when no replica would survive)")
    p.add_argument("--commands-from", choices=["end", "beginning"], default="end",
                   help="read control-topic commands published from now on, or the whole log")
    p.add_argument("--pg-timeout", type=float, default=30.0, help="collective timeout, seconds")
    p.add_argument("--rendezvous-timeout", type=float, default=120.0,
                   help="seconds the ranks wait for a new world to gather and meet (arrival barrier, c10d "
                        "rendezvous); a rank that dies inside the rendezvous holds the others this long; keep it "
                        "above --pg-timeout")
    p.add_argument("--save-dir", default=None, help="write a layout-free checkpoint here at the end")
    p.add_argument("--resume-dir", default=None, help="start from a checkpoint written by any layout")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="also write a checkpoint to <save-dir>/step-<iteration> every K iterations: the fallback "
                        "when a failure leaves no live copy of some layer (needs --save-dir)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-telemetry", action="store_true")
    p.add_argument("--native", action="store_true", help=(
        "run the PyTorch-native executor instead (trainer/native/: a Llama-style decoder on DeviceMesh, DTensor TP, "
        "pipelining 1F1B, FSDP2, DCP; CUDA + NCCL when a GPU is present). Uses --tp/--pp/--dp/--microbatches or "
        "--plan, --iterations, --layers, --seed, --lr, --save-dir, --resume-dir (a DCP checkpoint), --checkpoint-every "
        "(a DCP checkpoint to --save-dir itself, replaced each time), --dp-mode and the bus flags; a rank that dies is "
        "recovered from by the others; see docs/native.md for what it does not read yet"))
    p.add_argument("--reshape", action="append", default=[], metavar="ITERATION:PLAN.json", help=(
        "native only: apply this plan file live before that iteration, state moved from the live ranks (repeatable, "
        "in order; each plan's epoch is the previous one's + 1; stages may run different TP degrees)"))
    p.add_argument("--dp-mode", choices=("shard", "replicate"), default="shard", help=(
        "native only: how replicas hold a stage: FSDP2 shards (least memory; a dead rank's shards come back from the "
        "--checkpoint-every checkpoint) or whole copies (FSDP2 replicate; a dead rank's state comes from its peers)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.native:
        return run_native(args)
    from dataclasses import asdict, replace

    from pydantic import ValidationError
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from trainer.fault_spec import FaultList
    from trainer.reference.launcher import check_launchable, launch
    from trainer.reference.model import PRESETS
    from trainer.reference.spec import RunSpec
    from trainer.spec import BusSpec

    if args.model not in PRESETS:
        raise SystemExit(f"unknown model preset {args.model!r}; choose one of {sorted(PRESETS)}")
    cfg = replace(PRESETS[args.model], dtype=args.dtype)
    if args.layers:
        cfg = replace(cfg, n_layer=args.layers)
    plan = _plan(args, cfg.n_layer)
    ranks = args.ranks or max(plan.devices) + 1
    if args.checkpoint_every and not args.save_dir:
        raise SystemExit("--checkpoint-every needs --save-dir DIR (where the periodic checkpoints go)")
    try:
        faults = FaultList.load(args.faults, "trainer").faults if args.faults else []
    except ValueError as exc:
        raise SystemExit(f"resihp train: {exc}") from None
    outside = sorted({f.device for f in faults if f.device is not None and f.device not in plan.devices})
    if outside:
        raise SystemExit(f"resihp train: {args.faults} injects faults on device(s) {outside}, which the plan "
                         f"{plan.shape()} does not have (devices 0-{max(plan.devices)})")
    try:
        spec = RunSpec(
            job=args.job, model=asdict(cfg), seed=args.seed, iterations=args.iterations, lr=args.lr,
            pg_timeout_s=args.pg_timeout, rendezvous_timeout_s=args.rendezvous_timeout, faults=faults,
            bus=BusSpec(backend=args.bus, path=args.bus_path, bootstrap=args.bootstrap),
            telemetry=not args.no_telemetry, save_dir=args.save_dir, resume_dir=args.resume_dir, threads=args.threads,
            checkpoint_every=args.checkpoint_every)
    except ValidationError as exc:  # flags that contradict each other
        raise SystemExit("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    try:
        check_launchable(spec, plan, ranks)  # launch checks too; here the refusal is one line, not a traceback
    except ValueError as exc:
        raise SystemExit(f"resihp train: {exc}") from None
    print(f"job {args.job}: {plan.shape()} {plan.schedule} on {ranks} ranks, {cfg.n_layer} layers, "
          f"{args.iterations} iterations")
    try:
        result = launch(spec, plan, ranks, on_death=args.on_death, commands_from=args.commands_from, echo=print)
    except SignalException as exc:  # the node agent stopped every rank first
        print(f"resihp train: stopped by {exc.sigval.name}; every rank was stopped")
        return 128 + int(exc.sigval)
    final = result.final_plan
    if final is None:
        print(f"no plan ran; exit codes {result.exit_codes}")
        return 1
    print(f"final plan epoch {final.epoch}: {final.shape()}; exit codes {result.exit_codes}")
    return 0 if all(c == 0 for d, c in result.exit_codes.items() if d not in result.dead) and \
        all(result.exit_codes.get(d) == 0 for d in final.devices) else 1


def run_native(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace
    from pathlib import Path

    from collector.plan import Plan
    from trainer.native.capabilities import refusal
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native
    from trainer.spec import BusSpec

    cfg = LlamaConfig(dtype=args.dtype)
    if args.layers:
        cfg = replace(cfg, n_layers=args.layers)
    plan = _plan(args, cfg.n_layers)
    if reason := refusal(plan, cfg):
        raise SystemExit(f"the native executor cannot run this plan: {reason}")
    reshapes, running = [], plan
    for item in args.reshape:
        at, _, path = item.partition(":")
        if not at.isdigit() or not path:
            raise SystemExit(f"--reshape {item!r}: give ITERATION:PLAN.json, e.g. --reshape 2:excluded.json")
        later = Plan.model_validate_json(Path(path).read_text())
        if reason := refusal(later, cfg, running.epoch, running):
            raise SystemExit(f"the native executor cannot run {path}: {reason}")
        reshapes.append(ScheduledReshape(at_iteration=int(at), plan=later))
        running = later
    spec = NativeRunSpec(
        job=args.job, model=asdict(cfg), settings=asdict(TrainSettings(seed=args.seed, lr=args.lr, dp_mode=args.dp_mode)),
        plan=plan, reshapes=reshapes, iterations=args.iterations, timeout_s=args.rendezvous_timeout, threads=args.threads,
        save_dir=args.save_dir, resume_dir=args.resume_dir, checkpoint_every=args.checkpoint_every or 0, echo=True,
        bus=None if args.no_telemetry else BusSpec(backend=args.bus, path=args.bus_path, bootstrap=args.bootstrap))
    print(f"job {args.job} (native): {plan.shape()} 1f1b on {len(plan.devices)} ranks, {cfg.n_layers} layers, "
          f"{args.iterations} iterations")
    codes = launch_native(spec)
    print(f"exit codes {codes}")
    return 0 if all(c == 0 for c in codes.values()) else 1


def _plan(args: argparse.Namespace, num_layers: int) -> Plan:
    """The plan file when given (--plan), else the textbook layout of --tp/--pp/--dp."""
    from pathlib import Path

    from collector.plan import Plan

    if args.plan:
        return Plan.model_validate_json(Path(args.plan).read_text())
    return Plan.uniform(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=num_layers,
                        microbatches_per_replica=args.microbatches, schedule=args.schedule,
                        virtual_stages=args.virtual_stages)
