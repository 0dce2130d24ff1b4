"""A slow node found, drained out of the job by the engine's order, and a spare joined in its place.

The whole platform on loopback, real processes on one embedded bus: two ``resihp run`` agents of
two ranks each (c10d rendezvous, ``--on-failure shrink``) train the agent's sample job with
``--report`` (trainer/agent/sample_job.py: data parallel, each rank's chunks on the bus, an
emulated device time per sample); a spare agent waits with ``--join-running --join-on-command``;
the analytics consumer runs the detector; the engine runs under the auto policy for high and
critical incidents with node plans on (``--node-run``). From step ``--slow-from`` node 1's ranks run ``--slow-factor`` times slower
(``--slow`` given to node 1's agent only: the node, not the rank ids, is slow, so the spare that
takes its place is healthy).

What must happen: the detector finds both of node 1's ranks slow, the engine blames the node and
proposes the layout without it with its stop and the spare's join (the shrinking world's executor
declares that its devices leave only with their node, trainer/agent/shrink_executor.py); the stop
drains node 1's ranks at a step boundary, the executor acknowledges the layout, the spare takes
node 1's place and its ranks join at the next step boundary. The table: samples/s (and tokens/s)
before the slowdown, while slowed, after the node left (two ranks) and after the spare joined (four
again), with when each event came.

``resihp bench nodes`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TypeVar

from collector import topics
from collector.auth import Signer, create_keys, key_path, operator_key
from collector.embedded import EmbeddedBus
from collector.events import (CommandAck, EventFactory, IncidentOpened, NodeCommandAck, NodeSpare, PlanProposed,
                              PolicyChanged, PolicyMode, Severity)
from collector.private_files import private_dir
from collector.stream import EventStream
from resihp.demo.guard import set_parent_death_signal

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
JOB = "nodes-bench"
RUN = "nodes-run"
RANKS_PER_NODE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=400, help="steps of the job (it ends earlier once measured)")
    parser.add_argument("--slow-from", type=int, default=30, help="the step node 1 turns slow at")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--sample-s", type=float, default=0.002, help="emulated device seconds per sample")
    parser.add_argument("--after-steps", type=int, default=20, help="steps measured in each phase after the change")
    parser.add_argument("--timeout-s", type=float, default=400.0)
    parser.add_argument("--workdir", type=Path, default=None)


@dataclass
class NodeStory:
    """What happened, from the job's progress rows and the bus."""

    rates: dict[str, float] = field(default_factory=dict)  # phase -> samples/s
    steps: dict[str, int] = field(default_factory=dict)  # phase -> steps measured
    events: dict[str, float] = field(default_factory=dict)  # what -> seconds after the slowdown began
    at: dict[str, float] = field(default_factory=dict)  # what the bus says happened -> its Unix time (first time)
    worlds: list[int] = field(default_factory=list)  # the world size of every step, in order
    proposal: PlanProposed | None = None  # the first node plan
    proposals: list[PlanProposed] = field(default_factory=list)  # every plan proposed
    acks: list[CommandAck] = field(default_factory=list)
    node_acks: list[NodeCommandAck] = field(default_factory=list)
    incidents: list[IncidentOpened] = field(default_factory=list)
    spares: list[NodeSpare] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    final_state: Path | None = None
    batch: int = 64
    width: int = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return out


def _wait(what: str, check: Callable[[], T | None], deadline: float, procs: dict[str, subprocess.Popen]) -> T:
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        for name, proc in procs.items():
            if name in ("analytics", "engine") and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise TimeoutError(f"no {what} in time")


