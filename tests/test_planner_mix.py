"""The planner's pipeline means carry the micro-batch mix, and the stalls' tail is a constant.

A pipeline of varying chunks runs longer on average than one of mean chunks, by an amount that
depends on its shape (nothing for one stage, ~9 % for four); and rare stalls add to the mean
iteration whatever the layout. Both are measured here against the simulator, which draws real
packed micro-batches, jitter and stalls."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from collector.events import IterationSummary
from collector.plan import PipelinePlan, Plan, StagePlan
from remediation.cluster import ClusterState
from remediation.cost_figures import calibrate_spread
from remediation.costs import ScheduleModelScorer, StageTimes, expected_slowest_s, median_slowest_s
from remediation.throughput import plan_spans, predict_tokens_per_s
from resihp.planning_models import fitted_model, hardware_of
from trainer.sim.cost import healthy_chunk_s
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.workload import WORKLOAD_PRESETS, draw_microbatches

SIM_MODEL = MODEL_PRESETS["7b"]
CLUSTER = ClusterSpec(gpus=64)
PLAN = Plan.uniform(tp=8, pp=4, dp=2, num_layers=32, microbatches_per_replica=8)


def _one_pipeline(layers: tuple[int, ...], microbatches: int = 8) -> Plan:
    stages, first = [], 0
    for s, n in enumerate(layers):
        stages.append(StagePlan(devices=tuple(range(8 * s, 8 * s + 8)), first_layer=first, end_layer=first + n))
        first += n
    return Plan(epoch=0, num_layers=first, pipelines=(PipelinePlan(replica=0, microbatches=microbatches,
                                                                    stages=tuple(stages)),))


def _sim_mean_iteration_s(plan: Plan, iterations: int = 400) -> float:
    config = SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS["pretrain"], plan=plan,
                       telemetry="none", seed=5)
    walls = [e.payload.wall_s for e in SimEngine(config).run(iterations) if isinstance(e.payload, IterationSummary)]
    return float(np.mean(walls))


@pytest.fixture(scope="module")
def fitted():
    config = SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS["pretrain"], plan=PLAN,
                       telemetry="none", seed=3)
    return fitted_model(config, iterations=12)


def test_the_fitted_mix_spread_is_the_workloads(fitted) -> None:
    """The cost model's ``workload_cv`` is the spread of a forward chunk's time over the packed
    micro-batches — computed here from the simulator's own terms on fresh draws."""
    rngs = [np.random.default_rng([9, i]) for i in range(256)]
    packed = draw_microbatches(rngs, WORKLOAD_PRESETS["pretrain"], 1, 8)
    f = np.array([healthy_chunk_s(SIM_MODEL, CLUSTER, PLAN, float(n), float(s2))["F"]
                  for n, s2 in zip(packed.tokens.ravel(), packed.sum_sq.ravel())])
    truth = float(f.std() / f.mean())
    assert truth > 0.05
    assert fitted.microbatch_cv == pytest.approx(truth, rel=0.25)


def test_the_fits_carry_the_mean_sum_sq_that_beta_multiplies() -> None:
    """The engine knows N per micro-batch from the predictions, but Σlᵢ² only from the fits: their
    ``mean_sum_sq_len`` is the window's mean, and the figures use it instead of N × a guessed mean
    document length (1,024 tokens), which for this mix is off by more than a third."""
    from remediation.cost_figures import model_from_fits
    from resihp.planning_models import warmup_fits

    config = SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS["pretrain"], plan=PLAN,
                       telemetry="none", seed=3)
    fits, current, tokens, sum_sq, _ = warmup_fits(config, iterations=12)
    forward = [f for f in fits if str(f.kind) == "F"]
    assert forward and all(f.mean_sum_sq_len == pytest.approx(sum_sq, rel=0.02) for f in forward)
    model = model_from_fits(fits, current, hardware_of(CLUSTER), tokens_per_microbatch=tokens)
    assert model.sum_sq_per_microbatch == pytest.approx(sum_sq, rel=0.02)
    assert abs(tokens * 1024 / sum_sq - 1) > 0.33
    without = [f.model_copy(update={"mean_sum_sq_len": None}) for f in fits]  # an older analytics consumer
    assert model_from_fits(without, current, hardware_of(CLUSTER), tokens_per_microbatch=tokens
                           ).sum_sq_per_microbatch == pytest.approx(tokens * 1024)


