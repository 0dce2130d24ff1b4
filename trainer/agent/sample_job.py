"""A small data-parallel job for ``resihp run``: gloo, periodic checkpoints, a flight record.

``resihp run --standalone --nproc-per-node 2 -m trainer.agent.sample_job --steps 20`` trains an
MLP on random data with its gradients all-reduced, checkpoints every ``--checkpoint-every`` steps
(rank 0 writes, atomically) and resumes from the newest checkpoint when the agent restarts it:
the job the agent's tests and ``resihp bench agent`` run. It keeps a flight record
(trainer/agent/flight.py) so the agent can judge hangs, and appends one JSON line per finished
step to ``--progress-file`` (rank 0) so a benchmark can see when training runs again.

The global batch is fixed (``--batch`` samples per step, sample i of step s drawn from seed
(s, i)) and split over whatever world there is, each rank's loss a share of the global mean: the
gradient, and so the state after any number of steps, does not depend on the world size. Under
``--on-failure shrink`` a rank that dies costs the job no restart: the survivors recover in place
(trainer/agent/shrink.py) and train the same batches on fewer ranks, so the state at the end
equals :func:`reference_state` (one process, no failure) to float tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from collector.settings import elastic_environment
from trainer.agent.flight import FlightRecorder
from trainer.agent.shrink import ShrinkingWorld, WorldFinished, shrink_enabled
from trainer.agent.shrink_executor import WorldTelemetry


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.agent.sample_job", description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="samples per step, split over the world")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--step-s", type=float, default=0.05, help="extra seconds per step (emulates a device)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--progress-file", default=None)
    p.add_argument("--final-state", default=None, help="rank 0 saves the model's state here at the end (tests)")
    p.add_argument("--stop-file", default=None,
                   help="end the job at the first step boundary where this file exists on some rank, every rank at "
                        "the same step (tests and benchmarks: the run ends once it has shown what it must)")
    p.add_argument("--pid-dir", default=None, help="each rank writes its pid here (tests look for orphans)")
    p.add_argument("--exit-code", type=int, default=None, help="exit at once with this code (tests)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="collective timeout")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="ignore SIGTERM, as a rank stuck in a driver call does (tests: the agent's SIGKILL after grace)")
    p.add_argument("--report", action="store_true",
                   help="publish each rank's telemetry (a forward and a backward chunk per micro-batch, the gradient "
                        "all-reduce) and, from the world's first rank, the world it steps in, for the agent's executor "
                        "(trainer/agent/shrink_executor.py): the platform can then find a slow node and order it out; "
                        "needs the bus (not --no-telemetry) and --on-failure shrink")
    p.add_argument("--microbatch", type=int, default=16, help="samples per micro-batch (--report)")
    p.add_argument("--sample-s", type=float, default=0.0,
                   help="extra seconds per sample of the rank's share (emulates a device whose time scales with the work)")
    p.add_argument("--slow", default=None, metavar="FACTOR@STEP",
                   help="this process's emulated device (--step-s, --sample-s) is FACTOR times slower from step STEP: "
                        "give it to one node's agent to emulate a slow node")
    return p.parse_args(argv)


def slowdown(spec: str | None) -> tuple[float, int]:
    """``--slow FACTOR@STEP`` as (factor, first step); (1, 0) when not given."""
    if not spec:
        return 1.0, 0
    factor, _, step = spec.partition("@")
    try:
        parsed = float(factor), int(step or 0)
    except ValueError:
        raise SystemExit(f"--slow {spec!r}: expected FACTOR@STEP, e.g. 3@20") from None
    if parsed[0] < 1 or parsed[1] < 0:
        raise SystemExit(f"--slow {spec!r}: FACTOR is at least 1 and STEP a step number from 0")
    return parsed


def build(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def sample(step: int, index: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` of step ``step``: the same on every world size."""
    gen = torch.Generator().manual_seed(step * 100_003 + index)
    x = torch.randn(width, generator=gen)
    return x, x[: width // 2].sum(dim=0, keepdim=True) * 0.1


def local_loss(model: torch.nn.Module, step: int, rank: int, world: int, batch: int, width: int) -> torch.Tensor:
    """This rank's share of the step's mean squared error: its samples (i ≡ rank mod world) over the global batch."""
    return share_loss(model, step, list(range(rank, batch, world)), batch, width)


def share_loss(model: torch.nn.Module, step: int, indices: list[int], batch: int, width: int) -> torch.Tensor:
    """The samples ``indices`` of step ``step``'s share of the mean squared error over the global batch."""
    pairs = [sample(step, i, width) for i in indices]
    if not pairs:
        return sum((p.sum() * 0 for p in model.parameters()), torch.zeros(()))
    x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return (model(x) - y).pow(2).sum() / batch


def reference_state(steps: int, width: int = 64, batch: int = 64, lr: float = 0.01) -> dict[str, torch.Tensor]:
    """The model after ``steps`` steps in one process with no failure: what every world must reach."""
    model = build(width)
    opt = optimizer(model, lr)
    for step in range(steps):
        local_loss(model, step, 0, 1, batch, width).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


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


def stop_agreed(world: ShrinkingWorld | None, path: str) -> bool:
    """Whether the ranks end the job here: ``path`` exists on some rank (one all-reduce of one
    number, so every rank ends after the same step)."""
    here = int(os.path.exists(path))
    if world is not None:
        return world.agree_max(here, "all_reduce(stop)") > 0
    flag = torch.tensor([here])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag[0])


