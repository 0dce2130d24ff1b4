"""The joint planner: TP exclusion, PP re-split, DP allocation, refusal, diff, baselines."""

from __future__ import annotations

import numpy as np
import pytest

from analytics.detection.schedule import op_table, pipeline_timing
from collector.events import Location
from collector.plan import Plan
from remediation.baselines import STRATEGY_NAMES, make_strategy
from remediation.candidates import PlannerOptions
from remediation.cluster import ClusterState, DeviceState, Hardware, cluster_from_incidents
from remediation.costs import ScheduleModelScorer, StageTimes
from remediation.diff import plan_diff, ranges
from remediation.model import PlannerModel
from remediation.partition import balanced_partition
from remediation.plan_result import PlanRefused
from remediation.planner import Planner
from remediation.throughput import predict_tokens_per_s

MODEL = PlannerModel.uniform(32)
PLAN = Plan.uniform(tp=8, pp=4, dp=8, num_layers=32, microbatches_per_replica=16)
HEALTHY = ClusterState(256)


def test_healthy_cluster_keeps_the_plan():
    r = Planner(MODEL).plan(HEALTHY, PLAN)
    assert not r.changed and r.plan is PLAN and r.diff == []


def test_dead_gpu_shrinks_only_its_tp_group_and_keeps_global_batch():
    cluster = HEALTHY.with_device(20, DeviceState(dead=True))
    r = Planner(MODEL).plan(cluster, PLAN)
    assert r.changed and r.plan.epoch == PLAN.epoch + 1
    assert r.plan.global_microbatches == PLAN.global_microbatches
    assert 20 not in r.plan.devices
    rep0 = r.plan.pipelines[0]
    # Stage 2 of replica 0 runs at a smaller power-of-two TP on the healthy GPUs of its node.
    tps = [s.tp for s in rep0.stages]
    assert tps[:2] == [8, 8] and tps[2] == 4 and all(d // 8 == 2 for s in rep0.stages[2:-1] for d in s.devices)
    # Every other replica is untouched in structure.
    for new, old in zip(r.plan.pipelines[1:], PLAN.pipelines[1:]):
        assert new.stages == old.stages
    assert r.predicted_tokens_per_s > make_strategy("drop_replica", MODEL).plan(cluster, PLAN).predicted_tokens_per_s
    assert r.current_tokens_per_s == 0.0
    assert any("TP 8→4 on GPUs 16–19" in line for line in r.diff)


def test_slow_stage_gets_fewer_layers_and_slow_replica_fewer_microbatches():
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=1.3))
    r = Planner(MODEL, PlannerOptions(allow_tp=False)).plan(cluster, PLAN)
    rep0 = r.plan.pipelines[0]
    assert rep0.microbatches < 16
    assert max(p.microbatches for p in r.plan.pipelines) > 16
    assert r.predicted_tokens_per_s > r.current_tokens_per_s


def test_pp_resplit_moves_layers_off_a_slow_stage():
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=2.0))
    r = Planner(MODEL, PlannerOptions(allow_tp=False, allow_dp=False, pause_s=0.0)).plan(cluster, PLAN)
    layers = [s.num_layers for s in r.plan.pipelines[0].stages]
    assert layers[2] < 8 and sum(layers) == 32


def test_joint_beats_every_single_dimension_and_baseline():
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=3.0))
    ours = make_strategy("ours", MODEL).plan(cluster, PLAN).predicted_tokens_per_s
    for name in STRATEGY_NAMES:
        if name in ("ours", "oracle"):
            continue
        assert ours >= make_strategy(name, MODEL).plan(cluster, PLAN).predicted_tokens_per_s - 1e-6, name


def test_dead_node_removes_the_stage_and_keeps_the_replica():
    cluster = HEALTHY.with_location(Location(target="node", node=2), "fail_stop")
    r = Planner(MODEL).plan(cluster, PLAN)
    assert r.plan.dp == 8
    assert len(r.plan.pipelines[0].stages) == 3
    assert not set(range(16, 24)) & set(r.plan.devices)


def test_refuses_when_no_replica_can_hold_the_model():
    model = PlannerModel.uniform(4, layer_state_bytes=40 * 2**30)  # 160 GiB of state
    plan = Plan.uniform(tp=4, pp=1, dp=1, num_layers=4, microbatches_per_replica=4)
    cluster = ClusterState(8).with_device(0, DeviceState(dead=True)).with_device(1, DeviceState(dead=True))
    with pytest.raises(PlanRefused, match="no pipeline can hold the model"):
        Planner(model).plan(cluster, plan)


