"""``resihp run``: real agents on loopback, each with its own ranks (gloo, CPU).

Worlds stay small (2 agents × 2 ranks): each process imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer.agent.store import AgentError, open_rendezvous_store

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_cmd(*flags: str, job_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "resihp.cli", "run", "--no-telemetry", *flags, "-m", "trainer.agent.sample_job",
            *job_args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "Z":
            left.append(pid)
    return left


def rows_of(progress: Path) -> list[dict]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]


def wait_until(check: Callable[[], bool], patience_s: float = 300) -> None:
    deadline = time.monotonic() + patience_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("the job never got there (see the agents' output)")
        time.sleep(0.1)


def pid_dir(tmp_path: Path) -> Path:
    (tmp_path / "pids").mkdir(exist_ok=True)
    return tmp_path / "pids"


def written_pids(tmp_path: Path) -> list[int]:
    return [int(p.name) for p in pid_dir(tmp_path).iterdir()]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def kill_rank_and_wait(agents: list[subprocess.Popen], progress: Path, tmp_path: Path, rank: int,
                       after_rows: int, whole_agent: bool = False) -> tuple[list[str], float, set[int]]:
    """Once rank 0 logged ``after_rows`` steps, SIGKILL ``rank`` (``whole_agent``: the agent that
    started it) and wait for every agent to exit (killed if the test fails first). Returns their
    outputs, the kill's time and the first pids."""
    try:
        wait_until(lambda: len(rows_of(progress)) >= after_rows)
        first_pids = set(written_pids(tmp_path))
        victim = next(pid for pid in first_pids if (pid_dir(tmp_path) / str(pid)).read_text() == str(rank))
        os.kill(parent_of(victim) if whole_agent else victim, signal.SIGKILL)
        killed_at = time.time()
        outs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    return outs, killed_at, first_pids


def test_two_agents_train_a_four_rank_world_to_the_end_through_a_killed_rank(tmp_path: Path) -> None:
    """SIGKILL of a rank: its agent restarts the group, the other agent joins the new round, the
    ranks resume from the last checkpoint and the job ends; the rendezvous port is closed after."""
    port = free_port()
    progress = tmp_path / "progress.jsonl"
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--max-restarts", "1",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job-a", "--rdzv-conf", "join_timeout=300")
    # a collective waits up to 120 s: on a loaded host one node's new ranks may start long after the
    # other's, and what this test checks is the restart, not how fast a restarted rank imports torch
    job = ("--steps", "12", "--step-s", "0.2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
           "--progress-file", str(progress), "--pid-dir", str(pid_dir(tmp_path)), "--timeout-s", "120")
    agents = [subprocess.Popen(agent_cmd(*common, "--node-rank", str(n), "--work-dir", str(tmp_path / f"w{n}"),
                                         job_args=job), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for n in (0, 1)]
    outs, killed_at, first_pids = kill_rank_and_wait(agents, progress, tmp_path, rank=3, after_rows=3)
    assert [a.returncode for a in agents] == [0, 0], "".join(
        f"\n--- agent {n} (exit {a.returncode}), last 60 lines:\n" + "\n".join(out.splitlines()[-60:])
        for n, (a, out) in enumerate(zip(agents, outs)))
    rows = rows_of(progress)
    before = [r for r in rows if r["t"] <= killed_at]
    after = [r for r in rows if r["t"] > killed_at and r["pid"] != before[0]["pid"]]
    assert {r["world"] for r in rows} == {4}
    assert after and (after[0]["step"] - 1) % 2 == 0  # resumed from a checkpoint (every 2 steps)
    assert after[0]["step"] <= before[-1]["step"] + 1 and after[-1]["step"] == 12
    # a whole new world of ranks; on a loaded machine torch may form a second round when one agent
    # joins the first late (a membership change, which no --max-restarts counts): whole worlds still
    new = len(set(written_pids(tmp_path)) - first_pids)
    assert new >= 4 and new % 4 == 0, new
    assert f":{port} " not in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout


def test_an_agent_of_another_job_gets_one_clear_line(tmp_path: Path) -> None:
    host = open_rendezvous_store("127.0.0.1:0", "job-a", hosts=True, node_rank=0, bind=None, timeout_s=5)
    out = subprocess.run(agent_cmd("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                   "--rdzv-endpoint", f"127.0.0.1:{host.port}", "--rdzv-id", "job-b",
                                   "--node-rank", "1", "--rdzv-conf", "read_timeout=5"),
                         env=env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("resihp run: error")]
    assert out.returncode == 2
    assert errors == [f"resihp run: error: the rendezvous at 127.0.0.1:{host.port} belongs to job 'job-a', not "
                      "'job-b'; every agent of a job passes the same --rdzv-id"]


def test_a_wrong_endpoint_names_the_endpoint_and_the_fix() -> None:
    with pytest.raises(AgentError, match=r"cannot reach the rendezvous store at 127.0.0.1:\d+ within 1 s; check "
                                         "--rdzv-endpoint"):
        open_rendezvous_store(f"127.0.0.1:{free_port()}", "job-a", hosts=False, node_rank=1, bind=None, timeout_s=1)


def test_a_script_that_exits_at_once_fails_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    out = subprocess.run(agent_cmd("--standalone", "--nproc-per-node", "2", "--work-dir", str(tmp_path / "w"),
                                   job_args=("--exit-code", "3", "--pid-dir", str(pid_dir(tmp_path)))),
                         env=env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("resihp run: error")]
    assert out.returncode == 1
    assert len(errors) == 1 and "exited with code 3" in errors[0], out.stderr[-3000:]
    # The first rank to exit stops the other, which may not have reached its pid file yet (it may
    # still be importing torch): every pid written is gone, and no process of this job is left.
    pids = written_pids(tmp_path)
    assert 1 <= len(pids) <= 2 and alive(pids) == []
    assert running_with(str(tmp_path)) == []


def running_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (this test's directory names every rank's)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return alive(found)


def test_the_store_listens_on_loopback_only() -> None:
    host = open_rendezvous_store("localhost:0", "job-a", hosts=None, node_rank=0, bind=None, timeout_s=5)
    try:
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.splitlines()
        mine = [line.split()[3] for line in listening if line.split()[3].endswith(f":{host.port}")]
        assert host.hosting and mine == [f"127.0.0.1:{host.port}"]
    finally:
        del host  # the store owns its listening socket and closes it as it goes
