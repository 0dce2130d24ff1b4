"""A torchtitan job's layout in the contract's words, its data order, and the plans it can run.

Pure logic (no torch.distributed, no torchtitan import): trainer/torchtitan/layout.py, data.py,
remediation/uniform.py and trainer/agent/relayout.py's records.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.plan import PipelinePlan, Plan, StagePlan
from remediation.capability_fit import fit_options
from remediation.candidates import PlannerOptions
from remediation.cluster import ClusterState, DeviceState, Hardware
from remediation.model import PlannerModel
from remediation.planner import Planner
from remediation.uniform import is_uniform, uniform_plans
from trainer.agent.relayout import StepMark, StopOrder, devices_of
from trainer.torchtitan.data import PackedStream, batches_done, positions_of, slot
from trainer.torchtitan.layout import (TORCHTITAN_CAPABILITIES, JobShape, NotUniform, TitanLayout,
                                       layout_of, plan_of, with_flags)


def test_world_ranks_follow_torchtitans_grid_order() -> None:
    """ParallelDims lays ranks out as (pp, batch, cp, tp), row-major: TP peers are adjacent."""
    layout = TitanLayout(pp=2, dp_shard=2, tp=2)
    assert [layout.coords(r) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(8))


def test_a_plan_round_trips_through_the_layout_and_back() -> None:
    layout = TitanLayout(pp=2, dp_replicate=2, tp=1)
    plan = plan_of(layout, [0, 1, 2, 3], num_layers=6, microbatches=2, epoch=0)
    assert plan.dp == 2 and {len(p.stages) for p in plan.pipelines} == {2}
    back, devices = layout_of(plan, layout, plan)
    assert back == layout and devices == [0, 1, 2, 3]


def test_a_plan_that_is_not_one_grid_is_refused_with_the_rule_it_breaks() -> None:
    running = plan_of(TitanLayout(dp_shard=2, tp=2), [0, 1, 2, 3], num_layers=6, microbatches=1, epoch=0)
    mixed = Plan(epoch=1, num_layers=6, pipelines=(
        PipelinePlan(replica=0, microbatches=1, stages=(StagePlan(devices=(0, 1), first_layer=0, end_layer=6),)),
        PipelinePlan(replica=1, microbatches=1, stages=(StagePlan(devices=(2,), first_layer=0, end_layer=6),))))
    with pytest.raises(NotUniform, match="mixes TP degrees"):
        layout_of(mixed, TitanLayout(dp_shard=2, tp=2), running)
    uneven = Plan(epoch=1, num_layers=6, pipelines=(
        PipelinePlan(replica=0, microbatches=1, stages=(StagePlan(devices=(0,), first_layer=0, end_layer=6),)),
        PipelinePlan(replica=1, microbatches=3, stages=(StagePlan(devices=(2,), first_layer=0, end_layer=6),))))
    with pytest.raises(NotUniform, match="micro-batch"):
        layout_of(uneven, TitanLayout(dp_shard=2, tp=2), running)


def flag_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_a_restart_keeps_the_global_batch_whatever_the_degrees() -> None:
    four = TitanLayout(dp_replicate=4).flags(microbatches=3, samples_per_microbatch=1)
    three = TitanLayout(dp_replicate=3).flags(microbatches=4, samples_per_microbatch=1)
    piped = TitanLayout(pp=3).flags(microbatches=12, samples_per_microbatch=1)
    for flags in (four, three, piped):
        assert flag_value(flags, "--training.global_batch_size") == "12"
    assert flag_value(three, "--training.local_batch_size") == "1"  # gradient accumulation: 4 steps of 1
    assert flag_value(piped, "--training.local_batch_size") == "12"  # one schedule of 12 micro-batches of 1


def test_restart_flags_replace_the_jobs_own() -> None:
    args = ["--config", "x", "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size=8", "--y"]
    out = with_flags(args, ["--parallelism.tensor_parallel_degree", "1"])
    assert out == ["--config", "x", "--y", "--parallelism.tensor_parallel_degree", "1"]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["pp", "dp_shard", "tp", "devices", "epoch", "microbatches", "model"]),
                       st.one_of(st.integers(-3, 9), st.text(max_size=3), st.lists(st.integers(-1, 5), max_size=5),
                                 st.none())))
def test_the_job_shape_record_refuses_anything_malformed(body: dict) -> None:
    """The agent reads rank 0's record from a store others can reach: garbage is a ValueError, never more."""
    try:
        shape = JobShape.parse(body)
    except ValueError:
        return
    assert shape.layout.world == len(shape.devices)


