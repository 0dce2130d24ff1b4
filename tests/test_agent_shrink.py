"""``resihp run --on-failure shrink``: a SIGKILLed rank costs the job no restart.

Real agents on loopback (2 agents × 2 ranks, gloo on CPU) run trainer/agent/sample_job.py; one
rank is SIGKILLed mid-run. The survivors keep their processes, re-form a 3-rank world from their
own state and train to the end, and the model they end with equals a one-process run with no
failure (the sample job's global batch does not depend on the world size).
"""

from __future__ import annotations

import pytest
import json
import os
import signal
import subprocess
from pathlib import Path

import torch

from collector import topics
from collector.bus import open_bus
from collector.events import RecoveryPhase
from collector.stream import EventStream
from tests.test_agent_run import (agent_cmd, alive, env, free_port, kill_rank_and_wait, parent_of, pid_dir, rows_of,
                                  wait_until, written_pids)
from trainer.agent.sample_job import reference_state
from trainer.agent.shrink import PHASES

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

STEPS = 14


def shrink_agent(tmp_path: Path, port: int, node: int, steps: int, *flags: str, log: Path | None = None,
                 ) -> subprocess.Popen:
    """One agent of a 2-agent × 2-rank job under --on-failure shrink, publishing to one embedded bus;
    its output is piped, or written to ``log``."""
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--max-restarts", "0",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job-s", "--rdzv-conf", "join_timeout=300",
              "--monitor-interval", "0.05", "--on-failure", "shrink", "--job", "shrink-job")
    job = ("--steps", str(steps), "--step-s", "0.2", "--progress-file", str(tmp_path / "progress.jsonl"), "--pid-dir",
           str(pid_dir(tmp_path)), "--final-state", str(tmp_path / "final.pt"))
    argv = agent_cmd(*common, "--node-rank", str(node), "--work-dir", str(tmp_path / f"w{node}-{len(flags)}"), *flags,
                     job_args=job)
    at = argv.index("--no-telemetry")
    cmd = [*argv[:at], "--bus", "embedded", "--bus-path", str(tmp_path / "bus.sqlite"), *argv[at + 1:]]
    out = open(log, "w") if log else subprocess.PIPE  # the child owns it
    return subprocess.Popen(cmd, env=env(), stdout=out, stderr=subprocess.STDOUT, text=True)


def standalone_shrink_agent(tmp_path: Path, steps: int, step_s: float, *flags: str) -> subprocess.Popen:
    """One standalone agent of 3 ranks under --on-failure shrink (its output piped), writing its
    progress to ``progress.jsonl``."""
    argv = agent_cmd("--standalone", "--nproc-per-node", "3", "--monitor-interval", "0.05", "--on-failure", "shrink",
                     "--work-dir", str(tmp_path / "w"), *flags,
                     job_args=("--steps", str(steps), "--step-s", str(step_s), "--progress-file",
                               str(tmp_path / "progress.jsonl"), "--pid-dir", str(pid_dir(tmp_path)),
                               "--final-state", str(tmp_path / "final.pt")))
    return subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_two_agents(tmp_path: Path, steps: int = STEPS) -> tuple[list[subprocess.Popen], int]:
    port = free_port()
    return [shrink_agent(tmp_path, port, n, steps) for n in (0, 1)], port


def assert_reference_state(tmp_path: Path, steps: int = STEPS) -> None:
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, tensor in reference_state(steps).items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)


def first_recovery(tmp_path: Path) -> list[RecoveryPhase]:
    """The phases of generation 1 on the bus (later ones: a slow rank benched under load, taken back)."""
    bus = open_bus("embedded", path=str(tmp_path / "bus.sqlite"))
    stream = EventStream(bus, "test", [topics.TELEMETRY], job="shrink-job")
    phases = [d.event.payload for d in stream.poll(timeout_s=1.0) if isinstance(d.event.payload, RecoveryPhase)]
    bus.close()
    return [p for p in phases if p.generation == 1]


