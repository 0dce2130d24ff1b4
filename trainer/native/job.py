"""The native executor's rank as a torchrun-style script: ``resihp run ... -m trainer.native.job``.

A user runs the native executor as an ordinary ``resihp run`` job — one node or several, the c10d
or the etcd rendezvous — and with ``--on-failure shrink`` a rank that dies is recovered in the job
by the executor's own recovery (trainer/native/recovery.py, ``NativeExecutor.recover``):

    resihp run --standalone --nproc-per-node 4 --on-failure shrink --preload trainer.native.worker \\
        -m trainer.native.job --dp 4 --dp-mode replicate --iterations 100 --out-dir runs/native

Each rank is the process ``launch_native`` forks (trainer/native/worker.py, ``process_main``), and
finds everything the same way there and here, from what its node agent set: its device is its
global rank (``RANK``); its store is the ranks' store (the bootstrap store, or the round's keys on
etcd: ``RESIHP_RANKS_STORE``), where the agent counts a death (``resihp/lost-count``, which the
loss watch polls while a step lasts) and marks the dead rank lost (``resihp/lost/<rank>``); its
signed records are bound to the agent's rendezvous round (``RESIHP_STORE_SCOPE``). So nothing here
but the run's description: ``--spec FILE`` (a ``NativeRunSpec`` as JSON, every field), or the
layout flags, which also override a spec's.

Without ``--on-failure shrink`` a death ends the job as torch's restart does (every rank is started
again; give ``--resume-dir`` a checkpoint to go on from). Bus commands (``NativeRunSpec.commands``)
need the native launcher's intake and are refused here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

from collector.plan import Plan
from collector.settings import elastic_environment, environment
from trainer.native.capabilities import refusal
from trainer.native.faults import native_fault_problem
from trainer.native.model import LlamaConfig
from trainer.native.stage import TrainSettings
from trainer.native.worker import NativeRunSpec, process_main
from trainer.spec import BusSpec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainer.native.job", description=(
        "one rank of the native executor under resihp run (docs/native.md#under-resihp-run)"))
    p.add_argument("--spec", type=Path, help="a NativeRunSpec as JSON; the flags below override its fields")
    p.add_argument("--tp", type=int, default=1, help="TP degree of the textbook layout (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dp", type=int, help="replicas (default: the world's ranks / (tp × pp))")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per replica (default 2)")
    p.add_argument("--layers", type=int, help="decoder layers (default: LlamaConfig's)")
    p.add_argument("--iterations", type=int, help="iterations to train (default 10)")
    p.add_argument("--dp-mode", choices=("shard", "replicate"), help=(
        "FSDP2 shards, or whole copies per replica (replicate: a dead rank's state comes back from a peer)"))
    p.add_argument("--out-dir", help="each rank's results (rank-<device>.json) and the final parameters")
    p.add_argument("--save-dir", help="DCP checkpoints (the final one, and every --checkpoint-every)")
    p.add_argument("--checkpoint-every", type=int, help="a DCP checkpoint to --save-dir every K iterations")
    p.add_argument("--resume-dir", help="start from a DCP checkpoint of any layout")
    p.add_argument("--timeout-s", type=float, help="collective and store timeout (default 120)")
    p.add_argument("--telemetry", action="store_true", help=(
        "publish each iteration and reshape phase on the bus the agent names (resihp run without --no-telemetry)"))
    p.add_argument("--echo", action="store_true", help="world rank 0 prints each iteration's loss")
    return p


def job_spec(args: argparse.Namespace, world_size: int) -> NativeRunSpec:
    """The run's spec from ``--spec`` and the flags; ``SystemExit`` naming what cannot run under
    this agent (a device past the world, a plan the executor refuses, bus commands)."""
    spec = NativeRunSpec.model_validate_json(args.spec.read_text()) if args.spec else None
    cfg = spec.config if spec else LlamaConfig()
    if args.layers:
        cfg = replace(cfg, n_layers=args.layers)
    if spec is None or args.dp or args.tp != 1 or args.pp != 1:
        dp = args.dp or world_size // (args.tp * args.pp)
        plan = Plan.uniform(tp=args.tp, pp=args.pp, dp=dp, num_layers=cfg.n_layers,
                            microbatches_per_replica=args.microbatches)
    else:
        plan = spec.plan
    settings = spec.train_settings if spec else TrainSettings()
    if args.dp_mode:
        settings = replace(settings, dp_mode=args.dp_mode)
    given = {"iterations": args.iterations, "out_dir": args.out_dir, "save_dir": args.save_dir,
             "checkpoint_every": args.checkpoint_every, "resume_dir": args.resume_dir, "timeout_s": args.timeout_s}
    update = {k: v for k, v in given.items() if v is not None}
    update.update(model=asdict(cfg), settings=asdict(settings), plan=plan, job=environment().job or "resihp-native")
    if args.telemetry:
        update["bus"] = BusSpec()  # the bus the agent's environment names (RESIHP_BUS, …)
    if args.echo:
        update["echo"] = True
    spec = NativeRunSpec.model_validate({**(spec.model_dump() if spec else {}), **update})
    if spec.commands:
        raise SystemExit("trainer.native.job: bus commands (commands: true) need the native launcher's intake "
                         "(resihp train --native); under resihp run the job obeys none")
    if past := sorted(d for d in {*spec.plan.devices, *(d for r in spec.reshapes for d in r.plan.devices)}
                      if d >= world_size):
        raise SystemExit(f"trainer.native.job: the plan names devices {past} but resihp run started {world_size} "
                         "ranks; give --nproc-per-node × --nnodes ranks for every device")
    if reason := refusal(spec.plan, spec.config) or native_fault_problem(spec.faults):
        raise SystemExit(f"trainer.native.job: the native executor cannot run this: {reason}")
    return spec


def main(argv: list[str] | None = None) -> None:
    """Parse, check, and run this rank to its end (exits with the rank's code)."""
    env = elastic_environment()
    spec = job_spec(parser().parse_args(argv), env.WORLD_SIZE)
    if spec.out_dir:
        Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    process_main(env.RANK, spec.model_dump_json())


if __name__ == "__main__":
    main(sys.argv[1:])