def test_store_records_parse_or_refuse() -> None:
    assert StopOrder.parse({"epoch": 2, "command": "c"}) == StopOrder(2, "c")
    assert StepMark.parse({"epoch": 1, "step": 7}) == StepMark(1, 7)
    bad: object
    for bad in ({"epoch": 0, "command": "c"}, {"epoch": "1", "command": "c"}, [], None, {"epoch": 1}):
        with pytest.raises(ValueError):
            StopOrder.parse(bad)
    with pytest.raises(ValueError, match="distinct"):
        devices_of("0,0", 2)
    assert devices_of("0,2,3", 3) == [0, 2, 3] and devices_of("", 2) == [0, 1]


# ---- the data order ------------------------------------------------------------------------------


def _samples_of_step(step: int, dp: int, batch: int, batches_per_step: int) -> set[int]:
    out: set[int] = set()
    for r in range(dp):
        for k in range(step * batches_per_step, (step + 1) * batches_per_step):
            first = slot(k, r, dp) * batch
            out.update(range(first, first + batch))
    return out


@pytest.mark.parametrize("layouts", [[(4, 1, 3), (3, 1, 4), (2, 2, 3), (1, 1, 12), (6, 2, 1)]])
def test_every_layout_consumes_the_same_samples_at_every_step(layouts: list[tuple[int, int, int]]) -> None:
    """(dp, samples per batch, batches per step) with one global batch of 12: step s is always
    samples [12 s, 12 s + 12), so a restart at another layout skips none and repeats none."""
    for step in range(4):
        for dp, batch, per_step in layouts:
            assert _samples_of_step(step, dp, batch, per_step) == set(range(12 * step, 12 * step + 12))


def test_the_position_resumes_at_another_layout_or_refuses() -> None:
    assert batches_done(24, dp_degree=3, batch_size=2) == 4
    with pytest.raises(ValueError, match="not a multiple"):
        batches_done(24, dp_degree=5, batch_size=1)


def test_positions_restart_where_a_document_starts() -> None:
    stream = PackedStream.from_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    ids, pos, labels = stream.sample(0, 4)
    assert ids.tolist() == [1, 2, 3, 4] and labels.tolist() == [2, 3, 4, 5] and pos.tolist() == [0, 1, 2, 0]
    assert positions_of(np.array([False, False, True, False])).tolist() == [0, 1, 0, 1]


# ---- plans for a uniform-only job ----------------------------------------------------------------


def test_uniform_layouts_leave_the_bad_devices_out_and_keep_the_batch(planner_model_4: tuple) -> None:
    model, cluster, current = planner_model_4
    plans = uniform_plans(cluster, model, current)
    assert plans and all(is_uniform(p) for p in plans)
    assert all(1 not in p.devices for p in plans)
    assert all(p.global_microbatches == current.global_microbatches for p in plans)
    assert all(min(pp.microbatches for pp in p.pipelines) >= len(p.pipelines[0].stages) for p in plans)


def test_the_planner_answers_a_uniform_only_job_with_a_uniform_plan_without_the_slow_device(
        planner_model_4: tuple) -> None:
    model, cluster, current = planner_model_4
    options, not_offered = fit_options(PlannerOptions(), TORCHTITAN_CAPABILITIES)
    assert options.uniform_only and not_offered
    result = Planner(model, options).plan(cluster, current)
    assert result.changed and is_uniform(result.plan) and 1 not in result.plan.devices
    assert result.predicted_tokens_per_s > result.current_tokens_per_s


@pytest.fixture
def planner_model_4() -> tuple:
    """Four DP replicas of one device, 12 micro-batches, device 1 three times slower."""
    current = plan_of(TitanLayout(dp_replicate=4), [0, 1, 2, 3], num_layers=6, microbatches=3, epoch=0)
    model = PlannerModel(num_layers=6, layer_state_bytes=2**20, tokens_per_microbatch=256.0,
                         linear_s_per_token=1e-5, overhead_s=1e-4, grad_bytes_per_layer=2**18)
    cluster = ClusterState(4, hardware=Hardware(devices_per_node=4)).with_device(1, DeviceState(compute_factor=3.0))
    return model, cluster, current
