"""How slow the detector first says a fault is, in the dialects of real trainers: each case is one
of ``resihp bench detect``'s runs, and each test failed on the detector before its rule."""

from __future__ import annotations

import pytest

from bench import detect


def _case(name: str) -> detect.Case:
    (case,) = [c for c in detect.suite(120) if c.name == name]
    return case


def _first(name: str, dialect: str) -> tuple[float, float]:
    """(injected factor, first size) of the case's one fail-slow, as ``bench detect`` scores it."""
    faults, incidents, iterations, _, config, *_ = detect.run_case(_case(name), dialect)
    ((_, true, first),) = detect.first_sizes(faults, incidents["ours"], iterations, config)
    return true, first


def test_without_lengths_a_slow_gpu_is_not_in_the_medians_that_size_it() -> None:
    """Megatron: a ×2 GPU on the last of four stages. Its prediction (the micro-batch's mix, the
    median over its replica's stages) and its centre (the median over its class's TP groups)
    included it until it was a suspect: it opened at ×1.80 in chunk time (×1.89 to the planner)
    and read ×1.90 from the next iteration on."""
    true, first = _first("compute x2.0 (recovers)", "megatron")
    assert abs(first / true - 1) < 0.04


@pytest.mark.parametrize("dialect", ["megatron", "profiler"])
def test_a_link_under_timers_that_hold_waits_is_first_sized_by_its_probe(dialect: str) -> None:
    """The ×3 link's communication incident opened naming a link from timers that hold waits, at
    the iteration's excess (×1.1): a planner would have costed the link at ×1.1. It now opens
    without a place, and the probe names and sizes the link."""
    true, first = _first("pipeline link x3.0", dialect)
    assert abs(first / true - 1) < 0.05


def test_a_gpu_whose_tp_time_is_recorded_apart_is_sized_in_chunk_time() -> None:
    """torch.profiler records the TP all-reduces apart, so the chunks' own time is compute alone
    and a ×3 GPU read ×2.93 of it; the planner, which adds TP time back to a chunk factor, took
    it for ×3.17. Sized as the chunk's slowdown with its TP time in, as every other dialect."""
    faults, incidents, iterations, _, config, *_ = detect.run_case(_case("compute x3.0 (recovers)"), "profiler")
    ((true, _, read),) = detect.sizing(faults, incidents["ours"], iterations, config)
    assert abs(read / true - 1) < 0.03


def test_an_untraced_gpu_is_first_sized_by_the_probe_that_places_it() -> None:
    """Sampled: a ×2 GPU on the last stage of a replica nobody traces. The opening names one of
    the 16 untraced ranks, sized as the median over stages of the one-stage slowdown the job's
    lateness implies (×2.25 to the planner: the last stage is the heaviest, so the same lateness is
    a smaller slowdown of it). It places nothing, so the first size is the probe's naming, which
    gives the GPU its own stage's answer (a ×2.0 GPU to the planner)."""
    true, first = _first("compute x2.0 (recovers)", "sampled")
    assert abs(first / true - 1) < 0.05


def test_a_gpu_slow_from_the_start_is_sized_by_a_fit_that_never_learned_from_it() -> None:
    """Sampled: a ×1.8 GPU from the first iteration, in a class only two traced TP groups run. The
    class's first line was fitted from both groups' units, half of them slow, so it sat between
    them: the GPU opened at ×1.47 to the planner (×1.42 in chunk time) and its healthy peer read
    fast. Scored by a fit without its group, as it will be once suspected (whose rows are then
    taken out of the window), it opens at its size."""
    true, first = _first("slow from start x1.8", "sampled")
    assert abs(first / true - 1) < 0.05
