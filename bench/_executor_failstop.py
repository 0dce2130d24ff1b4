"""Fail-stop → training again for our own executors: ``resihp bench agent`` modes ``reference-tp|pp|dp``,
``native-tp|pp|dp`` and ``native-run``.

The reference trainer (``resihp train``) runs 8 CPU ranks under its node agent (standalone on
loopback, ranks forked from a server that preloaded the trainer) in a layout where rank 1 holds a
TP, a PP or a DP position: TP2·PP1·DP4 (rank 1 is TP rank 1 of replica 0), TP1·PP2·DP4 (stage 1
of replica 0), TP1·PP1·DP8 (replica 1). At ``--kill-at`` rank 1 exits (a ``stop_device`` fault,
``os._exit`` at the start of the iteration); the launcher's on-death policy (``drop-replica``)
drops its replica and the survivors move state live.

The clock starts at the agent's monitor pass that sees the exit (every 0.05 s, so at most that
after the death) and stops at the same loop's pass that sees the first iteration the new plan
committed: both ends read by one process on one clock. Before the survivors learnt of a death from
the loss count (trainer/agent/wake.py), those not next to the dead rank waited out the collective
timeout (``--pg-timeout``, 5 s here as in ``resihp bench reshape``).

The native executor (``resihp train --native``) runs the same three layouts on 8 CPU ranks under
its launcher (replicas hold whole copies, so every piece has a live holder), and rank 1 is
SIGKILLed in its first forward chunk of ``--kill-at``; the survivors close their quorum, go on at
the survivors' plan (a TP group at the smaller degree on its TP peers; a stage's only rank lost:
its replica dropped) and redo the iteration. Its launcher prints no iterations, so the figure is
the ranks' own: each survivor's recovery phases summed (``agree`` runs from the step that failed
to the quorum), the slowest survivor; what it leaves out is the launcher's notice of the death
(its monitor interval, 0.05 s at most).

``native-run`` is the native executor as an ordinary ``resihp run`` job (trainer/native/job.py):
``resihp run --standalone --nproc-per-node 8 --on-failure shrink --preload trainer.native.worker
-m trainer.native.job --spec …`` in the DP layout, rank 1 SIGKILLed the same way. The clock is
the agent's and the ranks' output read as it comes: from the agent's line that rank 1 was killed
(its monitor pass, every 0.05 s) to world rank 0's line for the first iteration at the survivors'
plan (``--echo``), as the reference modes are clocked.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

EXECUTOR_MODES = ("reference-tp", "reference-pp", "reference-dp", "native-tp", "native-pp", "native-dp", "native-run")
LAYOUTS = {"tp": (2, 1, 4), "pp": (1, 2, 4), "dp": (1, 1, 8)}  # (tp, pp, dp) of each position rank 1 holds
VICTIM = 1
KILL_AT = 6
PG_TIMEOUT_S = 5.0


def measure_executor(mode: str, args: argparse.Namespace):
    """One fail-stop of ``mode``'s layout; a ``bench.agent.Measurement`` (its phases: the reshape's
    pause from the acknowledgement, and what came before it)."""
    if args.ranks != 8:
        raise SystemExit(f"{mode} runs 8 ranks (its layouts are 8 devices); pass --ranks 8")
    if mode == "native-run":
        return _measure_native_run()
    if mode.startswith("native-"):
        return _measure_native(mode)
    from bench.agent import Measurement
    from collector.plan import Plan
    from trainer.fault_spec import FaultSpec
    from trainer.reference.launcher import launch
    from trainer.reference.model import GPTConfig
    from trainer.reference.spec import RunSpec
    from trainer.spec import BusSpec

    tp, pp, dp = LAYOUTS[mode.split("-")[1]]
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4, microbatches_per_replica=2)
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=64)
    tmp = Path(tempfile.mkdtemp(prefix=f"resihp-bench-{mode}-"))
    spec = RunSpec(job=f"bench-{mode}", model=asdict(cfg), iterations=KILL_AT + 3, pg_timeout_s=PG_TIMEOUT_S,
                   bus=BusSpec(backend="embedded", path=str(tmp / "bus.sqlite")), heartbeat_s=1.0,
                   faults=[FaultSpec(kind="stop_device", device=VICTIM, at_iteration=KILL_AT)])
    seen: dict[str, float] = {}

    def echo(line: str) -> None:
        now = time.monotonic()
        if line.startswith(f"device {VICTIM} exited"):
            seen.setdefault("death", now)
        elif line.startswith("iteration ") and " epoch 1 " in line:
            seen.setdefault("again", now)

    try:
        result = launch(spec, plan, 8, on_death="drop-replica", echo=echo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    applied = [a for a in result.acks if a.status.value == "applied" and a.epoch == 1]
    if {"death", "again"} - set(seen) or not applied:
        raise SystemExit(f"bench agent {mode}: the job did not train again after rank {VICTIM} died "
                         f"(exit codes {result.exit_codes}, acks {[a.status.value for a in result.acks]})")
    recovery_s = seen["again"] - seen["death"]
    pause_s = max(a.pause_s for a in applied)
    return Measurement(mode, recovery_s, 1, {"reshape (the ack's pause)": pause_s})


def _native_spec(mode: str, layout: str, out_dir: Path):
    """The native modes' run: rank 1 SIGKILLed in its first forward chunk of ``KILL_AT``."""
    from collector.plan import Plan
    from trainer.fault_spec import FaultSpec
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec

    tp, pp, dp = LAYOUTS[layout]
    plan = Plan.uniform(tp=tp, pp=pp, dp=dp, num_layers=4, microbatches_per_replica=2)
    cfg = LlamaConfig(dim=64, n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256)
    return NativeRunSpec(job=f"bench-{mode}", model=asdict(cfg),
                         settings=asdict(TrainSettings(block_size=32, dp_mode="replicate")), plan=plan,
                         iterations=KILL_AT + 3, out_dir=str(out_dir), timeout_s=PG_TIMEOUT_S * 3, device="cpu",
                         faults=[FaultSpec(kind="stop_device", device=VICTIM, at_iteration=KILL_AT)])


