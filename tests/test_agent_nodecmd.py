"""Node commands from the bus: ``resihp run`` agents obey a signed ``stop`` for their node, and a
spare a signed ``join``, and nothing else.

Real processes: 2 agents × 2 ranks on loopback under ``--on-failure shrink`` and a spare agent
(``--join-running --join-on-command``), one embedded bus file shared by the agents and the test.
First the orders a node must not obey — unsigned, of another rendezvous round, a duplicate of one,
a stop of the node hosting the job's stores — each answered on the bus (``control.rejected`` or a
``command.node_ack`` saying why) while all four ranks keep training. Then ``resihp node stop``
(the operator's command line, console-signed) for the other node: its ranks exit, its agent acks
``applied`` and ends, and node 0 trains on as a 2-rank world; the spare does not move until
``resihp node join`` (a join of another round is stale and leaves it waiting, one naming another
spare is not its own); meanwhile it says on the bus that it waits (``node.spare``, signed). Then it
takes the node's place, says it waits no more, the world grows back to 4 and ends at the reference
state, nothing left running.
"""

from __future__ import annotations

import pytest
import re
import subprocess
import sys
import time
from pathlib import Path

from collector import topics
from collector.bus import open_bus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import AckStatus, ControlRejected, EventFactory, NodeCommand, NodeCommandAck, NodeSpare
from collector.stream import EventStream
from tests.fixtures.signing import factory
from tests.test_agent_run import ROOT, agent_cmd, alive, env, free_port, pid_dir, rows_of, wait_until, written_pids
from tests.test_agent_shrink import assert_reference_state, shrink_agent

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

JOB = "shrink-job"  # the job tests/test_agent_shrink.py's agents publish as
RUN = "job-s"  # their rendezvous id (--rdzv-id): the run an order names
STEPS = 300  # long enough for the spare's ranks to start (import torch) while the job runs
PLACE = re.compile(r"node (\d) of 2 with ranks \[(\d), (\d)\] in rendezvous round (\d+)")


class BusWatch:
    """Everything the agents answered on the control topic so far."""

    def __init__(self, path: Path) -> None:
        self.bus = open_bus("embedded", path=str(path))
        self.stream = EventStream(self.bus, "test-watch", [topics.CONTROL], job=JOB)
        self.acks: dict[str, list[NodeCommandAck]] = {}
        self.rejected: list[ControlRejected] = []
        self.spares: list[tuple[str, NodeSpare]] = []  # (the event's source, the claim)

    def poll(self) -> None:
        for d in self.stream.poll(timeout_s=0.2):
            p = d.event.payload
            if isinstance(p, NodeCommandAck):
                self.acks.setdefault(p.command_id, []).append(p)
            elif isinstance(p, ControlRejected):
                self.rejected.append(p)
            elif isinstance(p, NodeSpare):
                self.spares.append((d.event.source, p))

    def statuses(self, command_id: str) -> list[AckStatus]:
        self.poll()
        return [a.status for a in self.acks.get(command_id, [])]

    def close(self) -> None:
        self.stream.close()
        self.bus.close()


def place_of(log: Path) -> tuple[int, tuple[int, int], int] | None:
    """(node, its ranks, round) as the agent printed them, or None before it did."""
    m = PLACE.search(log.read_text()) if log.exists() else None
    return (int(m[1]), (int(m[2]), int(m[3])), int(m[4])) if m else None


