"""What a plan trains as it stands on a cluster: the schedule model's tokens per second.

The planner scores its candidates with these, the engine rates the running plan with them before
and after an incident, and the benchmark's oracle judges every strategy's plan the same way. A plan
that keeps a dead device trains nothing.
"""

from __future__ import annotations

from collector.plan import PipelinePlan, Plan
from remediation.candidates import PlannerOptions, unchanged_candidate
from remediation.cluster import ClusterState
from remediation.costs import PipelineScorer, ScheduleModelScorer, expected_slowest_s
from remediation.model import PlannerModel


def pipeline_signature(pipe: PipelinePlan) -> tuple:
    """The shape of a pipeline (TP degree and layer range per stage): equal signatures cost the same
    on healthy devices."""
    return tuple((st.tp, st.first_layer, st.end_layer) for st in pipe.stages)


def expected_iteration_s(model: PlannerModel, spans: dict[float, int], dp_s: float) -> float:
    """The mean iteration: the expected slowest pipeline (``spans``: mean makespan → how many
    pipelines), the stalls' tail, and the DP all-reduce after it."""
    return expected_slowest_s(spans.items(), model.makespan_cv, sd_s=model.makespan_sd_s) + model.tail_s + dp_s


def plan_spans(cluster: ClusterState, model: PlannerModel, plan: Plan, scorer: PipelineScorer | None = None
               ) -> tuple[dict[float, int], float] | None:
    """(mean makespan → how many pipelines, DP all-reduce seconds) of ``plan`` as it stands on
    ``cluster``; None when it uses a dead device. Identical healthy pipelines are scored once."""
    scorer = scorer or ScheduleModelScorer(plan.schedule, plan.virtual_stages, model.microbatch_cv)
    opts = PlannerOptions()
    bad = cluster.bad_devices()
    spans: dict[float, int] = {}
    dp_s = 0.0
    seen: dict[tuple, tuple[float, float]] = {}
    for pipe in plan.pipelines:
        damaged = bool(bad) and any(d in bad for st in pipe.stages for d in st.devices)
        key = (pipeline_signature(pipe), pipe.microbatches)
        if not damaged and key in seen:
            s, d = seen[key]
        else:
            cand = unchanged_candidate(cluster, model, pipe, plan.schedule, opts, plan.dp)
            if cand is None:
                return None
            s, d = scorer.makespan_s(cand.running_times, pipe.microbatches), cand.dp_s
            if not damaged:
                seen[key] = (s, d)
        spans[s] = spans.get(s, 0) + 1
        dp_s = max(dp_s, d)
    return spans, (dp_s if plan.dp > 1 else 0.0)


def predict_tokens_per_s(
    cluster: ClusterState, model: PlannerModel, plan: Plan, scorer: PipelineScorer | None = None,
) -> float:
    """Tokens/s of ``plan`` as it stands on ``cluster`` (0 when it uses a dead device), scored
    with the schedule model."""
    scored = plan_spans(cluster, model, plan, scorer)
    if scored is None:
        return 0.0
    return plan.global_microbatches * model.tokens_per_microbatch / expected_iteration_s(model, *scored)
