"""Whether a job's executor can run a plan, judged from what it declared (``plan.capabilities``).

One rule, read by both sides of the contract: the planner (remediation/) filters its proposals
with it, and an executor that receives a plan anyway refuses it with the same words before
anything stops. The executor may add checks of its own the contract cannot know (a TP degree
that does not divide its model's heads); this one covers what the declaration says.

The judgement compares the new plan with the one running, per remediation kind:

- TP: ``per_stage`` allows any degrees; ``uniform`` needs one degree for every stage of every
  replica; ``no`` needs each stage's degree unchanged.
- PP: ``per_replica`` allows any layer ranges; ``uniform`` needs the same ranges in every
  replica; ``no`` needs the running ranges.
- DP: a replica fewer needs ``dp_drop``; unequal micro-batch counts need ``dp_microbatch_migration``.
- the schedule must be one the executor runs.
"""

from __future__ import annotations

from collector.events import ExecutorCapabilities
from collector.plan import Plan

# remediation kind -> the words a plan uses when the executor cannot run it
KIND_LABELS: dict[str, str] = {
    "tp_shrink": "TP shrink", "tp_exclusion": "TP exclusion", "pp_repartition": "PP repartition",
    "dp_drop": "DP drop", "dp_microbatch_migration": "DP micro-batch migration",
}


def _why(caps: ExecutorCapabilities, kind: str) -> str:
    note = caps.notes.get(kind)
    return f"executor {caps.executor} cannot run it" + (f" ({note})" if note else "")


def capability_refusal(plan: Plan, running: Plan | None, caps: ExecutorCapabilities) -> str | None:
    """Why ``caps``' executor cannot move from ``running`` to ``plan`` (None: it can). Pure."""
    if plan.schedule not in caps.schedules:
        return f"schedule {plan.schedule!r}: executor {caps.executor} runs only {', '.join(caps.schedules)}"
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    ranges = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in plan.pipelines}
    if caps.tp_shrink == "uniform" and len(tps) > 1:
        return (f"plan epoch {plan.epoch} mixes TP degrees {sorted(tps)}: {KIND_LABELS['tp_exclusion']} — "
                f"{_why(caps, 'tp_exclusion')}")
    if running is None:
        return None
    old_tps = {s.tp for p in running.pipelines for s in p.stages}
    if caps.tp_shrink == "no" and tps != old_tps:
        return f"plan epoch {plan.epoch} changes TP degrees {sorted(old_tps)} → {sorted(tps)}: {_why(caps, 'tp_shrink')}"
    old_ranges = {tuple((s.first_layer, s.end_layer) for s in p.stages) for p in running.pipelines}
    if caps.pp_repartition == "uniform" and len(ranges) > 1:
        return (f"plan epoch {plan.epoch} gives replicas different layer ranges: {KIND_LABELS['pp_repartition']} "
                f"per replica — {_why(caps, 'pp_repartition')}")
    if caps.pp_repartition == "no" and not ranges <= old_ranges:
        return f"plan epoch {plan.epoch} moves layers: {KIND_LABELS['pp_repartition']} — {_why(caps, 'pp_repartition')}"
    if plan.dp < running.dp and not caps.dp_drop:
        return f"plan epoch {plan.epoch} drops {running.dp - plan.dp} replica(s): {_why(caps, 'dp_drop')}"
    counts = {p.microbatches for p in plan.pipelines}
    if len(counts) > 1 and not caps.dp_microbatch_migration:
        return (f"plan epoch {plan.epoch} gives replicas different micro-batch counts {sorted(counts)}: "
                f"{KIND_LABELS['dp_microbatch_migration']} — {_why(caps, 'dp_microbatch_migration')}")
    return None


__all__ = ["capability_refusal", "KIND_LABELS"]