def _slowest_recovery(mode: str, out_dir: Path, codes: dict[int, int]) -> tuple[float, dict[str, float]]:
    """The slowest survivor's recovery phases, summed, and each (rank result files in ``out_dir``)."""
    from trainer.native.worker import read_results

    ranks, _ = read_results(out_dir)
    survivors = {d: r for d, r in ranks.items() if r.get("reshapes")}
    if codes.get(VICTIM) != -9 or not survivors:
        raise SystemExit(f"bench agent {mode}: the job did not recover from rank {VICTIM}'s death (exit codes {codes})")
    totals = {d: sum(r["reshapes"][0]["phases_s"].values()) for d, r in survivors.items()}
    slowest = max(totals, key=lambda d: totals[d])
    return totals[slowest], {k: float(v) for k, v in survivors[slowest]["reshapes"][0]["phases_s"].items()}


def _measure_native(mode: str):
    """One SIGKILL of rank 1 under the native executor's launcher (see the module's docstring)."""
    from bench.agent import Measurement
    from trainer.native.worker import launch_native

    tmp = Path(tempfile.mkdtemp(prefix=f"resihp-bench-{mode}-"))
    try:
        codes = launch_native(_native_spec(mode, mode.split("-")[1], tmp))
        total_s, phases = _slowest_recovery(mode, tmp, codes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Measurement(mode, total_s, 1, phases)


def _measure_native_run():
    """One SIGKILL of rank 1 of a native DP8 job started with ``resihp run --on-failure shrink``,
    clocked on the agent's and the ranks' output (see the module's docstring)."""
    from bench.agent import Measurement

    mode = "native-run"
    tmp = Path(tempfile.mkdtemp(prefix=f"resihp-bench-{mode}-"))
    try:
        spec = _native_spec(mode, "dp", tmp / "out").model_copy(update={"echo": True})
        (tmp / "spec.json").write_text(spec.model_dump_json())
        cmd = [sys.executable, "-m", "resihp.cli", "run", "--no-telemetry", "--standalone", "--nproc-per-node", "8",
               "--monitor-interval", "0.05", "--on-failure", "shrink", "--preload", "trainer.native.worker",
               "--work-dir", str(tmp / "agent"), "-m", "trainer.native.job", "--spec", str(tmp / "spec.json")]
        seen: dict[str, float] = {}
        lines: list[str] = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) as agent:
            assert agent.stdout is not None
            for line in agent.stdout:
                now = time.monotonic()
                lines.append(line)
                if f"rank {VICTIM} (local {VICTIM}" in line and "SIGKILL" in line:
                    seen.setdefault("death", now)
                elif line.startswith("iteration ") and " epoch 1 " in line:
                    seen.setdefault("again", now)
        if agent.returncode != 0 or {"death", "again"} - set(seen):
            raise SystemExit(f"bench agent {mode}: the job did not train again after rank {VICTIM} died (exit "
                             f"{agent.returncode}):\n{''.join(lines[-20:])}")
        codes = {VICTIM: -9}  # the agent said so (above); the others' exit is the agent's 0
        _, phases = _slowest_recovery(mode, tmp / "out", codes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Measurement(mode, seen["again"] - seen["death"], 1, phases)
