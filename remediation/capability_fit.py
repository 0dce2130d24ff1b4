"""The planner's options cut to what the job's executor declared it can run.

A job announces its executor's capabilities on the bus (``plan.capabilities``); the engine plans
only within them, so an executor is never sent a plan it would refuse, and every proposal says
what was left out and why ("PP repartition not offered: executor native moves layers only alike
in every replica (…)"), so an operator who expected layers to move sees why the plan does not.

The planner's TP candidates shrink or re-form one stage's group around its bad devices, which is
a per-stage TP change and an exclusion; its PP candidates re-split one pipeline's layers, which
is a per-replica repartition. An executor that runs neither (one DeviceMesh over the whole job)
is planned for with DP changes only: micro-batch migration and replica drop; the native
executor, one mesh per stage, gets the TP candidates but not the per-replica re-split. The final
word on a plan is collector/capabilities.py's ``capability_refusal``, which the engine also runs
on whatever a strategy returns.
"""

from __future__ import annotations

from dataclasses import replace

from collector.capabilities import KIND_LABELS
from collector.events import ExecutorCapabilities
from remediation.candidates import PlannerOptions


def _left_out(caps: ExecutorCapabilities, kind: str, how: str = "cannot run it") -> str:
    note = caps.notes.get(kind)
    return f"{KIND_LABELS[kind]} not offered: executor {caps.executor} {how}" + (f" ({note})" if note else "")


def fit_options(options: PlannerOptions, caps: ExecutorCapabilities | None) -> tuple[PlannerOptions, list[str]]:
    """``options`` restricted to ``caps`` (None: the job declared nothing, plan with everything),
    and one line per remediation left out, for the proposal's ``not_offered``."""
    if caps is None:
        return options, []
    notes: list[str] = []
    allow_tp = options.allow_tp
    if allow_tp and not caps.tp_exclusion:
        allow_tp = False
        notes.append(_left_out(caps, "tp_exclusion"))
    elif allow_tp and caps.tp_shrink != "per_stage":
        allow_tp = False
        notes.append(_left_out(caps, "tp_shrink", "shrinks TP only job-wide" if caps.tp_shrink == "uniform"
                                                  else "cannot run it"))
    allow_pp = options.allow_pp
    if allow_pp and caps.pp_repartition != "per_replica":
        allow_pp = False
        notes.append(_left_out(caps, "pp_repartition", "moves layers only alike in every replica, which the planner's "
                                                        "per-pipeline re-split does not promise"
                               if caps.pp_repartition == "uniform" else "cannot run it"))
    allow_dp = options.allow_dp and caps.dp_microbatch_migration
    if options.allow_dp and not allow_dp:
        notes.append(_left_out(caps, "dp_microbatch_migration"))
    allow_drop = options.allow_drop and caps.dp_drop
    if options.allow_drop and not allow_drop:
        notes.append(_left_out(caps, "dp_drop"))
    # An executor that changes TP and PP only job-wide and cannot run uneven replicas runs one grid:
    # it gets every uniform layout (a restart at TP 1, at PP 1, at half the replicas …) instead.
    uniform_only = (caps.tp_shrink != "per_stage" and caps.pp_repartition != "per_replica"
                    and not caps.dp_microbatch_migration)
    return replace(options, allow_tp=allow_tp, allow_pp=allow_pp, allow_dp=allow_dp, allow_drop=allow_drop,
                   uniform_only=uniform_only, uniform_tp=caps.tp_shrink == "uniform",
                   uniform_pp=caps.pp_repartition == "uniform"), notes


__all__ = ["fit_options"]