def run_story(work: Path, *, steps: int = 400, slow_from: int = 30, slow_factor: float = 3.0, sample_s: float = 0.002,
              after_steps: int = 20, timeout_s: float = 400.0) -> NodeStory:
    """Run the scenario in ``work`` (made if missing) and return what happened; every process it
    starts is stopped before it returns, however it returns."""
    private_dir(work)  # the bus and DuckDB files go here: only this user may enter it
    bus_path, progress, stop_file = work / "bus.sqlite", work / "progress.jsonl", work / "stop"
    keys = key_path().resolve()  # this process's key set (made on first use): every part signs and checks with it
    create_keys(keys)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RESIHP_KEYS": str(keys), "PYTHONUNBUFFERED": "1"}
    bus_flags = ["--bus", "embedded", "--bus-path", str(bus_path)]
    with EmbeddedBus(bus_path) as bus:
        bus.publish([Signer(EventFactory(JOB, "cli:bench"), operator_key("cli:bench", create=True)).make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH, Severity.CRITICAL], actor="cli:bench"))])
    port = _free_port()
    cli = [sys.executable, "-m", "resihp.cli"]
    job = ["-m", "trainer.agent.sample_job", "--steps", str(steps), "--report", "--step-s", "0", "--sample-s",
           str(sample_s), "--progress-file", str(progress), "--stop-file", str(stop_file), "--final-state",
           str(work / "final.pt"), "--timeout-s", "30", "--pid-dir", str(work / "pids")]
    (work / "pids").mkdir(exist_ok=True)

    def agent(node: int, *extra: str, slow: bool = False) -> list[str]:
        return [*cli, "run", "--nnodes", "2", "--nproc-per-node", str(RANKS_PER_NODE), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN, "--node-rank", str(node),
                "--on-failure", "shrink", "--monitor-interval", "0.05", "--job", JOB, *bus_flags,
                "--work-dir", str(work / f"agent-{node}{'-spare' if extra else ''}"), *extra,
                *job, *(["--slow", f"{slow_factor:g}@{slow_from}"] if slow else [])]

    commands = {
        "analytics": [*cli, "analytics", *bus_flags, "--db", str(work / "analytics.duckdb"), "--job", JOB],
        "engine": [*cli, "remediate", *bus_flags, "--job", JOB, "--tp", "1", "--pp", "1", "--dp", "4", "--layers",
                   "2", "--microbatches", "1", "--devices", "4", "--devices-per-node", str(RANKS_PER_NODE),
                   "--node-run", RUN],
        "node0": agent(0),
        "node1": agent(1, slow=True),
        # the spare imports the job while it waits: its ranks fork from that server when it takes the place
        "spare": agent(1, "--join-running", "--join-on-command", "--rdzv-conf", "join_timeout=600", "--preload",
                       "torch,trainer.agent.sample_job"),
    }
    procs: dict[str, subprocess.Popen] = {}
    story = NodeStory()
    me = os.getpid()
    try:
        for name, argv in commands.items():
            log = (work / f"{name}.log").open("w")
            # each part gets SIGTERM when this process ends, however it ends (an agent then stops its ranks)
            procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True,
                                           preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM, me))
        deadline = time.monotonic() + timeout_s

        def phase_rows() -> list[dict] | None:
            rows = _rows(progress)
            worlds = [r["world"] for r in rows]
            if 2 not in worlds:
                return None
            back = [i for i, w in enumerate(worlds) if w == 4 and i > worlds.index(2)]
            return rows if len(back) >= after_steps else None

        _wait("the world back at four ranks after the node left", phase_rows, deadline, procs)
        stop_file.write_text("measured")
        for name in ("node0", "spare"):
            procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
        time.sleep(2.0)  # the last events reach the bus
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        story.logs = {name: (work / f"{name}.log").read_text() for name in commands if (work / f"{name}.log").exists()}
    _read_bus(bus_path, story)
    _measure(_rows(progress), story, slow_from, after_steps)
    story.final_state = work / "final.pt"
    return story


