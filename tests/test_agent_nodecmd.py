"""Node commands from the bus: ``resihp run`` agents obey a signed ``stop`` for their node, and
only that.

Real processes: 2 agents × 2 ranks on loopback under ``--on-failure shrink``, one embedded bus
file shared by the agents and the test. First the orders a node must not obey — unsigned, of
another rendezvous round, a duplicate of one, a stop of the node hosting the job's stores — each
answered on the bus (``control.rejected`` or a ``command.node_ack`` saying why) while all four
ranks keep training. Then ``resihp node stop`` (the operator's command line, console-signed) for
the other node: its ranks exit, its agent acks ``applied`` and ends, and node 0 trains on as a
2-rank world to the reference state, with nothing left running.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from collector import topics
from collector.bus import open_bus
from collector.events import AckStatus, ControlRejected, EventFactory, NodeCommand, NodeCommandAck
from collector.stream import EventStream
from tests.fixtures.signing import factory
from tests.test_agent_run import ROOT, alive, env, free_port, rows_of, wait_until, written_pids
from tests.test_agent_shrink import assert_reference_state, shrink_agent

JOB = "shrink-job"  # the job tests/test_agent_shrink.py's agents publish as
STEPS = 200
PLACE = re.compile(r"node (\d) of 2 with ranks \[(\d), (\d)\] in rendezvous round (\d+)")


class BusWatch:
    """Everything the agents answered on the control topic so far."""

    def __init__(self, path: Path) -> None:
        self.bus = open_bus("embedded", path=str(path))
        self.stream = EventStream(self.bus, "test-watch", [topics.CONTROL], job=JOB)
        self.acks: dict[str, list[NodeCommandAck]] = {}
        self.rejected: list[ControlRejected] = []

    def poll(self) -> None:
        for d in self.stream.poll(timeout_s=0.2):
            p = d.event.payload
            if isinstance(p, NodeCommandAck):
                self.acks.setdefault(p.command_id, []).append(p)
            elif isinstance(p, ControlRejected):
                self.rejected.append(p)

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


def test_a_signed_stop_shrinks_the_job_past_the_node_and_nothing_else_stops_it(tmp_path: Path) -> None:
    port, progress = free_port(), tmp_path / "progress.jsonl"
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    agents = [shrink_agent(tmp_path, port, n, STEPS, log=logs[n]) for n in (0, 1)]
    watch = BusWatch(tmp_path / "bus.sqlite")
    bus = open_bus("embedded", path=str(tmp_path / "bus.sqlite"))
    try:
        wait_until(lambda: len(rows_of(progress)) >= 3 and all(place_of(log) for log in logs))
        places = [place_of(log) for log in logs]
        host = next(i for i, p in enumerate(places) if p and p[0] == 0)
        other = 1 - host
        node, ranks, round_ = places[other]  # type: ignore[misc]
        engine = factory(JOB, "remediation")

        def order(command_id: str, **kw: object) -> NodeCommand:
            return NodeCommand(command_id=command_id, **{"node": node, "action": "stop", "epoch": round_, **kw})

        forged = EventFactory(JOB, "remediation").make(order("forged"))  # no signature
        bus.publish([forged, engine.make(order("stale", epoch=round_ + 1)),
                     engine.make(order("host", node=0))])
        bus.publish([engine.make(order("stale", epoch=round_ + 1))])  # the same command id again
        wait_until(lambda: watch.statuses("stale") == [AckStatus.IGNORED_STALE, AckStatus.IGNORED_DUPLICATE]
                   and watch.statuses("host") == [AckStatus.FAILED]
                   and any(r.event_id == forged.id for r in watch.rejected))
        rejection = next(r for r in watch.rejected if r.event_id == forged.id)
        assert rejection.kind == "command.node" and "unsigned" in rejection.reason and "forged" not in watch.acks
        assert "hosts the job's rendezvous" in watch.acks["host"][0].detail
        assert f"this node is in round {round_}" in watch.acks["stale"][0].detail
        seen = len(rows_of(progress))
        wait_until(lambda: len(rows_of(progress)) >= seen + 2)
        assert {r["world"] for r in rows_of(progress)} == {4}  # nothing stopped
        assert [a.poll() for a in agents] == [None, None]

        ordered = subprocess.run([sys.executable, "-m", "resihp.cli", "node", "stop", str(node), "--epoch",
                                  str(round_), "--job", JOB, "--bus", "embedded", "--bus-path",
                                  str(tmp_path / "bus.sqlite"), "--command-id", "stop-1", "--as", "alice",
                                  "--reason", "drain the machine"], env=env(), cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
        assert ordered.returncode == 0, ordered.stderr
        assert agents[other].wait(timeout=600) == 0
        assert agents[host].wait(timeout=600) == 0
    finally:
        bus.close()
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    outs = [log.read_text() for log in logs]
    assert watch.statuses("stop-1") == [AckStatus.APPLIED], outs
    ack = watch.acks["stop-1"][0]
    watch.close()
    assert tuple(ack.ranks) == ranks and ack.epoch == ack.running_epoch == round_
    assert f"stopped on node command stop-1: node {node} stopped its ranks {list(ranks)}" in outs[other]
    assert f"the agent of node {node} is gone with its ranks {list(ranks)}" in outs[host], outs[host]
    worlds = [r["world"] for r in rows_of(progress)]
    shrunk = worlds.index(2)
    assert set(worlds[:shrunk]) == {4} and 4 not in worlds[shrunk:]  # 4 → 2, and never back
    assert rows_of(progress)[-1]["step"] == STEPS
    assert alive(written_pids(tmp_path)) == []
    assert_reference_state(tmp_path, STEPS)
