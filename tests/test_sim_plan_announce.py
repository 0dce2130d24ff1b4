"""The simulator announces the plan it runs (plan.current), at start and after every reshape, as
the trainer does, so that consumers never need the plan on their command line; and it refuses a
TP degree the model's heads cannot be cut to, as a trainer would."""

from __future__ import annotations

import re

import pytest

from collector.events import AckStatus, CommandAck, PlanCurrent, ReconfigureCommand
from collector.plan import PipelinePlan, Plan, StagePlan
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


def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_and_one_that_does_runs():
    # tiny has 16 heads: TP 3 cannot cut it (no plan of it starts, a command to it fails), while a
    # 12-head model runs TP 4 → TP 3 on three of its four devices.
    tp3 = Plan.uniform(tp=3, pp=1, dp=1, num_layers=MODEL.layers, microbatches_per_replica=4)
    why = "TP degree 3 (devices [0, 1, 2]) does not divide the model's 16 attention heads"
    with pytest.raises(ValueError, match=re.escape(why)):
        SimConfig(model=MODEL, cluster=ClusterSpec(gpus=8), plan=tp3)
    tp4 = Plan.uniform(tp=4, pp=1, dp=1, num_layers=MODEL.layers, microbatches_per_replica=4)
    engine = SimEngine(SimConfig(model=MODEL, cluster=ClusterSpec(gpus=8), plan=tp4, job="tp3"))
    engine.run(1)
    (ack,) = [e.payload for e in engine.reconfigure(ReconfigureCommand(
        command_id="c1", plan_id="p1", plan=tp3.model_copy(update={"epoch": 1}))) if isinstance(e.payload, CommandAck)]
    assert ack.status is AckStatus.FAILED and why in ack.detail

    twelve = MODEL.model_copy(update={"heads": 12})
    engine = SimEngine(SimConfig(model=twelve, cluster=ClusterSpec(gpus=8), plan=tp4, job="tp3"))
    engine.run(1)
    excluded = Plan(epoch=1, num_layers=MODEL.layers, pipelines=(PipelinePlan(replica=0, microbatches=4, stages=(
        StagePlan(devices=(0, 2, 3), first_layer=0, end_layer=MODEL.layers),)),))
    after = announcements(engine.reconfigure(ReconfigureCommand(command_id="c2", plan_id="p2", plan=excluded)))
    assert [(a.plan.shape(), a.plan.devices) for a in after] == [("TP3·PP1·DP1", [0, 2, 3])]