def _read_bus(path: Path, story: NodeStory) -> None:
    with EmbeddedBus(path) as bus:
        stream = EventStream(bus, "bench-nodes", [topics.CONTROL, topics.ANALYTICS],
                             on_assign=lambda ps: {tp: 0 for tp in ps})
        while batch := stream.poll(timeout_s=0.5):
            for d in batch:
                p, at = d.event.payload, d.event.time_s
                if isinstance(p, PlanProposed):
                    story.proposals.append(p)
                if isinstance(p, PlanProposed) and p.node_orders and story.proposal is None:
                    story.proposal = p
                    story.at.setdefault("node plan proposed", at)
                elif isinstance(p, CommandAck):
                    story.acks.append(p)
                    story.at.setdefault(f"layout {p.status.value} (command.ack)", at)
                elif isinstance(p, NodeCommandAck):
                    story.node_acks.append(p)
                    story.at.setdefault(f"{p.action} {p.status.value} (command.node_ack)", at)
                elif isinstance(p, IncidentOpened):
                    story.incidents.append(p)
                    story.at.setdefault("first incident opened", at)
                elif isinstance(p, NodeSpare):
                    story.spares.append(p)
        stream.close()


def _measure(rows: list[dict], story: NodeStory, slow_from: int, after_steps: int) -> None:
    """Samples/s in each phase, from rank 0's progress rows (one per step: time, step, world)."""
    story.worlds = [r["world"] for r in rows]
    if not rows or 2 not in story.worlds:
        return
    two = story.worlds.index(2)
    back = next((i for i in range(two, len(rows)) if story.worlds[i] == 4), len(rows))
    onset = next((i for i, r in enumerate(rows) if r["step"] > slow_from), 0)
    phases = {"healthy (4 ranks)": (max(1, onset - after_steps), onset),
              "node 1 slow (4 ranks)": (onset + 1, two),
              "node 1 drained (2 ranks)": (two + 1, back),
              "spare joined (4 ranks)": (back + 1, min(len(rows), back + 1 + after_steps))}
    for name, (a, b) in phases.items():
        if b - a >= 2:
            seconds = rows[b - 1]["t"] - rows[a - 1]["t"]
            story.rates[name] = (b - a) * story.batch / seconds if seconds > 0 else 0.0
            story.steps[name] = b - a
    t0 = rows[onset - 1]["t"] if onset >= 1 else rows[0]["t"]  # the end of the last healthy step
    timeline = {**story.at, "first 2-rank step": rows[two]["t"]}
    if back < len(rows):
        timeline["first 4-rank step after the join"] = rows[back]["t"]
    story.events = {what: at - t0 for what, at in sorted(timeline.items(), key=lambda item: item[1])}


def run(args: argparse.Namespace) -> int:
    import tempfile

    work = args.workdir or Path(tempfile.mkdtemp(prefix="resihp-bench-nodes-"))
    story = run_story(work, steps=args.steps, slow_from=args.slow_from, slow_factor=args.slow_factor,
                      sample_s=args.sample_s, after_steps=args.after_steps, timeout_s=args.timeout_s)
    print(f"# a slow node (×{args.slow_factor:g} from step {args.slow_from}) drained out by the engine's order, a spare "
          f"joined; 2 agents × {RANKS_PER_NODE} ranks + a spare, sample job, embedded bus; workdir {work}")
    healthy = story.rates.get("healthy (4 ranks)", 0.0)
    print(f"{'phase':<28} {'steps':>6} {'samples/s':>10} {'tokens/s':>10} {'of healthy':>11}")
    for name, rate in story.rates.items():
        share = f"{rate / healthy:.0%}" if healthy else "-"
        print(f"{name:<28} {story.steps[name]:>6} {rate:>10.1f} {rate * story.width:>10.0f} {share:>11}")
    print("timeline (seconds after the last healthy step): " + "; ".join(
        f"{what} {seconds:+.1f}" for what, seconds in story.events.items()))
    if story.proposal is not None:
        print("plan: " + "; ".join(story.proposal.diff[:3]))
    if args.json:
        print(json.dumps({"rates": story.rates, "steps": story.steps, "events": story.events}))
    return 0
