"""A small data-parallel job for ``resihp run``: gloo, periodic checkpoints, a flight record.

``resihp run --standalone --nproc-per-node 2 -m trainer.agent.sample_job --steps 20`` trains an
MLP on random data with its gradients all-reduced, checkpoints every ``--checkpoint-every`` steps
(rank 0 writes, atomically) and resumes from the newest checkpoint when the agent restarts it:
the job the agent's tests and ``resihp bench agent`` run. It keeps a flight record
(trainer/agent/flight.py) so the agent can judge hangs, and appends one JSON line per finished
step to ``--progress-file`` (rank 0) so a benchmark can see when training runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from collector.settings import elastic_environment
from trainer.agent.flight import FlightRecorder


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.agent.sample_job", description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-s", type=float, default=0.05, help="extra seconds per step (emulates a device)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--progress-file", default=None)
    p.add_argument("--pid-dir", default=None, help="each rank writes its pid here (tests look for orphans)")
    p.add_argument("--exit-code", type=int, default=None, help="exit at once with this code (tests)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="collective timeout")
    return p.parse_args(argv)


def build(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def load_checkpoint(directory: Path | None, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    path = directory / "latest.pt" if directory else None
    if path is None or not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def save_checkpoint(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".latest.{os.getpid()}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, directory / "latest.pt")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    elastic = elastic_environment()
    rank, world = elastic.RANK, elastic.WORLD_SIZE
    if args.pid_dir:
        Path(args.pid_dir, f"{os.getpid()}").write_text(str(rank))
    if args.exit_code is not None:
        return args.exit_code
    torch.set_num_threads(1)
    flight = FlightRecorder.from_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    model = build(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = load_checkpoint(ckpt, model, opt)
    restart = elastic.TORCHELASTIC_RESTART_COUNT
    for step in range(start, args.steps):
        if flight:
            flight.step(step)
            flight.enter("forward")
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, args.width, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        time.sleep(args.step_s)
        if flight:
            flight.enter("all_reduce(gradients)")
        for p in model.parameters():
            grad = p.grad
            assert grad is not None  # every parameter is in the loss
            dist.all_reduce(grad)
            grad /= world
        if flight:
            flight.enter("optimizer")
        opt.step()
        opt.zero_grad()
        done = step + 1
        if ckpt and done % args.checkpoint_every == 0 and rank == 0:
            if flight:
                flight.enter("checkpoint")
            save_checkpoint(ckpt, model, opt, done)
        if rank == 0 and args.progress_file:
            with open(args.progress_file, "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "step": done, "restart": restart, "world": world,
                                    "loss": loss.detach().item()}) + "\n")
    if flight:
        flight.enter("barrier(end)")
    dist.barrier()
    if flight:
        flight.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
