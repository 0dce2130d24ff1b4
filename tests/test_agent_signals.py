"""The agent's ranks never outlive it, and a stopped rank is reported as a hang naming its op.

Real agents and ranks (gloo, CPU); one agent with two ranks per test, `resihp run`'s or
`resihp train`'s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from collector import topics
from collector.bus import open_bus
from collector.auth import Gate
from collector.events import HangReported, Heartbeat, IncidentOpened
from collector.stream import EventStream
from tests.test_agent_run import agent_cmd, alive, env, pid_dir, written_pids
from trainer.agent.flight import flight_file_path, read_flight
from trainer.agent.hang import process_state

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

T = TypeVar("T")
PATIENCE_S = 300  # how long to wait for something that must happen (not a speed bound)


def wait_for(what: str, check: Callable[[], T], patience_s: float = PATIENCE_S) -> T:
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def start_agent(tmp_path: Path, *flags: str, steps: int = 100_000) -> subprocess.Popen:
    return subprocess.Popen(
        agent_cmd("--standalone", "--nproc-per-node", "2", "--work-dir", str(tmp_path / "w"), *flags,
                  job_args=("--steps", str(steps), "--step-s", "0.1", "--pid-dir", str(pid_dir(tmp_path)),
                            "--progress-file", str(tmp_path / "progress.jsonl"))),
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def training(tmp_path: Path, steps: int = 3) -> bool:
    progress = tmp_path / "progress.jsonl"
    return len(written_pids(tmp_path)) == 2 and progress.exists() and len(progress.read_text().splitlines()) >= steps


def test_sigterm_to_an_agent_stops_every_rank(tmp_path: Path) -> None:
    agent = start_agent(tmp_path)
    wait_for("two ranks training", lambda: training(tmp_path))
    pids = written_pids(tmp_path)
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=PATIENCE_S)
    assert agent.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "resihp run: stopped by SIGTERM; this node's ranks were stopped" in err
    assert alive(pids) == []


def test_a_stopped_rank_is_reported_hung_in_its_op_and_dies_with_a_killed_agent(tmp_path: Path) -> None:
    bus_path = tmp_path / "bus.db"
    argv = agent_cmd()
    agent = subprocess.Popen(
        [*argv[:argv.index("--no-telemetry")], "--bus", "embedded", "--bus-path", str(bus_path), "--job", "hang-job",
         "--standalone", "--nproc-per-node", "2", "--work-dir", str(tmp_path / "w"), "--hang-floor-s", "1",
         "--heartbeat-s", "0.2", "-m", "trainer.agent.sample_job", "--steps", "100000", "--step-s", "0.1",
         "--pid-dir", str(pid_dir(tmp_path)), "--progress-file", str(tmp_path / "progress.jsonl")],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("two ranks training", lambda: training(tmp_path, steps=5))
        rank_of = {pid: int((pid_dir(tmp_path) / str(pid)).read_text()) for pid in written_pids(tmp_path)}
        victim = next(pid for pid, rank in rank_of.items() if rank == 1)
        os.kill(victim, signal.SIGSTOP)
        wait_for("rank 1 stopped", lambda: process_state(victim) == "T")
        stuck = read_flight(flight_file_path(str(tmp_path / "w" / "flight"), 1))
        assert stuck is not None
        report_path = wait_for("a hang report", lambda: next((tmp_path / "w").glob("hang-*.json"), None))
        assert report_path is not None
        time.sleep(0.5)  # the report file is written whole before the line is printed
        report = json.loads(report_path.read_text())
        assert 1 in report["culprits"] and report["ops"]["1"] == stuck.op
        assert report["stuck_for_s"] > report["deadline_s"] >= 1.0
        assert "is stopped (state T" in report["stacks"]["1"]
        if report["culprits"] == [1]:
            assert "Current thread" in report["stacks"]["0"] or "Thread" in report["stacks"]["0"]
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=PATIENCE_S)
        wait_for("every rank gone after the agent's SIGKILL", lambda: alive(list(rank_of)) == [])
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    bus = open_bus("embedded", path=str(bus_path))
    stream = EventStream(bus, "test", [topics.TELEMETRY, topics.ANALYTICS], job="hang-job")
    envelopes = [d.event for d in stream.poll(timeout_s=1.0)]
    bus.close()
    events = [e.payload for e in envelopes]
    assert {e.rank for e in events if isinstance(e, Heartbeat)} == {0, 1}
    assert not any(isinstance(e, IncidentOpened) for e in events)  # incidents are the analytics key's to open
    (hang,) = [e for e in envelopes if isinstance(e.payload, HangReported)]
    assert Gate("analytics").admit(hang), "the agent signs its hang report with the executor's key"
    found = hang.payload
    assert isinstance(found, HangReported)
    assert found.ranks == report["culprits"] and found.op == stuck.op
    assert f"stuck in '{stuck.op}'" in found.summary and "is stopped (state T" in found.stacks


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children …), from /proc."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    below, frontier = [], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        below += frontier
    return below


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_resihp_train_leaves_no_rank_behind_when_it_is_stopped(sig: signal.Signals, tmp_path: Path) -> None:
    """``resihp train`` runs its ranks under the node agent: SIGTERM stops them and says so in one
    line; after SIGKILL they die with the fork server they came from."""
    train = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "train", "--pp", "2", "--iterations", "100000", "--bus", "embedded",
         "--bus-path", str(tmp_path / "bus.sqlite")], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        stdout = train.stdout
        assert stdout is not None
        wait_for("a trained iteration", lambda: stdout.readline().startswith("iteration "))
        below = descendants(train.pid)
        assert len(below) >= 3  # the fork server and the two ranks forked from it, at least
        train.send_signal(sig)
        out = train.communicate(timeout=PATIENCE_S)[0]
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == (128 + sig if sig == signal.SIGTERM else -sig), out[-3000:]
    if sig == signal.SIGTERM:
        assert "resihp train: stopped by SIGTERM; every rank was stopped" in out
    wait_for("every rank and the fork server gone", lambda: alive(below) == [])