def train(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
          world: ShrinkingWorld | None, flight: FlightRecorder | None, restart: int,
          state: Callable[[], dict], load: Callable[[dict], None], telemetry: WorldTelemetry | None = None) -> None:
    """Steps ``step`` … ``args.steps`` − 1; under a shrinking world, a failed collective is recovered
    in place and the step is run again by the new world."""
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    slow = slowdown(args.slow)
    while step < args.steps:
        if args.stop_file:
            stop_started = time.monotonic()
            try:
                if stop_agreed(world, args.stop_file):
                    return
            except (RuntimeError, dist.DistError):
                if world is None:
                    raise
                step = world.recover("all_reduce(stop)", stop_started, step, state, load)
                continue
        rank = world.rank if world else dist.get_rank()
        size = world.world_size if world else dist.get_world_size()
        if flight:
            flight.step(step)
            flight.enter("forward")
        report = telemetry.begin(step, world) if telemetry and world else None
        factor = slow[0] if step >= slow[1] else 1.0
        indices = list(range(rank, args.batch, size))
        loss = torch.zeros(())
        per_mb = args.microbatch if args.report else max(1, len(indices))  # unreported: the share at once, as ever
        for mb, start in enumerate(range(0, max(1, len(indices)), per_mb)):
            part = indices[start:start + per_mb]
            began = time.perf_counter()
            mb_loss = share_loss(model, step, part, args.batch, args.width)
            if report is not None and part:
                report.chunk("F", mb, duration_s=time.perf_counter() - began, seq_lens=[args.width] * len(part))
            began = time.perf_counter()
            mb_loss.backward()
            time.sleep(args.sample_s * len(part) * factor)  # the emulated device's share of the work
            if report is not None and part:
                report.chunk("B", mb, duration_s=time.perf_counter() - began, seq_lens=[args.width] * len(part))
            loss = loss + mb_loss.detach()
        time.sleep(args.step_s * factor)
        if flight:
            flight.enter("all_reduce(gradients)")
        reduce_started = time.monotonic()
        try:
            for p in model.parameters():
                assert p.grad is not None  # every parameter is in the loss
                if world:
                    world.all_reduce(p.grad, "all_reduce(gradients)")
                else:
                    dist.all_reduce(p.grad)
        except (RuntimeError, dist.DistError):
            if world is None:
                raise
            opt.zero_grad()
            if flight:
                flight.enter("recovery")
            step = world.recover("all_reduce(gradients)", reduce_started, step, state, load)
            continue
        if report is not None and telemetry is not None:
            report.comm_wait("dp_allreduce", duration_s=time.monotonic() - reduce_started)
            telemetry.end(report, loss.item() * size if rank == 0 else None)
        if flight:
            flight.enter("optimizer")
        opt.step()
        opt.zero_grad()
        step += 1
        if world:
            world.stepped()
        # the step's record before the world changes at its boundary: a rank 0 drained there leaves in admit
        if ckpt and step % args.checkpoint_every == 0 and rank == 0:
            if flight:
                flight.enter("checkpoint")
            save_checkpoint(ckpt, model, opt, step)
        if rank == 0 and args.progress_file:
            with open(args.progress_file, "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "step": step, "restart": restart,
                                    "world": size, "loss": loss.detach().item() * size}) + "\n")
        if world:
            admit_started = time.monotonic()
            try:
                step = world.admit(step, state, load)  # a benched rank that runs again rejoins here
            except (RuntimeError, dist.DistError):
                step = world.recover("all_reduce(rejoin requests)", admit_started, step, state, load)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    elastic = elastic_environment()
    if args.pid_dir:
        Path(args.pid_dir, f"{os.getpid()}").write_text(str(elastic.RANK))
    if args.exit_code is not None:
        return args.exit_code
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    flight = FlightRecorder.from_env()
    world = ShrinkingWorld.from_env(args.timeout_s) if shrink_enabled() else None
    if world is None:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    model = build(args.width)
    opt = optimizer(model, args.lr)
    step = load_checkpoint(ckpt, model, opt)
    restart = elastic.TORCHELASTIC_RESTART_COUNT

    def state() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(saved: dict) -> None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])

    telemetry = WorldTelemetry(args, elastic.RANK) if args.report and world is not None else None
    try:
        if world is not None and world.joining:  # it replaces a lost rank: the world takes it at a step boundary
            if flight:
                flight.enter("join")
            step = world.join(state, load)
        train(args, model, opt, step, world, flight, restart, state, load, telemetry)
    except WorldFinished:  # benched, and the world ended the job before taking this rank back
        if telemetry:
            telemetry.close()
        if flight:
            flight.finish()
        os._exit(0)
    if telemetry:
        telemetry.close()
    if flight:
        flight.enter("barrier(end)")
    world.barrier() if world else dist.barrier()
    if world:
        world.finish()
    if flight:
        flight.finish()
    if args.final_state and (world.rank if world else dist.get_rank()) == 0:
        torch.save(model.state_dict(), args.final_state)
    if world is None:
        dist.destroy_process_group()
    elif world.abandoned:  # an abandoned group's threads may still wait on a dead peer: no teardown
        os._exit(0)
    return 0


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown. Everything is written and the group
    destroyed by then, and the teardown only runs C++ destructors: one of torch's store or gloo
    threads, still joinable there, can abort the process ("terminate called without an active
    exception", SIGABRT) after a run that succeeded, which the agent rightly counts as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
