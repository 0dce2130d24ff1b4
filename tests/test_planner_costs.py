"""The planner's cost model agrees with the simulator's truth, and is built from published fits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from resihp.planning_models import exact_model, fitted_model, hardware_of
from collector.plan import PipelinePlan, Plan, StagePlan
from remediation.baselines import make_strategy
from remediation.cluster import ClusterState, DeviceState
from remediation.planner import Planner
from remediation.throughput import predict_tokens_per_s
from trainer.sim.engine import NOISE_OFF, SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.workload import WORKLOAD_PRESETS

SIM_MODEL = MODEL_PRESETS["7b"]
CLUSTER = ClusterSpec(gpus=64)
PLAN = Plan.uniform(tp=8, pp=4, dp=2, num_layers=32, microbatches_per_replica=8)


def _config(workload: str = "uniform", plan: Plan = PLAN) -> SimConfig:
    return SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS[workload], plan=plan,
                     telemetry="none", noise=NOISE_OFF, seed=3)


def _sim_iteration_s(plan: Plan, faults: list[FaultSpec]) -> float:
    return float(SimEngine(_config(plan=plan), faults).iteration_durations(3).mean())


def _planner_iteration_s(cluster: ClusterState, plan: Plan) -> float:
    model = exact_model(SIM_MODEL, CLUSTER, WORKLOAD_PRESETS["uniform"])
    return plan.global_microbatches * model.tokens_per_microbatch / predict_tokens_per_s(cluster, model, plan)


def _reshaped() -> Plan:
    """Replica 1, stage 2 on TP 4 with fewer layers, and fewer micro-batches for replica 1."""
    p1 = PLAN.pipelines[1]
    stages = list(p1.stages)
    stages[1] = StagePlan(devices=stages[1].devices, first_layer=8, end_layer=17)
    stages[2] = StagePlan(devices=stages[2].devices[:4], first_layer=17, end_layer=21)
    stages[3] = StagePlan(devices=stages[3].devices, first_layer=21, end_layer=32)
    return Plan(epoch=1, num_layers=32, pipelines=(
        PLAN.pipelines[0].model_copy(update={"microbatches": 10}),
        PipelinePlan(replica=1, microbatches=6, stages=tuple(stages))))


@pytest.mark.parametrize("case", ["healthy", "slow_compute", "slow_link", "reshaped"])
def test_planner_predicts_the_simulators_noise_free_iteration(case: str) -> None:
    hw = hardware_of(CLUSTER)
    cluster, faults, plan = ClusterState(64, hw), [], PLAN
    if case == "slow_compute":
        cluster = cluster.with_device(51, DeviceState(compute_factor=3.0))
        faults = [FaultSpec(kind="slow_compute", device=51, factor=3.0, at_iteration=0)]
    elif case == "slow_link":
        cluster = cluster.with_link(51, 59, 4.0)
        faults = [FaultSpec(kind="slow_link", link=(51, 59), factor=4.0, at_iteration=0)]
    elif case == "reshaped":
        plan = _reshaped()
    # Exact, except that the simulator sizes the DP all-reduce by replica 0's stages while the
    # planner takes the largest gradient shard of any replica (replica 1 holds 11 layers on a stage).
    tolerance = 0.02 if case == "reshaped" else 1e-6
    assert _planner_iteration_s(cluster, plan) == pytest.approx(_sim_iteration_s(plan, faults), rel=tolerance)


def test_cost_figures_fitted_from_telemetry_match_the_truth() -> None:
    config = SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS["pretrain"], plan=PLAN,
                       telemetry="none", seed=3)
    fitted = fitted_model(config, iterations=12)
    exact = exact_model(SIM_MODEL, CLUSTER, WORKLOAD_PRESETS["pretrain"])
    assert fitted.linear_s_per_token == pytest.approx(exact.linear_s_per_token, rel=0.05)
    assert fitted.head_s_per_token == pytest.approx(exact.head_s_per_token, rel=0.25)
    assert fitted.tp_bytes_per_token == exact.tp_bytes_per_token
    assert fitted.backward_factor == pytest.approx(2.0, rel=0.05)
    assert fitted.makespan_sd_s == 0.0 and 0.0 < fitted.makespan_cv < 0.5  # calibrated on the warm-up
    hw = hardware_of(CLUSTER)
    slow = ClusterState(64, hw).with_device(51, DeviceState(compute_factor=3.0))
    same_mix = replace(exact, microbatch_cv=fitted.microbatch_cv)
    for cluster in (ClusterState(64, hw), slow):
        assert predict_tokens_per_s(cluster, replace(fitted, makespan_cv=0.0, tail_s=0.0), PLAN) == pytest.approx(
            predict_tokens_per_s(cluster, same_mix, PLAN), rel=0.05)


def test_a_slow_gpu_in_a_comm_heavy_stage_is_not_over_weighted() -> None:
    """TP traffic is most of a TP-8 chunk here, and a compute slowdown does not slow it: ×1.5 costs
    far less than 1.5× the stage, so the best move is small or none — and never worse than doing
    nothing or any one-dimension adaptation under the same figures."""
    model = exact_model(SIM_MODEL, ClusterSpec(gpus=256), WORKLOAD_PRESETS["pretrain"])
    plan = Plan.uniform(tp=8, pp=4, dp=8, num_layers=32, microbatches_per_replica=8)
    cluster = ClusterState(256, hardware_of(ClusterSpec(gpus=256))).with_device(51, DeviceState(compute_factor=1.5))
    healthy = predict_tokens_per_s(ClusterState(256, cluster.hardware), model, plan)
    assert predict_tokens_per_s(cluster, model, plan) > healthy / 1.25
    ours = make_strategy("ours", model).plan(cluster, plan)
    for name in ("do_nothing", "tp_only", "pp_only", "dp_only", "drop_replica"):
        assert ours.horizon_tokens >= make_strategy(name, model).plan(cluster, plan).horizon_tokens - 1e-6, name


def test_spread_of_replicas_discounts_a_slightly_slow_one() -> None:
    from remediation.costs import expected_slowest_s

    assert expected_slowest_s([(1.0, 32)], 0.0) == 1.0
    assert expected_slowest_s([(1.0, 1)], 0.1) == pytest.approx(1.0, abs=1e-3)
    assert expected_slowest_s([(1.0, 2)], 0.1) == pytest.approx(1 + 0.1 / np.sqrt(np.pi), abs=1e-3)  # E[max of 2]
    # an absolute spread is the same for a long pipeline and a short one
    assert expected_slowest_s([(2.0, 2)], 0.0, sd_s=0.1) == pytest.approx(2 + 0.1 / np.sqrt(np.pi), abs=1e-3)
    healthy = expected_slowest_s([(1.0, 32)], 0.1)
    slightly = expected_slowest_s([(1.0, 31), (1.05, 1)], 0.1)
    assert healthy < slightly < healthy + 0.05  # a 5 % slower replica costs less than 5 %
    assert expected_slowest_s([(1.0, 31), (1.5, 1)], 0.1) == pytest.approx(1.5, rel=0.01)  # not hidden


def test_excluded_devices_rejoin_their_tp_group_once_repaired() -> None:
    model = exact_model(SIM_MODEL, CLUSTER, WORKLOAD_PRESETS["pretrain"])
    hw = hardware_of(CLUSTER)
    broken = ClusterState(64, hw).with_device(19, DeviceState(dead=True))
    shrunk = Planner(model).plan(broken, PLAN)
    assert 19 not in shrunk.plan.devices and shrunk.changed
    repaired = Planner(model).plan(ClusterState(64, hw), shrunk.plan)
    assert repaired.changed and set(repaired.plan.devices) == set(PLAN.devices)
    assert [s.tp for s in repaired.plan.pipelines[0].stages] == [8, 8, 8, 8]
    assert any("re-grow" in label for label in repaired.choices.values())


def test_interleaved_microbatch_counts_are_multiples_of_the_stage_count() -> None:
    model = exact_model(SIM_MODEL, CLUSTER, WORKLOAD_PRESETS["pretrain"])
    plan = Plan.uniform(tp=8, pp=4, dp=2, num_layers=32, microbatches_per_replica=8, schedule="interleaved",
                        virtual_stages=2)
    cluster = ClusterState(64, hardware_of(CLUSTER)).with_device(51, DeviceState(compute_factor=4.0))
    r = Planner(model).plan(cluster, plan)
    assert r.plan.global_microbatches == plan.global_microbatches
    for pipe in r.plan.pipelines:
        assert pipe.microbatches % len(pipe.stages) == 0


def test_horizon_follows_the_gaps_between_changes() -> None:
    from remediation.horizon import HorizonEstimator

    h = HorizonEstimator(default_s=1800.0, min_s=60.0)
    assert h.horizon_s() == 1800.0
    h.change(300.0)
    assert h.horizon_s() == 1800.0  # one change: no rate yet
    h.change(420.0)
    h.change(540.0)
    assert h.horizon_s() == 120.0  # a cascade: the next change is near
    h.change(545.0)
    h.change(550.0)
    assert h.horizon_s() == pytest.approx(max(60.0, (125.0 + 5.0 + 5.0) / 3))


def test_calm_after_a_burst_lengthens_the_horizon() -> None:
    """The open gap is observed calm: four changes in six minutes, then quiet."""
    from remediation.horizon import HorizonEstimator

    h = HorizonEstimator(default_s=1800.0, min_s=60.0)
    for t in (300.0, 420.0, 540.0, 660.0):
        h.change(t)
    assert h.horizon_s(now_s=660.0) == 120.0 == h.horizon_s()
    assert h.horizon_s(now_s=960.0) == pytest.approx((3 * 120.0 + 300.0) / 3)
    assert h.horizon_s(now_s=660.0 + 20 * 3600) == 1800.0  # never past the independent-failure default
    bands = [h.band(now_s=660.0 + s) for s in range(0, 6000, 30)]
    assert bands == sorted(bands) and bands[0] == 1 and bands[-1] == 4  # 120 s → 1,800 s, in doublings of 60 s
    assert h.band(now_s=660.0) == h.band(now_s=700.0)  # 133 s: same doubling, no reason to plan again


def test_a_measured_chunk_slowdown_is_turned_back_into_the_compute_slowdown_behind_it() -> None:
    """The detector reports how much longer a rank's chunks take (compute, TP comm and overhead
    together); the simulator's ×4 compute fault shows as a smaller chunk factor, and the
    conversion recovers the ×4 the planner's compute factor means."""
    from remediation.costs import compute_factor_from_chunks, stage_cost, stage_round_trip_s

    config = _config()
    model, hardware = exact_model(config.model, config.cluster, config.workload), hardware_of(config.cluster)
    healthy = ClusterState(config.cluster.gpus, hardware)
    slow = healthy.with_device(3, DeviceState(compute_factor=4.0))
    stage = next(st for st in PLAN.pipelines[0].stages if 3 in st.devices)
    last = stage is PLAN.pipelines[0].stages[-1]
    chunk_factor = (stage_round_trip_s(stage_cost(slow, model, stage.devices, last), model, stage.num_layers)
                    / stage_round_trip_s(stage_cost(healthy, model, stage.devices, last), model, stage.num_layers))
    assert 1.0 < chunk_factor < 4.0  # the chunk also holds work a slow GPU does not slow
    assert compute_factor_from_chunks(healthy, model, PLAN, 3, chunk_factor) == pytest.approx(4.0)
    unused = config.cluster.gpus + 0  # a device outside the plan keeps the measured factor
    assert compute_factor_from_chunks(ClusterState(unused + 8, hardware), model, PLAN, unused, 2.0) == 2.0


def test_a_probes_compute_slowdown_is_read_as_it_stands_and_a_chunk_slowdown_through_the_stage() -> None:
    """``Location.measure``: a probe times compute alone (a rank nobody traces is sized so), and
    turning it back as if it were a chunk factor would overstate the slowdown."""
    from remediation.costs import compute_factor_from_chunks, compute_factor_of

    config = _config()
    model, hardware = exact_model(config.model, config.cluster, config.workload), hardware_of(config.cluster)
    healthy = ClusterState(config.cluster.gpus, hardware)
    assert compute_factor_of(healthy, model, PLAN, 3, 2.0, "compute") == 2.0
    as_chunks = compute_factor_of(healthy, model, PLAN, 3, 2.0, "chunks")
    assert as_chunks == compute_factor_from_chunks(healthy, model, PLAN, 3, 2.0) and as_chunks > 2.0