def order_by_cli(tmp_path: Path, action: str, node: int, round_: int, command_id: str, run: str = RUN,
                 *extra: str) -> None:
    """``resihp node ACTION NODE --round ROUND --run RUN``, as an operator types it (signed with their key)."""
    out = subprocess.run([sys.executable, "-m", "resihp.cli", "node", action, str(node), "--round", str(round_),
                          "--run", run, "--job", JOB, "--bus", "embedded", "--bus-path", str(tmp_path / "bus.sqlite"),
                          "--command-id", command_id, "--as", "alice", "--reason", "replace the machine", *extra],
                         env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_a_signed_stop_shrinks_the_job_and_a_signed_join_grows_it_back_and_nothing_else_moves_it(
        tmp_path: Path) -> None:
    port, progress = free_port(), tmp_path / "progress.jsonl"
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)] + [tmp_path / "spare.log"]
    agents = [shrink_agent(tmp_path, port, n, STEPS, log=logs[n]) for n in (0, 1)]
    agents.append(shrink_agent(tmp_path, port, 1, STEPS, "--join-running", "--join-on-command", log=logs[2]))
    watch = BusWatch(tmp_path / "bus.sqlite")
    bus = open_bus("embedded", path=str(tmp_path / "bus.sqlite"))
    try:
        wait_until(lambda: len(rows_of(progress)) >= 3 and all(place_of(log) for log in logs[:2])
                   and "waiting for an order" in logs[2].read_text())
        places = [place_of(log) for log in logs[:2]]
        host = next(i for i, p in enumerate(places) if p and p[0] == 0)
        other = 1 - host
        place = places[other]
        assert place is not None, f"node {other} logged no place"
        node, ranks, round_ = place
        engine = factory(JOB, "remediation")

        def order(command_id: str, **kw: object) -> NodeCommand:
            return NodeCommand.model_validate({"command_id": command_id, "node": node, "action": "stop", "round": round_,
                                               "run": RUN, "expires_at_s": time.time() + COMMAND_TTL_S, **kw})

        forged = EventFactory(JOB, "remediation").make(order("forged"))  # no signature
        bus.publish([forged, engine.make(order("stale", round=round_ + 1)), engine.make(order("host", node=0)),
                     engine.make(order("early-join", action="join", round=round_ + 1)),  # held: no place yet
                     engine.make(order("elsewhere", action="join", spare="agent-on-another-host"))])  # not this spare's
        bus.publish([engine.make(order("stale", round=round_ + 1))])  # the same command id again
        wait_until(lambda: watch.statuses("stale") == [AckStatus.IGNORED_STALE, AckStatus.IGNORED_DUPLICATE]
                   and watch.statuses("host") == [AckStatus.FAILED]
                   and any(r.event_id == forged.id for r in watch.rejected))
        rejection = next(r for r in watch.rejected if r.event_id == forged.id)
        assert rejection.kind == "command.node" and "unsigned" in rejection.reason and "forged" not in watch.acks
        assert "hosts the job's rendezvous" in watch.acks["host"][0].detail
        assert f"the job is in round {round_}" in watch.acks["stale"][0].detail
        seen = len(rows_of(progress))
        wait_until(lambda: len(rows_of(progress)) >= seen + 2)
        assert {r["world"] for r in rows_of(progress)} == {4}  # nothing stopped
        assert [a.poll() for a in agents] == [None, None, None]

        order_by_cli(tmp_path, "stop", node, round_, "stop-1")
        assert agents[other].wait(timeout=600) == 0
        wait_until(lambda: watch.statuses("early-join") == [AckStatus.IGNORED_STALE])  # the place is published
        shrunk = len(rows_of(progress))
        wait_until(lambda: len(rows_of(progress)) >= shrunk + 3)
        assert rows_of(progress)[-1]["world"] == 2 and agents[2].poll() is None  # the spare waits for its order

        waiting = [(source, p) for source, p in watch.spares if p.waiting]  # the spare says it waits, signed
        assert waiting and {(p.spare, p.run, p.ranks) for _, p in waiting} == {(waiting[0][0], RUN, 2)}, watch.spares
        spare_id = waiting[0][0]
        assert f"spare {spare_id} waiting for an order" in logs[2].read_text()
        order_by_cli(tmp_path, "join", node, round_, "join-1", RUN, "--spare", spare_id)
        assert agents[host].wait(timeout=600) == 0 and agents[2].wait(timeout=600) == 0
    finally:
        bus.close()
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    outs = [log.read_text() for log in logs]
    assert watch.statuses("stop-1") == [AckStatus.APPLIED], outs
    ack = watch.acks["stop-1"][0]
    assert watch.statuses("join-1") == [AckStatus.APPLIED], outs
    joined = watch.acks["join-1"][0]
    assert "elsewhere" not in watch.acks  # a join naming another spare is that spare's, not answered here
    assert [p.waiting for source, p in watch.spares if source == spare_id][-1] is False  # it waits no more
    watch.close()
    assert tuple(ack.ranks) == tuple(joined.ranks) == ranks and ack.round == ack.running_round == round_
    assert f"stopped on node command stop-1: node {node} stopped its ranks {list(ranks)}" in outs[other]
    assert f"the agent of node {node} is gone with its ranks {list(ranks)}" in outs[host], outs[host]
    assert all(f"rank {r} joined the world" in outs[2] for r in ranks), outs[2]
    worlds = [r["world"] for r in rows_of(progress)]
    two = worlds.index(2)
    assert set(worlds[:two]) == {4} and worlds[-1] == 4  # 4 → 2 → 4
    assert rows_of(progress)[-1]["step"] == STEPS
    assert alive(written_pids(tmp_path)) == []
    assert_reference_state(tmp_path, STEPS)


def test_a_rank_that_ignores_sigterm_is_sigkilled_after_the_grace(tmp_path: Path) -> None:
    """One node (``--standalone``), its ranks ignoring SIGTERM: a stop order ends them with SIGKILL
    after ``--stop-grace-s``, the ack says so, and the agent exits 0 with nothing left running."""
    log = tmp_path / "agent.log"
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05", "--stop-grace-s", "1",
                     "--job", JOB, "--work-dir", str(tmp_path / "w"),
                     job_args=("--steps", "100000", "--step-s", "0.1", "--ignore-sigterm", "--pid-dir",
                               str(pid_dir(tmp_path)), "--progress-file", str(tmp_path / "progress.jsonl")))
    at = argv.index("--no-telemetry")
    argv[at:at + 1] = ["--bus", "embedded", "--bus-path", str(tmp_path / "bus.sqlite")]
    agent = subprocess.Popen(argv, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    watch = BusWatch(tmp_path / "bus.sqlite")
    try:
        wait_until(lambda: len(rows_of(tmp_path / "progress.jsonl")) >= 2 and place_of_one(log) is not None)
        run = re.search(r"rendezvous (\S+) at ", log.read_text())  # --standalone: a random --rdzv-id, printed
        assert run is not None, log.read_text()
        order_by_cli(tmp_path, "stop", 0, place_of_one(log) or 0, "stop-all", run=run[1])
        assert agent.wait(timeout=600) == 0, log.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert watch.statuses("stop-all") == [AckStatus.APPLIED], log.read_text()
    assert watch.acks["stop-all"][0].detail == "node 0 stopped its ranks [0, 1]; [0, 1] were SIGKILLed after 1 s"
    watch.close()
    assert alive(written_pids(tmp_path)) == []


def place_of_one(log: Path) -> int | None:
    """The round a one-node job's agent printed."""
    m = re.search(r"node 0 of 1 with ranks \[0, 1\] in rendezvous round (\d+)", log.read_text()) if log.exists() else None
    return int(m[1]) if m else None
