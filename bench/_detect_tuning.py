"""Baselines worth beating: each baseline's thresholds tuned on one half of the detection suite
(the setting with the best F1 there), every detector scored on the other half, both ways round.

Untuned, a baseline's F1 says more about its default thresholds than about its idea. The suite's
cases are split in two halves by their place in it (even and odd), so each half holds healthy runs
and faults of every kind. The baselines read only what every dialect records alike (iteration
times; per-rank compute for NVRx), recorded once per case while the suite runs (``BaselineInputs``)
and replayed through every setting of a grid, so tuning costs no simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from analytics.detection.baselines import ChangePointDetector, RawThresholdDetector, RelativeRankDetector
from collector.events import IncidentOpened, Payload


@dataclass
class BaselineInputs:
    """What the baselines read of one simulated case, in the order the events came."""

    summaries: list[tuple[int, float]] = field(default_factory=list)  # (iteration, wall s)
    ranks: list[tuple[int, int, int, int, float]] = field(default_factory=list)  # (iteration, rank, dp, pp, compute s)


# Each baseline's thresholds: a grid around its published default (the default included).
GRIDS: dict[str, dict[str, list[Any]]] = {
    "raw_threshold": {"factor": [1.03, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2.0], "consecutive": [1, 2, 3, 5]},
    "greyhound_changepoint": {"min_shift": [0.02, 0.03, 0.05, 0.1, 0.2, 0.3], "min_distance": [10, 20, 40],
                              "recent_window": [3, 5, 10]},
    "nvrx_relative": {"threshold": [0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9], "window": [5, 10, 20]},
}
_MAKERS: dict[str, Callable[..., Any]] = {"raw_threshold": RawThresholdDetector,
                                          "greyhound_changepoint": ChangePointDetector,
                                          "nvrx_relative": RelativeRankDetector}


def settings(baseline: str) -> Iterator[dict[str, Any]]:
    grid = GRIDS[baseline]
    for values in product(*grid.values()):
        yield dict(zip(grid, values))


def defaults(baseline: str) -> dict[str, Any]:
    """The baseline's own setting (its published default), as the grid names its thresholds."""
    det = _MAKERS[baseline]("defaults")
    return {k: getattr(det, k) for k in GRIDS[baseline]}


def label(baseline: str, setting: dict[str, Any]) -> str:
    return baseline + "@" + ",".join(f"{k}={v}" for k, v in setting.items())


def replay(baseline: str, setting: dict[str, Any], job: str, inputs: BaselineInputs) -> list[IncidentOpened]:
    """The incidents ``baseline`` under ``setting`` opens on a recorded case."""
    det = _MAKERS[baseline](job, **setting)
    out: list[Payload] = []
    if baseline == "nvrx_relative":
        for row in inputs.ranks:
            out += det.observe(*row)
    else:
        for iteration, wall_s in inputs.summaries:
            out += det.observe(iteration, wall_s)
    out += det.flush()
    return [p for p in out if isinstance(p, IncidentOpened)]


def halves(n: int) -> tuple[list[int], list[int]]:
    """Case indices of the two halves: even places, odd places."""
    return list(range(0, n, 2)), list(range(1, n, 2))


def tune_and_hold_out(results: list, tracked: Callable[[list[IncidentOpened]], dict], score: Callable,
                      jobs: list[str], inputs: list[BaselineInputs], grace: int) -> dict[str, dict]:
    """Per baseline, for each half: the setting with the best F1 on it (ties: the fewer false alarms,
    then the grid's order), and that setting's scores on the other half; ours (untuned) on each half.

    ``results``: the suite's scored runs as ``resihp.referee.score`` takes them, one per case, in
    the suite's order; ``tracked`` turns opened incidents into the referee's records."""
    a, b = halves(len(results))
    out: dict[str, dict] = {}
    ours = {name: score([results[i] for i in half], grace)["ours"] for name, half in (("A", a), ("B", b))}
    out["ours"] = {"held_out": {"A": ours["A"], "B": ours["B"]}}
    for baseline in GRIDS:
        candidates = list(settings(baseline))
        replayed = [{label(baseline, s): tracked(replay(baseline, s, jobs[i], inputs[i])) for s in candidates}
                    for i in range(len(results))]
        on = {name: score([(results[i][0], replayed[i], *results[i][2:]) for i in half], grace)
              for name, half in (("A", a), ("B", b))}
        entry: dict[str, Any] = {"tuned_on": {}, "held_out": {}}
        for tuned, held in (("A", "B"), ("B", "A")):
            best = max(candidates, key=lambda s: (on[tuned][label(baseline, s)]["f1"],
                                                  -on[tuned][label(baseline, s)]["false_alarms_per_10k"]))
            entry["tuned_on"][tuned] = {"setting": best, **on[tuned][label(baseline, best)]}
            entry["held_out"][held] = {"setting": best, **on[held][label(baseline, best)]}
        out[baseline] = entry
    return out
