"""What a planning strategy answers: a plan with its prediction and cost, or a refusal.

The planner, every baseline and the oracle answer in these terms, so the engine and the benchmark
judge them with one rule (:meth:`PlanResult.worth_applying`).
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


PlanFunction = Callable[[ClusterState, Plan], PlanResult]
