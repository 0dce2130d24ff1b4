"""The simulator's runner obeys only its own job's commands, and only those published after it
started (snapshotted before joining the group, so Kafka's late assignment loses none)."""

from __future__ import annotations

from pathlib import Path

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import CommandAck, ReconfigureCommand
from collector.plan import Plan
from collector.stream import EventStream
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import SimulatorRunner
from tests.fixtures.signing import Authors

MODEL = MODEL_PRESETS["tiny"]


def test_commands_of_other_jobs_and_from_before_the_start_are_left_alone(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4)
    moved = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4, epoch=1, first_device=8)
    old = Authors("mine", "remediation").make(ReconfigureCommand(command_id="old", plan_id="p0", plan=moved))
    bus.publish([old])  # before the runner exists: not for this run
    runner = SimulatorRunner(bus, SimEngine(SimConfig(model=MODEL, cluster=ClusterSpec(gpus=16), plan=plan, job="mine")))
    other = Authors("theirs", "remediation").make(ReconfigureCommand(command_id="x", plan_id="p1", plan=moved))
    ours = Authors("mine", "remediation").make(ReconfigureCommand(command_id="c1", plan_id="p2", plan=moved))
    bus.publish([other, ours])
    runner.run(iterations=2)
    with EventStream(bus, "check", [topics.CONTROL]) as s:
        acks = [d.event.payload for d in s.poll(timeout_s=0.5) if isinstance(d.event.payload, CommandAck)]
    assert [(a.command_id, a.status.value) for a in acks] == [("c1", "applied")]
    assert runner.engine.plan.epoch == 1
    bus.close()
