"""``resihp run --on-failure shrink``: a SIGKILLed rank costs the job no restart.

Real agents on loopback (2 agents × 2 ranks, gloo on CPU) run trainer/agent/sample_job.py; one
rank is SIGKILLed mid-run. The survivors keep their processes, re-form a 3-rank world from their
own state and train to the end, and the model they end with equals a one-process run with no
failure (the sample job's global batch does not depend on the world size).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from collector import topics
from collector.bus import open_bus
from collector.events import RecoveryPhase
from collector.stream import EventStream
from tests.test_agent_run import agent_cmd, alive, env, free_port, pid_dir, rows_of, wait_until, written_pids
from trainer.agent.sample_job import reference_state
from trainer.agent.shrink import PHASES

STEPS = 14


def test_a_killed_rank_leaves_the_survivors_training_to_the_reference_state(tmp_path: Path) -> None:
    port = free_port()
    progress = tmp_path / "progress.jsonl"
    bus_path = tmp_path / "bus.sqlite"
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--max-restarts", "0",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job-s", "--rdzv-conf", "join_timeout=300",
              "--monitor-interval", "0.05", "--on-failure", "shrink", "--job", "shrink-job")
    job = ("--steps", str(STEPS), "--step-s", "0.2", "--progress-file", str(progress), "--pid-dir",
           str(pid_dir(tmp_path)), "--final-state", str(tmp_path / "final.pt"))
    agents = []
    for n in (0, 1):
        argv = agent_cmd(*common, "--node-rank", str(n), "--work-dir", str(tmp_path / f"w{n}"), job_args=job)
        at = argv.index("--no-telemetry")
        cmd = [*argv[:at], "--bus", "embedded", "--bus-path", str(bus_path), *argv[at + 1:]]
        agents.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        wait_until(lambda: len(rows_of(progress)) >= 4)
        first_pids = set(written_pids(tmp_path))
        rank3 = next(pid for pid in first_pids if (pid_dir(tmp_path) / str(pid)).read_text() == "3")
        os.kill(rank3, signal.SIGKILL)
        killed_at = time.time()
        outs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], outs
    rows = rows_of(progress)
    assert {r["world"] for r in rows if r["t"] <= killed_at} == {4}
    assert {r["world"] for r in rows if r["t"] > killed_at + 0.5} == {3}
    assert rows[-1]["step"] == STEPS and {r["restart"] for r in rows} == {0}
    assert set(written_pids(tmp_path)) == first_pids and alive(list(first_pids)) == []  # nobody restarted, nothing left
    assert "rank 3 (local 1" in outs[1] and "its peers go on without it" in outs[1]

    final = torch.load(tmp_path / "final.pt", weights_only=True)
    reference = reference_state(STEPS)
    for name, tensor in reference.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)

    bus = open_bus("embedded", path=str(bus_path))
    stream = EventStream(bus, "test", [topics.TELEMETRY], job="shrink-job")
    phases = [d.event.payload for d in stream.poll(timeout_s=1.0) if isinstance(d.event.payload, RecoveryPhase)]
    bus.close()
    assert [p.phase for p in phases] == list(PHASES)
    assert {(p.generation, tuple(p.world), tuple(p.lost)) for p in phases} == {(1, (0, 1, 2), (3,))}
    assert all(p.duration_s >= 0 for p in phases) and phases[-1].since_detected_s >= phases[1].since_detected_s
    recovery_lines = [json.loads(line) for out in outs for line in out.splitlines() if '"mode": "shrink"' in line]
    assert [r["phase"] for r in recovery_lines] == list(PHASES)
