"""torchtitan under ResiHP end to end: its own entry point under ``resihp run``, a slow device found
and remediated by a restart at a new layout, and the restarted run exact.

``resihp demo --trainer torchtitan --short`` runs real processes on the embedded bus: torchtitan's
``torchtitan.train`` with ``--module trainer.torchtitan`` on four CPU ranks (data-parallel
replicas, gloo) under the node agent, the analytics consumer with the detector, the engine with
auto-apply. A ×3 fail-slow on device 1 must be found on that rank, answered with a uniform layout
that leaves device 1 out (the capabilities torchtitan declares), applied by the agent (stop at an
agreed step, DCP checkpoint, restart at the new degrees) and acknowledged with the pause's phases.

Then exactness: torchtitan started afresh at the new layout from the checkpoint the restart
resumed from trains the same losses, step for step to the end, as the remediated run did (fp32 on
CPU, the same reductions in the same order: equal to 1e-6 relative; in practice bit for bit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import (AckStatus, CommandAck, ExecutorCapabilities, IterationSummary, PlanCurrent, PlanProposed,
                              ReshapePhase)
from collector.stream import EventStream
from tests.test_demo_e2e import _component_logs
from trainer.torchtitan.layout import TitanLayout, layout_of, with_flags

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]


def _events(path: Path, topic_names: list[str]) -> list:
    with EmbeddedBus(path) as bus:
        stream = EventStream(bus, "test", topic_names, on_assign=lambda ps: {tp: 0 for tp in ps})
        out = []
        while batch := stream.poll(timeout_s=0.2):
            out += [d.event.payload for d in batch]
        stream.close()
    return out


def _losses(events: list, epoch: int) -> dict[int, float]:
    return {e.iteration: e.loss for e in events if isinstance(e, IterationSummary) and e.epoch == epoch and e.loss}


def test_a_slow_device_in_a_torchtitan_job_is_left_out_by_a_restart_and_the_restart_is_exact(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "demo", "--headless", "--json", "--short", "--trainer", "torchtitan",
         "--workdir", str(workdir), "--timeout", "600"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}{_component_logs(workdir)}"
    result = json.loads(lines[-1])
    why = f"\n{json.dumps(result, indent=1)}\n{proc.stderr[-4000:]}{_component_logs(workdir)}"

    (fault,) = result["injected"]
    (found,) = [d for d in result["detected"] if d["matches"] == fault["fault_id"]]
    assert found["localised"] == "rank" and found["ranks"] == [1], why
    assert result["plans_applied"] >= 1 and result["complete"] is True, why

    control = _events(workdir / "bus.sqlite", [topics.CONTROL])
    telemetry = _events(workdir / "bus.sqlite", [topics.TELEMETRY])
    (caps,) = [e for e in control if isinstance(e, ExecutorCapabilities)]
    assert caps.executor == "torchtitan", why
    proposed = [e for e in control if isinstance(e, PlanProposed)]
    assert proposed and all(1 not in p.plan.devices for p in proposed), why
    applied = [e for e in control if isinstance(e, CommandAck) and e.status == AckStatus.APPLIED]
    assert applied and 0 < applied[0].pause_s, why
    phases = [e.phase for e in telemetry if isinstance(e, ReshapePhase) and e.epoch == applied[0].epoch]
    assert phases == ["export", "new_mesh", "first_step"], why
    new_plan = next(e.plan for e in control if isinstance(e, PlanCurrent) and e.plan.epoch == applied[0].epoch)
    assert 1 not in new_plan.devices, why
    stopped_at = int(applied[0].detail.rsplit("step ", 1)[1])

    # the remediated run's losses after the restart, against a fresh start from the same checkpoint
    remediated = _losses(telemetry, applied[0].epoch)
    steps = sorted(s for s in remediated if s > stopped_at)
    assert len(steps) >= 3, why
    fresh = tmp_path / "fresh"
    shutil.copytree(workdir / "torchtitan" / "checkpoint" / f"step-{stopped_at}",
                    fresh / "checkpoint" / f"step-{stopped_at}")
    layout, _ = layout_of(new_plan, TitanLayout(dp_replicate=result["gpus"]))  # PP, TP and DP as the plan has them
    argv = json.loads((workdir / "torchtitan-argv.json").read_text())
    args = with_flags(argv, layout.flags(new_plan.pipelines[0].microbatches, 1))
    # the same --training.steps: the learning-rate schedule is a function of them
    args = with_flags(args, ["--dump_folder", str(fresh), "--checkpoint.enable"],
                      replaced=("--dump_folder", "--resihp.faults"))
    env = dict(os.environ, RESIHP_EMBEDDED_PATH=str(fresh / "bus.sqlite"))
    env.pop("RESIHP_BUS", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(layout.world), "-m", "torchtitan.train", *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    again = _losses(_events(fresh / "bus.sqlite", [topics.TELEMETRY]), 0)
    for step in steps:
        assert again[step] == pytest.approx(remediated[step], rel=1e-6), (step, again, remediated)
