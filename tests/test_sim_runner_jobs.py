"""The simulator's runner obeys only its own job's commands, and only those published after it
started (snapshotted before joining the group, so Kafka's late assignment loses none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import CommandAck, ReconfigureCommand
from collector.plan import Plan
from collector.stream import EventStream
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import Pacer, SimulatorRunner, run_open_loop
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
    sim_now = runner.engine.config.start_time_s  # issued for the simulated run, on its clock
    ours = Authors("mine", "remediation").make(ReconfigureCommand(
        command_id="c1", plan_id="p2", plan=moved, run=runner.engine.run_id, expires_at_s=sim_now + COMMAND_TTL_S),
        time_s=sim_now)
    bus.publish([other, ours])
    runner.run(iterations=2)
    with EventStream(bus, "check", [topics.CONTROL]) as s:
        acks = [d.event.payload for d in s.poll(timeout_s=0.5) if isinstance(d.event.payload, CommandAck)]
    assert [(a.command_id, a.status.value) for a in acks] == [("c1", "applied")]
    assert runner.engine.plan.epoch == 1
    bus.close()


class _Clock:
    """A wall clock that moves only when slept on, or by the work a step is said to take."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_paced_open_loop_hands_each_iteration_over_when_its_time_comes_and_says_how_late_it_ran() -> None:
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4)
    engine = SimEngine(SimConfig(model=MODEL, cluster=ClusterSpec(gpus=8), plan=plan, job="paced"))
    clock = _Clock()
    pacer = Pacer(engine, speed=0.01, clock=clock, sleep=clock.sleep)  # 100 wall s per simulated s
    batches: list[tuple[float, int, float]] = []  # (wall time, iteration, simulated time) at each hand-over

    def sink(events: list) -> None:
        batches.append((clock.now, engine.iteration, engine.now_s))
        clock.now += 0.01  # publishing takes a little wall time

    run_open_loop(engine, sink, iterations=5, pacer=pacer)
    iterations = [it for _, it, _ in batches]
    assert iterations == sorted(set(iterations)) and len(batches) >= 5  # one hand-over per step, none batched
    # each step starts once the previous one's simulated end is due on the wall clock
    for (_, _, sim_before), (wall, _, _) in zip(batches, batches[1:]):
        assert abs((wall - 100.0) - sim_before / 0.01) < 0.02
    assert engine.now_s > 0.0 and clock.now - 100.0 >= engine.now_s / 0.01 - 1e-9
    assert pacer.behind_s <= 0.01 + 1e-9 and clock.slept  # late only by a hand-over's own wall time

    late = _Clock()
    slow = Pacer(engine, speed=1e6, clock=late, sleep=late.sleep)  # a step takes longer than its simulated time

    def slow_sink(events: list) -> None:
        late.now += 0.5

    run_open_loop(engine, slow_sink, iterations=3, pacer=slow)
    assert slow.behind_s >= 0.5 * 3 - 0.01 and not late.slept
    with pytest.raises(ValueError, match="speed must be positive"):
        Pacer(engine, speed=0.0)
