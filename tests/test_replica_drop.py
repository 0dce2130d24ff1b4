"""Replica drop in its one home: survivors keep their stages and share the global batch evenly."""

from __future__ import annotations

import pytest

from collector.plan import PipelinePlan, Plan
from collector.replica_drop import drop_replicas, even_split, surviving_replicas


def _plan(microbatches: tuple[int, ...]) -> Plan:
    base = Plan.uniform(tp=1, pp=2, dp=len(microbatches), num_layers=4, microbatches_per_replica=1, epoch=3)
    return base.model_copy(update={"pipelines": tuple(
        PipelinePlan(replica=p.replica, microbatches=m, stages=p.stages) for p, m in zip(base.pipelines, microbatches))})


def test_dropping_a_replica_renumbers_survivors_and_keeps_the_global_batch():
    plan = _plan((6, 5, 5))
    new = drop_replicas(plan, {1})  # device 1 is in replica 0
    assert new.epoch == 4
    assert [p.replica for p in new.pipelines] == [0, 1]
    assert [p.stages for p in new.pipelines] == [plan.pipelines[1].stages, plan.pipelines[2].stages]
    assert [p.microbatches for p in new.pipelines] == [8, 8]
    assert new.global_microbatches == plan.global_microbatches


def test_the_remainder_goes_to_the_earlier_survivors():
    assert even_split(16, 3) == [6, 5, 5]
    new = drop_replicas(_plan((4, 4, 4, 4)), {7})  # replica 3
    assert [p.microbatches for p in new.pipelines] == [6, 5, 5]


def test_nothing_survives_raises_with_the_devices():
    plan = _plan((2, 2))
    with pytest.raises(ValueError, match="touch every replica"):
        drop_replicas(plan, {0, 2})
    assert surviving_replicas(plan, {0, 2}) == []


def test_an_unknown_device_drops_nothing_but_still_moves_the_epoch():
    plan = _plan((2, 2))
    assert surviving_replicas(plan, {99}) == list(plan.pipelines)
    assert drop_replicas(plan, {99}).pipelines == plan.pipelines
