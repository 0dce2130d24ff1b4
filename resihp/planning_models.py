"""The planner's cost figures for a simulated job: the exact ones (the simulator's truth) and the
ones a running job would publish. The composition root's bridge between the simulator (trainer)
and the planner (remediation): remediation must not import trainer, and bench/ is not a library,
so whoever needs "a PlannerModel for this simulator config" imports it from here (``resihp bench
recover``, the demo, tests).

* ``exact_model``: the simulator's own per-layer coefficients (trainer/sim/cost.py) and the
  workload's true means of N and Σlᵢ² — the oracle knows everything.
* ``fitted_model``: what production does. A healthy warm-up of the same job emits telemetry; the
  analytics cost model's robust fit (``analytics.detection.cost_model.fit_class``) gives α, β, γ per stage
  and chunk kind, wrapped as the ``analytics.cost_model`` event's ``CostFit`` lines; the
  simulator's own ``plan.current`` announcement gives the plan and model facts; and
  ``remediation.cost_figures.model_from_fits`` turns them into the planner's PlannerModel.
* ``hardware_of``: the planner's Hardware for a simulator ClusterSpec.

What can go wrong: ``fitted_model`` runs a short simulation (seconds at 1,024 GPUs); a
simulator that publishes no ``plan.current`` raises RuntimeError.
"""

from __future__ import annotations

import numpy as np

from collector.events import CostFit, IterationSummary, PlanCurrent, RankIteration
from collector.plan import Plan
from remediation.cluster import ClusterState, Hardware
from remediation.cost_figures import calibrate_spread, model_from_fits
from remediation.model import PlannerModel


def hardware_of(cluster_spec) -> Hardware:
    return Hardware(
        devices_per_node=cluster_spec.gpus_per_node,
        link_bandwidth_Bps=cluster_spec.inter_node_gbps / 8 * 1e9,
        intra_node_bandwidth_Bps=cluster_spec.intra_node_gbps / 8 * 1e9,
        link_latency_s=cluster_spec.link_latency_s,
    )


def workload_means(workload, samples: int = 4096) -> tuple[float, float]:
    """Mean tokens and mean Σlᵢ² of the workload's packed micro-batches."""
    from trainer.sim.workload import draw_microbatches

    rngs = [np.random.default_rng([7, i]) for i in range(samples // 8)]
    packed = draw_microbatches(rngs, workload, 1, 8)
    return float(packed.tokens.mean()), float(packed.sum_sq.mean())


def exact_model(sim_model, cluster_spec, workload, makespan_cv: float = 0.0,
                makespan_sd_s: float = 0.0, microbatch_cv: float = 0.0, tail_s: float = 0.0) -> PlannerModel:
    """The simulator's truth in the planner's terms (trainer/sim/cost.py, term by term); the
    spreads are not in the simulator's cost terms, so the caller passes them (e.g. a fitted
    model's)."""
    n, s2 = workload_means(workload)
    h, bpv, flops = sim_model.hidden, sim_model.bytes_per_value, cluster_spec.effective_flops
    return PlannerModel(
        num_layers=sim_model.layers, layer_state_bytes=sim_model.params_per_layer * 16, tokens_per_microbatch=n,
        linear_s_per_token=24 * h * h / flops, attn_s_per_sq_token=2 * h / flops, sum_sq_per_microbatch=s2,
        overhead_s=cluster_spec.layer_overhead_s, head_s_per_token=2 * h * sim_model.vocab / flops,
        tp_bytes_per_token=2 * h * bpv, activation_bytes_per_token=h * bpv,
        grad_bytes_per_layer=sim_model.params_per_layer * bpv, backward_factor=2.0, makespan_cv=makespan_cv,
        makespan_sd_s=makespan_sd_s, microbatch_cv=microbatch_cv, tail_s=tail_s,
    )


def fitted_model(config, iterations: int = 24, spread_iterations: int = 0) -> PlannerModel:
    """Fit the cost model on a healthy warm-up of ``config``'s job, as the analytics consumer would,
    and build the planner's figures from the fits and the job's ``plan.current``.

    ``iterations`` of telemetry feed the fits; the replicas' spread and the stalls' tail are
    calibrated on the observed times of max(iterations, ``spread_iterations``) healthy
    iterations — what the engine has by the time a fault comes (it keeps the epoch's latest
    4,096 healthy ``analytics.prediction`` times). Rare stalls are most of the tail, so a few dozen
    iterations give a noisy figure."""
    fits, current, tokens, _, walls = warmup_fits(config, iterations, spread_iterations)
    hardware = hardware_of(config.cluster)
    model = model_from_fits(fits, current, hardware, tokens_per_microbatch=tokens)  # Σlᵢ² from the fits, as the engine
    return calibrate_spread(model, config.plan, ClusterState(config.cluster.gpus, hardware), walls)


def warmup_fits(config, iterations: int = 24, spread_iterations: int = 0
                ) -> tuple[list[CostFit], PlanCurrent, float, float, list[float]]:
    """(CostFit per stage and kind, the job's plan.current, mean tokens and Σlᵢ² per micro-batch,
    observed iteration times) from a healthy warm-up of ``config``'s job; the iteration times
    are max(iterations, spread_iterations) of them (the ones past ``iterations`` are run
    without building events)."""
    from analytics.detection.cost_model import fit_class
    from analytics.detection.cost_publish import cost_fit
    from trainer.sim.engine import SimEngine

    plan: Plan = config.plan
    reporters = [st.devices[0] for st in plan.pipelines[0].stages]  # TP peers report the same chunks
    walls = []
    engine = SimEngine(config.model_copy(update={"telemetry": reporters, "job": config.job + "-warmup"}), [])
    rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    current: PlanCurrent | None = None
    tokens, sum_sq = [], []
    for e in engine.run(iterations):
        p = e.payload
        if isinstance(p, PlanCurrent):
            current = p
        if isinstance(p, IterationSummary):
            walls.append(p.wall_s)
        if not isinstance(p, RankIteration):
            continue
        for c in p.chunks:
            s2 = float(sum(x * x for x in c.seq_lens)) if c.seq_lens else float("nan")
            n = float(c.tokens) if c.tokens is not None else float("nan")  # unknown, never 0
            rows.setdefault((p.coords.pp, str(c.kind)), []).append((n, s2, c.duration_s))
            if p.coords.pp == 0 and str(c.kind) == "F":
                tokens.append(n)
                sum_sq.append(s2)
    if spread_iterations > iterations:
        walls.extend(engine.iteration_durations(spread_iterations - iterations).tolist())
    if current is None:
        raise RuntimeError("the simulator published no plan.current; this benchmark needs it")
    fits = []
    for (stage, kind), xs in sorted(rows.items()):
        a = np.asarray(xs, dtype=float)
        fits.append(cost_fit(stage, kind, [fit_class(a[:, 0], a[:, 1], a[:, 2])]))
    return fits, current, float(np.nanmean(tokens)), float(np.nanmean(sum_sq)), [float(w) for w in walls]
