"""A torchtitan job across three node agents (``resihp run`` on c10d, ``--nnodes 1:3``): a command
restarts every node's share of the new layout in one round and leaves a node out, and a node that
dies is restarted past.

Each node runs one CPU rank (devices 0, 1, 2): three data-parallel replicas, a global batch of six
micro-batches, a checkpoint every 3 steps.

* a ``command.reconfigure`` for two replicas on devices 0 and 1 (signed as the engine, for the run
  the job announced): the leader (node 0's agent) writes the new world and the stop, every rank
  stops after the same step and saves; nodes 0 and 1 start devices 0 and 1 — one rendezvous round,
  world 2 — and node 2, with no rank in the new world, takes itself out of the rendezvous and ends
  (exit 0). The command is acknowledged applied with its phases;
* node 1's agent is SIGKILLed (its rank dies with it): node 0's rank fails, torch restarts it, and
  the round that forms without node 1 has one rank: node 0's agent lays it out (one replica, the
  global batch kept by accumulation), restarts from the last checkpoint as plan epoch 2
  (``plan.current`` reason ``restart``). The steps it redoes have the losses they had in the
  two-replica world (to 1e-5 relative: fp32, gradients summed in another order);
* node 1 comes back (a new agent for it): it waits in the rendezvous, node 0's rank stops after
  its next step and saves, and the round the newcomer completes runs two replicas again as plan
  epoch 3, on device 0 and a new device 3 (the job has had devices 0–2), from the step it stopped
  at — no step redone — and trains to the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_MAX_S
from collector.events import AckStatus, CommandAck, IterationSummary, PlanCurrent, ReconfigureCommand, ReshapePhase
from tests.fixtures.signing import Authors
from tests.test_torchtitan_e2e import _events
from trainer.torchtitan.layout import TitanLayout, plan_of

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]
STEPS = 24
JOB = "titan-nodes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, agents: list[subprocess.Popen], patience_s: float = 400):
    deadline = time.monotonic() + patience_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {patience_s:.0f} s"
        assert all(a.poll() is None for a in agents), f"{what}: an agent ended first"
        time.sleep(0.5)
    return found


def test_a_command_restarts_every_nodes_share_in_one_round_and_a_lost_node_is_restarted_past(tmp_path: Path) -> None:
    from trainer.torchtitan.assets import build_assets

    assets = build_assets(tmp_path / "assets")
    bus = tmp_path / "bus.sqlite"
    port = _free_port()

    def agent(node: int, ranks: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "resihp.cli", "run", "--nnodes", "1:3", "--nproc-per-node", str(ranks),
                "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", JOB, "--rdzv-conf", "join_timeout=300,last_call_timeout=8", "--max-restarts", "2",
                "--job", JOB, "--bus", "embedded", "--bus-path", str(bus), "--work-dir", str(tmp_path / f"w{node}"),
                "--preload", "torchtitan.trainer,trainer.torchtitan.config_registry",
                "-m", "torchtitan.train", "--module", "trainer.torchtitan", "--config", "llama3_debugmodel",
                "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(assets),
                "--parallelism.data_parallel_replicate_degree", "3", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "1", "--training.global_batch_size", "6",
                "--training.steps", str(STEPS), "--checkpoint.interval", "3", "--dump_folder", str(tmp_path / "run")]
        return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})

    agents = [agent(0, 1), agent(1, 1), agent(2, 1)]
    outs = ["", "", "", ""]
    try:
        def control() -> list:
            return _events(bus, [topics.CONTROL]) if bus.exists() else []

        start = _wait(lambda: [e for e in control() if isinstance(e, PlanCurrent)], "the job's plan", agents)[0]
        assert start.plan.devices == [0, 1, 2] and len(start.plan.pipelines) == 3, start
        plan = plan_of(TitanLayout(dp_replicate=2), [0, 1], start.plan.num_layers, microbatches=3, epoch=1)
        command = ReconfigureCommand(command_id=uuid.uuid4().hex, plan_id="plan-1", plan=plan, run=start.run,
                                     expires_at_s=time.time() + COMMAND_TTL_MAX_S)
        with EmbeddedBus(bus) as writer:
            writer.publish([Authors(JOB, "test").make(command)])
        acks = _wait(lambda: [e for e in control() if isinstance(e, CommandAck) and e.command_id == command.command_id],
                     "the command's acknowledgement", agents[:2])  # node 2 leaves the job meanwhile
        assert acks[-1].status == AckStatus.APPLIED, acks

        def two_replica_steps() -> list[int]:
            return [e.iteration for e in _events(bus, [topics.TELEMETRY])
                    if isinstance(e, IterationSummary) and e.epoch == 1 and e.loss is not None]

        stopped_at = int(acks[-1].detail.rsplit("step ", 1)[1])
        outs[2] = agents[2].communicate(timeout=120)[0]  # node 2 left the job
        _wait(lambda: max(two_replica_steps(), default=0) >= stopped_at + 2, "two steps in the new world",
              agents[:2])
        agents[1].send_signal(signal.SIGKILL)
        outs[1] = agents[1].communicate(timeout=60)[0]

        def steps_of(epoch: int) -> list[int]:
            return [e.iteration for e in _events(bus, [topics.TELEMETRY])
                    if isinstance(e, IterationSummary) and e.epoch == epoch and e.loss is not None]

        _wait(lambda: steps_of(2), "a step of the one-replica world", agents[:1])
        agents.append(agent(1, 1))  # node 1 comes back
        outs[3] = agents[3].communicate(timeout=600)[0]
        outs[0] = agents[0].communicate(timeout=120)[0]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    why = "".join(f"\n--- node {n} (exit {a.returncode}):\n{out[-4000:]}" for n, (a, out) in enumerate(zip(agents, outs)))
    assert agents[0].returncode == 0 and agents[2].returncode == 0 and agents[3].returncode == 0, why
    assert "runs no rank on this node; it left the job" in outs[2], why

    control_events = _events(bus, [topics.CONTROL])
    telemetry = _events(bus, [topics.TELEMETRY])
    plans = [e for e in control_events if isinstance(e, PlanCurrent)]
    assert [p.plan.epoch for p in plans] == [0, 1, 2, 3], why
    assert plans[1].plan.devices == [0, 1] and plans[2].plan.devices == [0] and plans[2].reason == "restart", why
    assert sorted(plans[3].plan.devices) == [0, 3] and len(plans[3].plan.pipelines) == 2, why  # a new device
    assert plans[3].reason == "restart", why
    assert "joins the running job (plan epoch 2, 1 ranks) with devices [3]" in outs[3], why
    phases = {epoch: [e.phase for e in telemetry if isinstance(e, ReshapePhase) and e.epoch == epoch]
              for epoch in (1, 2, 3)}
    assert phases == {1: ["export", "new_mesh", "first_step"], 2: ["new_mesh", "first_step"],
                      3: ["new_mesh", "first_step"]}, why
    for e in telemetry:  # the pauses, for whoever reads the test's output
        if isinstance(e, ReshapePhase):
            print(f"epoch {e.epoch} {e.phase}: {e.duration_s:.2f} s ({e.detail})")

    losses: dict[int, dict[int, float]] = {0: {}, 1: {}, 2: {}, 3: {}}
    for e in telemetry:
        if isinstance(e, IterationSummary) and e.loss is not None:
            losses[e.epoch][e.iteration] = e.loss
    assert sorted(losses[0]) == list(range(1, stopped_at + 1)), losses  # the three-replica world, to the stop
    assert min(losses[1]) == stopped_at + 1, losses  # resumed after the step it stopped at
    assert min(losses[2]) <= max(losses[1]) + 1, losses
    assert min(losses[3]) == max(losses[2]) + 1 and max(losses[3]) == STEPS, losses  # the joiner's round: none redone
    redone = sorted(set(losses[1]) & set(losses[2]))
    assert min(losses[2]) - 1 in (stopped_at, *range(3, STEPS, 3)), losses  # resumed from a checkpoint
    for step in redone:
        assert losses[2][step] == pytest.approx(losses[1][step], rel=1e-5), (step, losses)
