"""The simulator's ground truth of goodput, to grade the event-log fold (collector/goodput.py) against.

The simulator knows what the platform can only estimate: how long each iteration would have taken
had no fault been active. Its workload, noise and stalls are drawn from generators seeded by
(seed, iteration, group) alone, so a twin engine with the same configuration and plan but no
faults, started at the same iteration, draws the same iteration healthy: that is the counterfactual.
Truth is then

    productive = Σ over completed iterations of the twin's (healthy) duration
    wall       = the simulated seconds the run lasted

and everything else — hangs on a dead device, slow iterations' excess, reshape pauses, restarts,
probes — is loss. ``run_case`` runs one case in the closed loop (resihp/closed_loop.py) with the
goodput fold as an observer and returns both figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from collector.goodput import Goodput
from analytics.projections.goodput_projection import GoodputProjection
from collector.events import Envelope, IterationSummary
from collector.plan import Plan
from trainer.sim.engine import SimConfig, SimEngine
from trainer.fault_spec import FaultSpec


class TruthRecordingEngine(SimEngine):
    """A SimEngine that remembers, per plan epoch, which iterations ran under which plan."""

    def __init__(self, config: SimConfig, faults: list[FaultSpec] | None = None) -> None:
        super().__init__(config, faults)
        self.ran: list[tuple[Plan, int, float, float]] = []  # (plan, iteration, duration, end time) per iteration

    def step(self) -> list[Envelope]:
        events = super().step()
        for e in events:
            if isinstance(e.payload, IterationSummary):
                self.ran.append((self.plan, e.payload.iteration, e.payload.wall_s, self.now_s))
        return events


def healthy_seconds(config: SimConfig, ran: list[tuple[Plan, int, float, float]], until_s: float) -> float:
    """Σ of the healthy durations of the iterations in ``ran`` that ended by ``until_s``: one twin
    engine per run of consecutive iterations under one plan."""
    total = 0.0
    runs: list[tuple[Plan, list[int]]] = []
    for plan, it, _, end in ran:
        if end > until_s + 1e-9:
            break
        if runs and runs[-1][0] is plan and runs[-1][1][-1] + 1 == it:
            runs[-1][1].append(it)
        else:
            runs.append((plan, [it]))
    for plan, its in runs:
        twin = SimEngine(config.model_copy(update={"plan": plan}), [])
        twin.iteration = its[0]
        total += float(twin.iteration_durations(len(its)).sum())
    return total


@dataclass(frozen=True)
class GoodputCase:
    name: str
    faults: tuple[FaultSpec, ...]
    duration_s: float


@dataclass(frozen=True)
class GoodputResult:
    case: str
    truth_ratio: float
    fold: Goodput
    truth_wall_s: float
    truth_productive_s: float

    @property
    def error(self) -> float:
        """The fold's ratio minus truth's, in ratio points (0.01 is one percentage point)."""
        return self.fold.ratio - self.truth_ratio


def run_case(config: SimConfig, case: GoodputCase, *, directory: str | None = None) -> GoodputResult:
    """``case`` in the closed loop under ``config`` (auto-apply policy, the planner ``ours``)."""
    from remediation.candidates import PlannerOptions
    from resihp.closed_loop import run_closed_loop
    from resihp.planning_models import fitted_model, hardware_of

    sim = TruthRecordingEngine(config, list(case.faults))
    projection = GoodputProjection()
    options = PlannerOptions(horizon_s=600.0, pause_s=config.reshape_pause_s, rebalance_pause_s=config.rebalance_pause_s)
    run_closed_loop(sim, fitted_model(config), strategy="ours", duration_s=case.duration_s, options=options,
                    hardware=hardware_of(config.cluster), window_s=2.0, directory=directory,
                    telemetry_retention_s=1e9, observers=[projection])
    fold = projection.fold.breakdown(config.job)
    if fold is None:
        raise RuntimeError(f"case {case.name}: the goodput fold saw nothing of job {config.job!r}")
    wall = sim.now_s
    productive = healthy_seconds(config, sim.ran, wall)
    return GoodputResult(case.name, productive / wall, fold, wall, productive)
