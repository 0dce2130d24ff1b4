"""The detector publishes its cost model (analytics.cost_model) in the form the remediation engine
folds: one CostFit per (stage, kind) of the running plan, close to the truth, republished when the
fit moves and not otherwise, and turned into planner figures by remediation.cost_figures."""

from __future__ import annotations

from test_detect_reshape import ALPHA, BASE, BETA, GAMMA, plan_events, run

from collector.events import CostModelFitted, IncidentOpened, PlanCurrent
from remediation.cluster import Hardware
from remediation.cost_figures import model_from_fits


def test_the_fitted_lines_are_published_per_stage_and_kind_close_to_the_truth() -> None:
    _, out = run(plan_events([(BASE, 20)]))
    fitted = [p for p in out if isinstance(p, CostModelFitted)]
    assert fitted and fitted[0].epoch == 0
    first = fitted[0]
    assert sorted((f.stage, f.kind.value) for f in first.fits) == [(s, k) for s in range(3) for k in "BF"]
    n, s2 = 1000.0, 6e5  # a typical micro-batch of the synthetic workload
    for f in fitted[-1].fits:
        mult = 2.0 if f.kind == "B" else 1.0
        # 2 layers on TP 2: one layer's work per rank; durations include the TP all-reduce (+0.2 ms)
        truth = mult * (ALPHA * n + BETA * s2 + GAMMA) + 2e-4
        got = f.alpha_s_per_token * n + f.beta_s_per_token_sq * s2 + f.gamma_s
        assert abs(got / truth - 1) < 0.06, (f, got, truth)
        assert f.alpha_s_per_token > 0 and f.beta_s_per_token_sq >= 0  # (β·Σl² is ~1% here: not identifiable)
        assert f.samples > 0 and f.rel_error is not None and f.rel_error < 0.05
    assert [p for p in out if isinstance(p, IncidentOpened)] == []


def test_it_is_republished_when_the_fit_moves_materially_and_not_otherwise() -> None:
    _, steady = run(plan_events([(BASE, 30)], seed=1))
    assert len([p for p in steady if isinstance(p, CostModelFitted)]) == 1  # fitted once, then stable
    _, drift = run(plan_events([(BASE, 30)], seed=1, scale_after=(12, 1.3)))  # the whole job 30% slower
    fitted = [p for p in drift if isinstance(p, CostModelFitted)]
    assert len(fitted) >= 2 and fitted[-1].iteration > 12
    f0 = {(f.stage, f.kind): f for f in fitted[0].fits}
    f1 = {(f.stage, f.kind): f for f in fitted[-1].fits}
    for key, a in f0.items():
        b = f1[key]
        ratio = (b.alpha_s_per_token * 1000 + b.beta_s_per_token_sq * 6e5 + b.gamma_s) / (
            a.alpha_s_per_token * 1000 + a.beta_s_per_token_sq * 6e5 + a.gamma_s)
        assert 1.2 < ratio < 1.4, key
    assert [p for p in drift if isinstance(p, IncidentOpened)] == []  # shared by every rank: no one to blame


def test_the_remediation_engine_turns_the_published_fits_into_planner_figures() -> None:
    _, out = run(plan_events([(BASE, 12)]))
    fitted = [p for p in out if isinstance(p, CostModelFitted)][-1]
    current = PlanCurrent(plan=BASE, layer_state_bytes=12 * 64 * 64 * 16, tokens_per_microbatch=1000)
    spec = model_from_fits(fitted.fits, current, Hardware())
    # one layer's forward on one device (TP 2 halves 2 layers' work) ≈ α_layer·N + β·Σl² + γ
    assert spec.linear_s_per_token > 0 and spec.attn_s_per_sq_token > 0
    assert 1.6 < spec.backward_factor < 2.4


def test_a_line_fitted_on_fixed_length_rows_reads_its_constant_as_compute() -> None:
    """Fixed-length packing (the torch demo's 64-token rows): N never varies, so the fit puts α·N in
    γ while β still fits Σl². Read as launch overhead, γ would not slow with a throttled GPU, and a
    chunk ×3 slower would be taken for a GPU ×5 slower in compute; read as compute, it is ×3."""
    from collector.events import ChunkKind, CostFit
    from collector.plan import Plan
    from remediation.cluster import ClusterState
    from remediation.costs import compute_factor_from_chunks

    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=4)
    fits = [CostFit(stage=s, kind=k, alpha_s_per_token=0.0, beta_s_per_token_sq=1.25e-5 * m, gamma_s=0.0257 * m,
                    samples=32, mean_sum_sq_len=1392.0)
            for s in (0, 1) for k, m in ((ChunkKind.FORWARD, 1), (ChunkKind.BACKWARD, 2))]
    current = PlanCurrent(plan=plan, layer_state_bytes=203_264, tokens_per_microbatch=64)
    spec = model_from_fits(fits, current, Hardware())
    assert spec.overhead_s == 0.0 and spec.linear_s_per_token > 0
    cluster = ClusterState(8, Hardware())
    assert 2.9 < compute_factor_from_chunks(cluster, spec, plan, 5, 3.0) < 3.1  # 4.96 with γ read as overhead
