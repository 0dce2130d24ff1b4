"""Tuning the baselines on one half of the detection suite replays what they read: the replay of a
setting opens what the live baseline opens, and the halves hold alternate cases."""

from __future__ import annotations

from bench import detect
from bench._detect_tuning import GRIDS, defaults, halves, replay, settings


def test_a_replayed_baseline_opens_what_it_opened_live() -> None:
    case = detect.Case("compute x3", "fail_slow_compute_x2", iterations=60, faults=[
        {"kind": "slow_compute", "device": 9, "factor": 3.0, "at_iteration": 20, "duration_iterations": 20}])
    run = detect.run_case(case)
    for name in GRIDS:
        live = sorted((t.opened, t.locations[0].rank) for t in run.incidents[name].values())
        assert defaults(name) in list(settings(name))  # the grid holds the published default
        again = sorted((p.iteration, p.locations[0].rank) for p in replay(name, defaults(name), run.config.job,
                                                                           run.baseline_inputs))
        assert again == live, name
    assert any(run.incidents[name] for name in GRIDS)  # something to compare: a ×3 GPU trips some baseline


def test_the_halves_alternate_over_the_suite() -> None:
    a, b = halves(7)
    assert (a, b) == ([0, 2, 4, 6], [1, 3, 5])
