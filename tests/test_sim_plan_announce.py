"""The simulator announces the plan it runs (plan.current), at start and after every reshape, as
the trainer does, so that consumers never need the plan on their command line."""

from __future__ import annotations

from collector.events import PlanCurrent, ReconfigureCommand
from collector.plan import Plan
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

MODEL = MODEL_PRESETS["tiny"]


def announcements(events):
    return [e.payload for e in events if isinstance(e.payload, PlanCurrent)]


def test_the_running_plan_is_announced_at_start_and_after_a_reshape():
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4)
    engine = SimEngine(SimConfig(model=MODEL, cluster=ClusterSpec(gpus=16), plan=plan, job="announce"))
    first = announcements(engine.run(3))
    assert [(a.reason, a.plan) for a in first] == [("start", plan)]
    assert first[0].layer_state_bytes == MODEL.params_per_layer * 16

    moved = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4, epoch=1, first_device=8)
    after = announcements(engine.reconfigure(ReconfigureCommand(command_id="c1", plan_id="p1", plan=moved)))
    assert [(a.reason, a.plan.epoch, a.plan.devices) for a in after] == [("reshape", 1, list(range(8, 16)))]
    assert announcements(engine.run(2)) == []  # announced once, not every iteration
