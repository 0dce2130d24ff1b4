"""What a planning strategy answers: a plan with its prediction and cost, or a refusal.

The planner, every baseline and the oracle answer in these terms, so the engine and the benchmark
judge them with one rule (:meth:`PlanResult.to_apply`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from collector.plan import Plan
from remediation.cluster import ClusterState


class PlanRefused(Exception):
    """No plan can train on what is left; ``reason`` says why and what would fix it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer. ``changed`` is False when keeping the current plan is best (then
    ``plan`` is the current plan)."""

    plan: Plan
    strategy: str
    changed: bool
    iteration_s: float
    predicted_tokens_per_s: float
    current_tokens_per_s: float
    reshape_cost_s: float
    horizon_tokens: float
    diff: list[str] = field(default_factory=list)
    choices: dict[int, str] = field(default_factory=dict)  # source replica -> candidate label
    # the micro-batch-only rebalance to take instead of this plan, which re-forms groups or moves
    # layers, when the planner rates the two within its margin (PlannerOptions.prefer_rebalance_within)
    rebalance: PlanResult | None = None

    @property
    def gain_tokens_per_s(self) -> float:
        return self.predicted_tokens_per_s - self.current_tokens_per_s

    def worth_applying(self, horizon_s: float, min_gain_fraction: float) -> bool:
        """Whether the change trains at least ``min_gain_fraction`` more tokens over ``horizon_s``
        than keeping the current plan, the reshape's pause paid. The margin is there because the
        prediction is a model: a gain smaller than its error is a coin toss that costs a pause. A
        job that trains nothing now (hung on a dead device) takes any plan that trains."""
        if not self.changed:
            return False
        if self.current_tokens_per_s <= 0:
            return True
        return self.horizon_tokens / (self.current_tokens_per_s * horizon_s) - 1 >= min_gain_fraction

    def to_apply(self, horizon_s: float, min_gain_fraction: float) -> PlanResult | None:
        """The plan to apply, or None to keep the current one: the offered rebalance when it is
        itself worth applying, else this plan when it is.

        Why the rebalance, though the plan rates a little higher: the model cannot rank two
        plans that close (a re-form and a layer re-split it rates within 1 % of each other are a
        coin toss in truth, docs/remediation.md), and the rebalance is the cheaper bet. It pauses
        the job for a second instead of twenty, moves no state, and is undone as cheaply when the
        fault clears: a re-formed group stays until a re-grow wins back its own pause, which a
        fault recovered 15 minutes later, with the next change due, may never do. But a
        rebalance short of the minimum gain does not displace a plan that reaches it."""
        if self.rebalance is not None and self.rebalance.worth_applying(horizon_s, min_gain_fraction):
            return self.rebalance
        return self if self.worth_applying(horizon_s, min_gain_fraction) else None


PlanFunction = Callable[[ClusterState, Plan], PlanResult]