def test_a_killed_rank_leaves_the_survivors_training_to_the_reference_state(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    agents, _ = start_two_agents(tmp_path)
    outs, killed_at, first_pids = kill_rank_and_wait(agents, progress, tmp_path, rank=3, after_rows=4)
    assert [a.returncode for a in agents] == [0, 0], outs
    rows = rows_of(progress)
    assert {r["world"] for r in rows if r["t"] <= killed_at} == {4}
    after = {r["world"] for r in rows if r["t"] > killed_at + 0.5}
    assert 3 in after and 4 not in after  # (a rank benched for a slow step under load rejoins: 2 is allowed)
    assert rows[-1]["step"] == STEPS and {r["restart"] for r in rows} == {0}
    assert set(written_pids(tmp_path)) == first_pids and alive(list(first_pids)) == []  # nobody restarted, nothing left
    assert "rank 3 (local 1" in outs[1] and "its peers go on without it" in outs[1]

    assert_reference_state(tmp_path)
    first = first_recovery(tmp_path)
    assert [p.phase for p in first] == list(PHASES)
    assert {(tuple(p.world), tuple(p.lost)) for p in first} == {((0, 1, 2), (3,))}
    assert all(p.duration_s >= 0 for p in first) and first[-1].since_detected_s >= first[1].since_detected_s
    recovery_lines = [json.loads(line) for out in outs for line in out.splitlines() if '"mode": "shrink"' in line]
    assert [r["phase"] for r in recovery_lines if r["generation"] == 1] == list(PHASES)


def test_a_killed_agent_leaves_the_other_node_training_and_a_spare_agent_takes_its_place(tmp_path: Path) -> None:
    """A spare agent (--join-running) waits; SIGKILL of node 1's agent (not the one hosting the
    rendezvous): its ranks die with it, the agent of node 0 sees its connection close, marks ranks
    2 and 3 lost, and ranks 0 and 1 shrink past them without a restart; the spare takes node 1's
    place, its new ranks 2 and 3 join at a step boundary with the survivors' state, and the job
    ends at the reference state with every process gone."""
    steps = 300  # long enough for the spare's ranks to start (import torch) while the job runs
    progress, spare_log = tmp_path / "progress.jsonl", tmp_path / "spare.log"
    agents, port = start_two_agents(tmp_path, steps)
    spare = shrink_agent(tmp_path, port, 1, steps, "--join-running", log=spare_log)
    try:
        wait_until(lambda: spare_log.exists() and "waiting for a place" in spare_log.read_text())
        outs, killed_at, first_pids = kill_rank_and_wait(agents, progress, tmp_path, rank=2, after_rows=4,
                                                         whole_agent=True)
        spare.wait(timeout=600)
    finally:
        if spare.poll() is None:
            spare.kill()
            spare.wait()
    spare_out = spare_log.read_text()
    assert [a.returncode for a in agents] == [0, -signal.SIGKILL] and spare.returncode == 0, [*outs, spare_out]
    worlds = [r["world"] for r in rows_of(progress)]
    shrunk = worlds.index(2)
    assert set(worlds[:shrunk]) == {4} and 4 in worlds[shrunk:] and worlds[-1] == 4  # 4 → 2 → 4
    assert rows_of(progress)[-1]["step"] == steps
    assert "the agent of node 1 is gone with its ranks [2, 3]; ranks [2, 3] marked lost" in outs[0], outs[0]
    assert {r["restart"] for r in rows_of(progress)} == {0}
    first = first_recovery(tmp_path)
    assert [p.phase for p in first] == list(PHASES)
    assert {(tuple(p.world), tuple(p.lost)) for p in first} == {((0, 1), (2, 3))}
    assert "rank 2 joined the world" in spare_out and "rank 3 joined the world" in spare_out
    assert "hang:" not in spare_out, spare_out
    pids = written_pids(tmp_path)
    assert len(set(pids) - first_pids) == 2 and alive(pids) == []  # two new ranks, and nothing left running
    assert_reference_state(tmp_path, steps)


def test_a_stopped_rank_is_reported_benched_and_rejoins_when_it_runs_again(tmp_path: Path) -> None:
    """SIGSTOP of a rank: the hang report names it and the op it is stuck in, its peers go on
    without it; SIGCONT: it asks to rejoin, the world grows back at the next step and the run ends
    at the reference state."""
    steps = 60
    progress = tmp_path / "progress.jsonl"
    agent = standalone_shrink_agent(tmp_path, steps, 0.1, "--hang-floor-s", "2")
    try:
        wait_until(lambda: len(rows_of(progress)) >= 4)
        rank_of = {pid: int((pid_dir(tmp_path) / str(pid)).read_text()) for pid in written_pids(tmp_path)}
        victim = next(pid for pid, rank in rank_of.items() if rank == 2)
        os.kill(victim, signal.SIGSTOP)
        wait_until(lambda: any(r["world"] == 2 for r in rows_of(progress)[-3:]))
        shrunk_rows = len(rows_of(progress))
        os.kill(victim, signal.SIGCONT)
        out = agent.communicate(timeout=600)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, out
    reports = [json.loads(p.read_text()) for p in (tmp_path / "w").glob("hang-*.json")]
    assert any(r["culprits"] == [2] and r["op"] and "is stopped" in r["stacks"]["2"] for r in reports), reports
    assert "rank 2 benched" in out and "rank 2 rejoined the world" in out
    worlds = [r["world"] for r in rows_of(progress)]
    assert worlds[0] == 3 and worlds[shrunk_rows - 1] == 2 and 3 in worlds[shrunk_rows:]  # 3 → 2 → 3
    assert rows_of(progress)[-1]["step"] == steps and alive(list(rank_of)) == []
    assert_reference_state(tmp_path, steps)


def test_a_killed_rank_forked_from_the_preloaded_server_leaves_its_peers_training(tmp_path: Path) -> None:
    """``--preload torch --on-failure shrink``: the ranks come from the fork server (their parent
    is not the agent), a SIGKILLed one leaves the watch alone, its two peers shrink past it with
    their own processes and end at the reference state, and nothing is left running."""
    progress = tmp_path / "progress.jsonl"
    agent = standalone_shrink_agent(tmp_path, STEPS, 0.2, "--preload", "torch")
    try:
        wait_until(lambda: len(rows_of(progress)) >= 4)
        parents = {parent_of(pid) for pid in written_pids(tmp_path)}
    except BaseException:
        agent.kill()
        agent.wait()
        raise
    outs, killed_at, first_pids = kill_rank_and_wait([agent], progress, tmp_path, rank=2, after_rows=4)
    assert agent.returncode == 0, outs
    assert len(parents) == 1 and agent.pid not in parents  # one fork server, not the agent
    rows = rows_of(progress)
    assert {r["world"] for r in rows if r["t"] <= killed_at} == {3}
    assert 2 in {r["world"] for r in rows if r["t"] > killed_at + 0.5}
    assert rows[-1]["step"] == STEPS and {r["restart"] for r in rows} == {0}
    assert set(written_pids(tmp_path)) == first_pids and alive(list(first_pids)) == []
    assert "rank 2 (local 2" in outs[0] and "its peers go on without it" in outs[0], outs[0]
    assert_reference_state(tmp_path)
