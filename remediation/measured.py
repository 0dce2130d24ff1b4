"""Job tokens from the analytics consumer's per-iteration observations.

``analytics.prediction.tokens`` is the sum of the *forward chunks'* tokens over every rank of the
iteration's frame (analytics/detector.py): each micro-batch is counted once per rank that runs its
forward — once per TP rank of every stage, once per virtual stage. Under TP2·PP2 that is 4× the
job's tokens (the simulator demo: 106,880 against ``telemetry.summary``'s 26,720). Taken as job
tokens it made the planner's tokens per micro-batch, hence its predicted tokens/s, and every
measured tokens/s of verification, TP·PP·v times too large.

What can go wrong: a frame missing ranks (a dead rank's chunks never arrive) counts fewer copies
than the plan implies; the result is then low by that share. Micro-batches of different replicas
are assumed to hold the same tokens on average.
"""

from __future__ import annotations

from collector.plan import Plan


def forward_copies(plan: Plan) -> float:
    """How many forward chunks each micro-batch gives rise to under ``plan`` (weighted over replicas
    by their micro-batches): Σ_stages TP × virtual stages."""
    total_mb = sum(p.microbatches for p in plan.pipelines)
    weighted = sum(p.microbatches * sum(st.tp for st in p.stages) * plan.virtual_stages for p in plan.pipelines)
    return weighted / total_mb if total_mb else 1.0


def job_tokens(prediction_tokens: int, plan: Plan | None) -> int:
    """The job's tokens in an iteration from ``analytics.prediction.tokens`` (see the module
    docstring); unchanged when the plan of that epoch is unknown."""
    if plan is None:
        return prediction_tokens
    return int(round(prediction_tokens / forward_copies(plan)))