def test_reshape_cost_weighed_against_horizon():
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=1.15))
    short = Planner(MODEL, PlannerOptions(horizon_s=10.0)).plan(cluster, PLAN)
    long = Planner(MODEL, PlannerOptions(horizon_s=100_000.0)).plan(cluster, PLAN)
    assert short.reshape_cost_s <= 1.0  # a 15 s pause is not worth 10 s of gain
    assert long.predicted_tokens_per_s >= short.predicted_tokens_per_s


def test_large_cluster_plans_only_damaged_pipelines():
    n = 16_384
    plan = Plan.uniform(tp=8, pp=16, dp=n // 128, num_layers=64, microbatches_per_replica=8)
    cluster = ClusterState(n).with_device(5, DeviceState(dead=True)).with_device(9000, DeviceState(compute_factor=2))
    r = Planner(PlannerModel.uniform(64)).plan(cluster, plan)
    assert r.plan.global_microbatches == plan.global_microbatches
    assert 5 not in r.plan.devices
    assert len(r.diff) <= 40
    assert {line.split(",")[0].split(":")[0] for line in r.diff} == {"replica 0", "replica 70"}
    assert [p.microbatches for p in r.plan.pipelines] == [8] * 128


def test_oracle_is_at_least_ours():
    cluster = HEALTHY.with_device(20, DeviceState(link_factor=4.0))
    assert (make_strategy("oracle", MODEL).plan(cluster, PLAN).horizon_tokens
            >= make_strategy("ours", MODEL).plan(cluster, PLAN).horizon_tokens)


def test_elastic_restart_pays_restart_and_lost_progress():
    cluster = HEALTHY.with_device(20, DeviceState(dead=True))
    r = make_strategy("elastic_restart", MODEL).plan(cluster, PLAN)
    assert r.reshape_cost_s >= 180 and r.plan.dp == 7
    assert not {cluster.node_of(d) for d in r.plan.devices} & {2}


def test_elastic_restart_keeps_every_pipeline_a_healthy_node_can_hold():
    """TP 2 · PP 2 puts two pipelines on a node: losing a GPU on node 1 leaves node 0's two."""
    small = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    cluster = ClusterState(16).with_device(9, DeviceState(dead=True))
    r = make_strategy("elastic_restart", PlannerModel.uniform(8)).plan(cluster, small)
    assert r.plan.dp == 2 and sorted(r.plan.devices) == list(range(8))
    assert [len(p.stages) for p in r.plan.pipelines] == [2, 2] and r.plan.global_microbatches == 16


def test_do_nothing_on_dead_device_trains_nothing():
    cluster = HEALTHY.with_device(3, DeviceState(dead=True))
    assert predict_tokens_per_s(cluster, MODEL, PLAN) == 0.0
    assert make_strategy("do_nothing", MODEL).plan(cluster, PLAN).predicted_tokens_per_s == 0.0


# ---- pieces -------------------------------------------------------------------------------------


def test_scorer_extrapolation_matches_schedule_dag():
    times = StageTimes((0.01, 0.03, 0.02), (0.02, 0.06, 0.04), None, (0.001, 0.002, 0.001))
    scorer = ScheduleModelScorer("1f1b")
    for m in (3, 9, 25):
        t = op_table("1f1b", 3, m)
        col = lambda xs, m=m: np.broadcast_to(np.asarray(xs)[:, None], (3, m))  # noqa: E731
        exact = pipeline_timing(t, col(times.f_s), col(times.b_s), None, col(times.p2p_s)).makespan_s[0]
        assert scorer.makespan_s(times, m) == pytest.approx(exact, rel=1e-9)


def test_partition_respects_memory_caps_and_speeds():
    parts = balanced_partition(12, [1.0, 2.0, 1.0], [12, 12, 3])
    assert parts is not None
    sizes = [b - a for a, b in parts]
    assert sum(sizes) == 12 and sizes[2] <= 3 and sizes[1] < sizes[0]
    assert balanced_partition(12, [1.0, 1.0], [5, 5]) is None


def test_partition_balances_equal_stages_and_counts_the_head():
    even = balanced_partition(32, [1.0] * 4, [32] * 4)
    assert even is not None
    assert [b - a for a, b in even] == [8, 8, 8, 8]  # no surplus piled on early stages
    with_head = balanced_partition(32, [1.0] * 4, [32] * 4, [0.0, 0.0, 0.0, 2.5])
    assert with_head is not None
    sizes = [b - a for a, b in with_head]
    assert sizes[3] < 8 and max(sizes[:3]) - min(sizes[:3]) <= 1 and sum(sizes) == 32


def test_cluster_from_incident_locations():
    cluster = cluster_from_incidents(64, [
        ("fail_slow", [Location(target="compute", rank=3, factor=2.5)]),
        ("fail_slow", [Location(target="link", link=(8, 9), factor=3.0)]),
        ("fail_stop", [Location(target="node", node=4)]),
    ], Hardware())
    assert cluster.compute_factor(3) == 2.5 and cluster.link_factor(9) == 3.0
    assert cluster.dead_devices() == set(range(32, 40))
    assert cluster.is_healthy(0) and not cluster.is_healthy(8)


def test_diff_groups_unchanged_replicas_and_reports_drop():
    pipes = tuple(p.model_copy(update={"replica": i, "microbatches": 18}) for i, p in enumerate(PLAN.pipelines[1:]))
    new = Plan(epoch=1, num_layers=32, pipelines=pipes)
    lines = plan_diff(PLAN, new, list(range(1, 8)))
    assert "replicas 1–7: 16 → 18 micro-batches" in lines
    assert any(line.startswith("replica 0: dropped") for line in lines)
    assert ranges([16, 17, 18, 19, 22]) == "16–19, 22"


def test_model_file_round_trips_every_model_spec_field():
    import json

    from remediation.model import model_file, read_model_file

    spec = PlannerModel(num_layers=12, layer_state_bytes=3 * 2**30, tokens_per_microbatch=3295.5,
                     linear_s_per_token=1e-7, attn_s_per_sq_token=2e-11, sum_sq_per_microbatch=4e6, overhead_s=4e-5,
                     head_s_per_token=3e-8, tp_bytes_per_token=16384.0, activation_bytes_per_token=8192.0,
                     grad_bytes_per_layer=4e8, backward_factor=2.1, makespan_cv=0.05, makespan_sd_s=0.02)
    assert read_model_file(json.dumps(model_file(spec))) == spec


def test_model_file_in_the_simple_form_is_a_uniform_model():
    import json

    from remediation.model import read_model_file

    text = json.dumps({"num_layers": 4, "layer_state_bytes": 2**30, "tokens_per_microbatch": 4096,
                       "layer_time_s": 0.03, "activation_bytes": 2**20})
    assert read_model_file(text) == PlannerModel.uniform(4, layer_time_s=0.03, layer_state_bytes=2**30,
                                                         activation_bytes=2**20, tokens_per_microbatch=4096)


@pytest.mark.parametrize("change, problem", [
    ({"backward_factor": 0}, "backward_factor"), ({"overhead_s": -1.0}, "must be ≥ 0"),
    ({"layer_tme_s": 0.03}, "layer_tme_s"), ({"num_layers": "many"}, "num_layers"),
])
def test_remediate_refuses_a_bad_model_file_in_one_line(tmp_path, capsys, change, problem):
    import json

    from remediation.model import model_file
    from resihp.cli import main

    good = model_file(PlannerModel.uniform(4))
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**good, **change}))
    assert main(["remediate", "--job", "j", "--model", str(path), "--tp", "2", "--layers", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert problem in err and "\n" not in err, err


@pytest.mark.processes
def test_remediation_imports_neither_trainer_nor_bench():
    import subprocess
    import sys

    code = ("import pkgutil, importlib, sys, remediation\n"
            "for m in pkgutil.iter_modules(remediation.__path__): importlib.import_module('remediation.' + m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'trainer', 'bench', 'ui'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from resihp.planning_models import exact_model  # the simulator → PlannerModel bridge lives here now

    assert exact_model.__module__ == "resihp.planning_models"


def test_repaired_devices_on_a_node_two_pipelines_share_rejoin_the_group_they_left():
    """TP 2 puts two pipelines on each 8-GPU node. Replica 0 runs its second stage on GPU 3 alone
    (GPU 2 was excluded), replica 1 its first on GPU 4 alone (GPU 5 was): once both are repaired,
    each goes back to the pipeline it left (re-grow may make one TP 4 stage of a node's two)."""
    whole = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)

    def shrunk(pipe, stage: int, keep: int):
        stages = [st.model_dump() for st in pipe.stages]
        stages[stage]["devices"] = [keep]
        return {**pipe.model_dump(), "stages": stages}

    pipes = [p.model_dump() for p in whole.pipelines]
    pipes[0], pipes[1] = shrunk(whole.pipelines[0], 1, 3), shrunk(whole.pipelines[1], 0, 4)
    current = Plan.model_validate({**whole.model_dump(), "pipelines": pipes})
    r = Planner(PlannerModel.uniform(8)).plan(ClusterState(16), current)
    assert r.changed and sorted(r.plan.devices) == list(range(16))
    for replica, devices in ((0, {0, 1, 2, 3}), (1, {4, 5, 6, 7})):
        assert {d for st in r.plan.pipelines[replica].stages for d in st.devices} == devices
    assert "re-grow" in r.choices[0] and "re-grow" in r.choices[1]


def test_the_dp_search_picks_the_allocation_its_own_score_rates_fastest():
    # A ×4 link between two stages of replica 1, at 256 GPUs with the noise of the simulator's 7B
    # job: the expected slowest of 8 noisy replicas grows with their number. By the pipelines'
    # makespan plus the all-reduce, keeping replica 1 (all-reduce over its ×4 end) looks 0.3 %
    # faster than dropping it; by the score every prediction uses, dropping it is 3 % faster. The
    # DP search must choose by the score, or dp_only settles for a plan it rates worse than one
    # it had found.
    noisy = PlannerModel(num_layers=32, layer_state_bytes=3 * 2**30, tokens_per_microbatch=3296,
                      linear_s_per_token=8.1e-7, attn_s_per_sq_token=1.6e-11, sum_sq_per_microbatch=6.76e6,
                      overhead_s=4e-5, head_s_per_token=5.6e-7, tp_bytes_per_token=16384.0,
                      activation_bytes_per_token=8192.0, backward_factor=2.0, makespan_cv=0.043,
                      microbatch_cv=0.19, tail_s=0.0088)
    plan = Plan.uniform(tp=8, pp=4, dp=8, num_layers=32, microbatches_per_replica=8)
    cluster = HEALTHY.with_link(51, 59, 4.0)
    opts = PlannerOptions(horizon_s=1800, pause_s=20, rebalance_pause_s=20)
    r = make_strategy("dp_only", noisy, options=opts).plan(cluster, plan)
    dropped = make_strategy("drop_replica", noisy, options=opts).plan(cluster, plan).plan
    assert r.changed and r.choices[1] == "drop replica"
    assert r.predicted_tokens_per_s == pytest.approx(predict_tokens_per_s(cluster, noisy, dropped), rel=0.005)
    assert r.predicted_tokens_per_s > 1.03 * r.current_tokens_per_s


def test_a_plan_that_drops_a_replica_is_priced_with_the_replicas_that_remain():
    # Candidates price the gradient all-reduce over the current replica count (8). Dropping the
    # replica that holds a dead GPU leaves 7: the prediction must be what the new plan scores on
    # its own, not the old ring's 2·7/8 and 7 latencies (0.1 % pessimistic at 256 GPUs).
    cluster = HEALTHY.with_device(20, DeviceState(dead=True))
    r = make_strategy("dp_only", MODEL).plan(cluster, PLAN)
    assert r.choices[0] == "drop replica" and r.plan.dp == PLAN.dp - 1
    assert r.predicted_tokens_per_s == pytest.approx(predict_tokens_per_s(cluster, MODEL, r.plan), rel=1e-12)


def test_a_rebalance_within_the_margin_is_offered_and_taken_instead_of_a_reshape():
    """A ×2 GPU: re-forming its stage trains a little more than moving micro-batches off its
    replica (0.36 % over the horizon here); within the planner's margin the apply rule takes the
    1-s rebalance, outside it the reshape, and a rebalance short of the minimum gain never
    displaces a reshape that reaches it."""
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=2.0))
    reshape = Planner(MODEL, PlannerOptions(prefer_rebalance_within=0.0)).plan(cluster, PLAN)
    moved = Planner(MODEL, PlannerOptions(allow_tp=False, allow_pp=False)).plan(cluster, PLAN)
    assert not reshape.plan.same_stages(PLAN) and moved.plan.same_stages(PLAN) and moved.changed
    gap = 1 - moved.horizon_tokens / reshape.horizon_tokens
    assert 0 < gap < 0.005 and reshape.rebalance is None

    near = Planner(MODEL, PlannerOptions(prefer_rebalance_within=gap * 1.01)).plan(cluster, PLAN)
    assert near.plan.pipelines == reshape.plan.pipelines  # the planner's answer is still its best
    assert near.rebalance is not None and near.rebalance.plan.pipelines == moved.plan.pipelines
    assert near.rebalance.reshape_cost_s < near.reshape_cost_s
    assert near.to_apply(1800.0, 0.02) is near.rebalance
    far = Planner(MODEL, PlannerOptions(prefer_rebalance_within=gap * 0.99)).plan(cluster, PLAN)
    assert far.rebalance is None and far.to_apply(1800.0, 0.02) is far

    def gain(r):  # over the horizon, the pause paid
        return r.horizon_tokens / (r.current_tokens_per_s * 1800.0) - 1

    between = (gain(near.rebalance) + gain(near)) / 2
    assert near.to_apply(1800.0, between) is near  # the rebalance alone would not be applied
    assert near.to_apply(1800.0, gain(near) * 1.01) is None


def test_the_oracle_is_offered_no_rebalance():
    cluster = HEALTHY.with_device(20, DeviceState(compute_factor=2.0))
    r = Planner(MODEL, PlannerOptions(free_reshape=True, prefer_rebalance_within=0.05)).plan(cluster, PLAN)
    assert r.changed and not r.plan.same_stages(PLAN) and r.rebalance is None