def test_a_pipelines_mean_follows_its_shape(fitted) -> None:
    """Single-replica plans (no max over replicas): the predicted mean iteration is the simulator's
    within 3 % for four, three and two stages and one; without the mix the four-stage pipeline is
    predicted more than 5 % short, the one-stage one is not (a sum's mean is the sum of means)."""
    cluster = ClusterState(64, hardware_of(CLUSTER))
    body = replace(fitted, makespan_cv=0.0, tail_s=0.0)  # one replica: no max, and the stalls are apart
    without_mix = replace(body, microbatch_cv=0.0)
    for layers in ((8, 8, 8, 8), (11, 11, 10), (16, 16), (32,)):
        plan = _one_pipeline(layers)
        tokens = plan.global_microbatches * fitted.tokens_per_microbatch
        truth = _sim_mean_iteration_s(plan)
        predicted = tokens / predict_tokens_per_s(cluster, body, plan)
        assert predicted == pytest.approx(truth, rel=0.03), layers
        mean_chunks = tokens / predict_tokens_per_s(cluster, without_mix, plan)
        if len(layers) == 4:
            assert mean_chunks < truth * 0.95
        if len(layers) == 1:
            assert mean_chunks == pytest.approx(truth, rel=0.02)


def test_the_mix_draws_are_common_and_the_slope_steady() -> None:
    times = StageTimes(f_s=(1.0,) * 4, b_s=(2.0,) * 4, w_s=None, p2p_s=(0.0,) * 4)
    a, b = ScheduleModelScorer(microbatch_cv=0.2), ScheduleModelScorer(microbatch_cv=0.2)
    assert a.makespan_s(times, 9) == b.makespan_s(times, 9)  # fixed draws: candidates compare on the same mix
    plain = ScheduleModelScorer()
    assert plain.makespan_s(times, 8) == pytest.approx(33.0)  # (m + S − 1)·(F + B)
    assert 1.05 < a.makespan_s(times, 8) / 33.0 < 1.15
    steps = np.diff([a.makespan_s(times, m) for m in range(10, 40)])  # exact up to 10, extrapolated beyond
    assert np.ptp(steps) < 1e-9 and 2.9 < steps[0] < 3.6  # one more micro-batch: about F + B


def test_the_spread_is_fitted_on_the_body_and_stalls_are_a_constant() -> None:
    """Observed: the healthy plan's body (normal around a level) plus rare long stalls. The fitted
    figures reproduce the observed median and mean; a replica well behind the others then costs
    its own time plus the tail, not less — which a spread that also carried the stalls got wrong."""
    model = fitted_model(SimConfig(model=SIM_MODEL, cluster=CLUSTER, workload=WORKLOAD_PRESETS["pretrain"],
                                   plan=PLAN, telemetry="none", seed=3), iterations=12)
    cluster = ClusterState(64, hardware_of(CLUSTER))
    timed = plan_spans(cluster, model, PLAN)
    assert timed is not None
    spans, dp_s = timed
    level = expected_slowest_s(spans.items(), 0.0) + dp_s
    rng = np.random.default_rng(1)
    times = level * (1.02 + 0.03 * rng.standard_normal(4000))
    times[rng.random(4000) < 0.05] += 0.3 * level  # a stall one iteration in twenty
    fitted = calibrate_spread(model, PLAN, cluster, times.tolist())
    assert fitted.makespan_cv > 0 and fitted.tail_s == pytest.approx(0.05 * 0.3 * level, rel=0.2)
    tokens = PLAN.global_microbatches * model.tokens_per_microbatch
    assert tokens / predict_tokens_per_s(cluster, fitted, PLAN) == pytest.approx(times.mean(), rel=1e-3)
    assert median_slowest_s(spans.items(), fitted.makespan_cv) + dp_s == pytest.approx(np.median(times), rel=1e-3)
    mean_only = calibrate_spread(model, PLAN, cluster, [float(times.mean())])  # one number: all of it is spread
    assert mean_only.tail_s == 0.0 and mean_only.makespan_cv > fitted.makespan_cv
