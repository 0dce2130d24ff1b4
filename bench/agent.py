"""Fail-stop → training again on CPU ranks: the node agent's restart vs a plain torchrun restart.

The same job both ways (trainer/agent/sample_job.py: gloo data parallel, a checkpoint every K
steps), ``--nodes`` agents on loopback with ``--ranks`` ranks in all. Once it has trained
``--warm-steps`` steps, one rank (not rank 0) is SIGKILLed; the clock runs from the kill to the
first step a new rank 0 finishes.

* ``agent``: ``resihp run --max-restarts 3``. The failed node's agent stops its ranks and joins
  the next rendezvous round; the other agents see a node waiting and restart theirs; the new
  ranks load the newest checkpoint. The phases come from the failed node's agent log.
* ``agent-preload``: the same with ``--preload torch``: ranks are forked from a server that has
  imported torch, so the restarted ranks import nothing.
* ``agent-shrink``: ``resihp run --on-failure shrink``: no restart. The failed node's agent marks
  the rank lost; the survivors re-form the world without it, take the state of the most advanced
  survivor and train on (trainer/agent/shrink.py). The clock stops at the first step rank 0
  finishes in the smaller world; the phases come from the new world's rank 0.
* ``agent-kill``: ``--on-failure shrink`` again, but the whole agent of the last node is SIGKILLed
  (its ranks die with it): a surviving agent sees its connection close, marks its ranks lost, and
  the other nodes' ranks shrink past them (needs ``--nodes`` ≥ 2).
* ``etcd-kill-node0``: ``--on-failure shrink`` with the rendezvous and every store of the job on a
  three-member etcd cluster on loopback (``--rdzv-backend etcd``, infra/etcd.py), and the agent of
  node 0 SIGKILLed: under c10d it serves the job's stores and its death ends the job; here the
  other nodes shrink past its ranks as past any dead agent's.
* ``etcd-kill-member``: the same job on etcd, and the etcd leader SIGKILLed (an election; every
  client moves to a live member): the clock runs from the kill to the first step finished after it,
  which is one step time when the job did not stall.
* ``torchrun``: ``python -m torch.distributed.run`` (max-restarts 0), as most jobs are launched.
  The failed node's torchrun exits; the harness (a scheduler, here) stops the others and launches
  the whole job again, which resumes from the same checkpoint.
* ``reference-tp|pp|dp`` and ``native-tp|pp|dp``: our own executors, 8 ranks under their own
  launcher (not the agents above), losing rank 1 in a TP, a pipeline-stage or a DP position;
  ``native-run``: the native executor's 8 ranks as a ``resihp run --on-failure shrink`` job
  losing rank 1 in a DP position (bench/_executor_failstop.py says how each is clocked).

The restarts lose the steps since the last checkpoint (``redone``); the shrink redoes at most the
step the failure interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable

from bench._executor_failstop import EXECUTOR_MODES, measure_executor
from infra.etcd import start_cluster

T = TypeVar("T")
MODES = ("agent", "agent-preload", "agent-shrink", "agent-kill", "etcd-kill-node0", "etcd-kill-member", "torchrun",
         *EXECUTOR_MODES)  # the last: our own trainers losing a rank in a TP, a PP and a DP position (bench/_executor_failstop.py)
FAST = ("agent", "agent-preload", "agent-shrink", "agent-kill", "etcd-kill-node0")  # compared with a torchrun restart
SHRINKING = ("agent-shrink", "agent-kill", "etcd-kill-node0")  # no restart: the survivors go on in a smaller world
ON_ETCD = ("etcd-kill-node0", "etcd-kill-member")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=8, help="ranks in the job (default 8)")
    parser.add_argument("--nodes", type=int, default=2, help="agents on loopback, ranks split evenly (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="failures measured per mode (default 3)")
    parser.add_argument("--warm-steps", type=int, default=6, help="steps trained before the kill (default 6)")
    parser.add_argument("--step-s", type=float, default=0.05, help="emulated device time per step (default 0.05)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--patience-s", type=float, default=600.0, help="give up on one measurement after this")


@dataclass
class Measurement:
    mode: str
    recovery_s: float
    redone_steps: int
    phases: dict[str, float] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return rows


def _launch(mode: str, args: argparse.Namespace, work: Path, port: int, attempt: int,
            etcd: str | None = None) -> list[subprocess.Popen]:
    per_node = args.ranks // args.nodes
    backend, endpoint = ("etcd", etcd) if etcd else ("c10d", f"127.0.0.1:{port}")
    rdzv = ["--nnodes", str(args.nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", f"bench-{attempt}", "--monitor-interval", "0.05",
            "--rdzv-conf", "join_timeout=600"]
    job = ["-m", "trainer.agent.sample_job", "--steps", "1000000", "--step-s", str(args.step_s),
           "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.checkpoint_every),
           "--progress-file", str(work / "progress.jsonl"), "--pid-dir", str(work / "pids")]
    procs = []
    for node in range(args.nodes):
        if mode.startswith("agent") or mode in ON_ETCD:
            preload = (["--preload", "torch"] if mode == "agent-preload" else
                       ["--on-failure", "shrink"] if mode in SHRINKING or mode in ON_ETCD else [])
            cmd = [sys.executable, "-m", "resihp.cli", "run", *rdzv, "--node-rank", str(node), "--max-restarts", "3",
                   "--no-telemetry", "--work-dir", str(work / f"agent-{node}"), *preload, *job]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--max-restarts", "0", *job]
        log = open(work / f"{mode}-{attempt}-node{node}.log", "w")  # the child owns it
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                      "OMP_NUM_THREADS": "1"}, start_new_session=True))
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait(what: str, check: Callable[[], T | None], patience_s: float) -> T:
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(0.02)
    raise SystemExit(f"bench agent: gave up waiting for {what} after {patience_s:.0f} s (see the logs)")


def _phases(work: Path, mode: str) -> dict[str, float]:
    """Each recovery phase's seconds since the failure was detected, from the agents' logs."""
    phases: dict[str, float] = {}
    for log in sorted(work.glob(f"{mode}-*.log"), reverse=True):  # the failed (last) node's agent first
        for line in log.read_text().splitlines():
            if line.startswith('{"event": "recovery"'):
                row = json.loads(line)
                phases.setdefault(row["phase"], row["since_detected_s"])
    return phases


def measure(mode: str, args: argparse.Namespace) -> Measurement:
    if mode in EXECUTOR_MODES:
        return measure_executor(mode, args)
    work = Path(tempfile.mkdtemp(prefix=f"resihp-bench-{mode}-"))
    (work / "pids").mkdir()
    progress = work / "progress.jsonl"
    cluster = start_cluster(work / "etcd") if mode in ON_ETCD else None  # a fresh one: a member may be killed
    procs: list[subprocess.Popen] = []
    try:
        procs = _launch(mode, args, work, _free_port(), 0, cluster.endpoints if cluster else None)
        _wait("the warm-up steps", lambda: True if len(_progress(progress)) >= args.warm_steps else None,
              args.patience_s)
        rows = _progress(progress)
        old_rank0 = rows[-1]["pid"]
        ranks = {int(p.name): int(p.read_text()) for p in (work / "pids").iterdir()}
        victim = next(pid for pid, rank in ranks.items() if rank == args.ranks - 1)
        if mode == "etcd-kill-node0":  # rank 0's: node 0, the one that hosts the stores under c10d
            victim = next(pid for pid, rank in ranks.items() if rank == 0)
        if mode in ("agent-kill", "etcd-kill-node0"):  # the agent that started that rank
            victim = int(Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[1])
        killed_at = time.time()
        if mode == "etcd-kill-member":
            assert cluster is not None
            cluster.kill(cluster.leader())
        else:
            os.kill(victim, signal.SIGKILL)
        last_step = rows[-1]["step"]
        if mode == "torchrun":
            _wait("torchrun to exit", lambda: True if any(p.poll() is not None for p in procs) else None,
                  args.patience_s)
            _stop(procs)
            procs = _launch(mode, args, work, _free_port(), 1)

        def again() -> dict | None:
            if mode == "etcd-kill-member":  # the same world goes on
                return next((r for r in _progress(progress) if r["t"] > killed_at), None)
            if mode in SHRINKING:  # the same rank 0 goes on, in a smaller world
                return next((r for r in _progress(progress) if r["world"] < args.ranks and r["t"] > killed_at), None)
            return next((r for r in _progress(progress) if r["pid"] != old_rank0 and r["t"] > killed_at), None)

        first = _wait("training again", again, args.patience_s)
        last_step = max(r["step"] for r in _progress(progress) if r["t"] <= killed_at)
        redone = last_step - (first["step"] - 1)
        if mode in SHRINKING:  # the new world's agent logs the phases once its rank 0 handed them over
            _wait("the recovery phases", lambda: _phases(work, mode) or None, args.patience_s)
        phases = _phases(work, mode)
    finally:
        _stop(procs)
        if cluster is not None:
            cluster.stop()
    return Measurement(mode, first["t"] - killed_at, redone, phases)


def run(args: argparse.Namespace) -> int:
    if ("agent-kill" in args.modes or "etcd-kill-node0" in args.modes) and args.nodes < 2:
        raise SystemExit("agent-kill and etcd-kill-node0 kill a whole agent and need --nodes 2 or more")
    if args.ranks % args.nodes:
        raise SystemExit(f"--ranks {args.ranks} must split evenly over --nodes {args.nodes}")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    results: dict[str, list[Measurement]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(measure(mode, args))
    print(f"fail-stop → training again, {args.ranks} CPU ranks on {args.nodes} agents, "
          f"checkpoint every {args.checkpoint_every} steps, {args.repeats} failures per mode")
    print(f"{'mode':<17} {'median s':>9} {'min s':>7} {'max s':>7} {'redone steps':>13}")
    medians = {}
    for mode, ms in results.items():
        times = [m.recovery_s for m in ms]
        medians[mode] = statistics.median(times)
        print(f"{mode:<17} {medians[mode]:>9.2f} {min(times):>7.2f} {max(times):>7.2f} "
              f"{statistics.median(m.redone_steps for m in ms):>13.0f}")
    for mode in (*FAST, *EXECUTOR_MODES):
        if mode in results and results[mode][0].phases:
            phases = {k: statistics.median(m.phases.get(k, float("nan")) for m in results[mode])
                      for k in results[mode][0].phases}
            print(f"{mode} phases (median s since the failure was detected): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    ratios = {m: medians["torchrun"] / medians[m] for m in FAST if {m, "torchrun"} <= set(medians)}
    for mode, ratio in ratios.items():
        print(f"torchrun restart / {mode}: {ratio:.2f}×")
    if args.json:
        print(json.dumps({"median_s": medians, "ratio_to_torchrun": ratios,
                          "runs": [m.__dict__ for ms in results.values() for m in ms]}))
    return 0
