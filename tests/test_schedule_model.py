"""The schedule DAG reproduces the known closed forms and predicts what a slow chunk costs."""

from __future__ import annotations

import numpy as np
import pytest

from analytics.detection.schedule import (
    PipelineDurations, closed_form_1f1b_s, closed_form_interleaved_s, closed_form_zero_bubble_s,
    durations_from_plan, op_table, pipeline_timing, predict_iteration, predict_plan,
)
from collector.plan import Plan


@pytest.mark.parametrize("stages,microbatches", [(1, 4), (2, 1), (4, 3), (4, 8), (8, 32)])
def test_1f1b_uniform_matches_closed_form(stages: int, microbatches: int) -> None:
    timing = pipeline_timing(op_table("1f1b", stages, microbatches), 0.010, 0.020)
    assert timing.makespan_s[0] == pytest.approx(closed_form_1f1b_s(stages, microbatches, 0.010, 0.020), rel=1e-9)


@pytest.mark.parametrize("stages,microbatches,v", [(2, 4, 3), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_interleaved_uniform_matches_closed_form(stages: int, microbatches: int, v: int) -> None:
    timing = pipeline_timing(op_table("interleaved", stages, microbatches, v), 0.012, 0.024)
    want = closed_form_interleaved_s(stages, microbatches, v, 0.012, 0.024)
    assert timing.makespan_s[0] == pytest.approx(want, rel=1e-9)
    assert want < closed_form_1f1b_s(stages, microbatches, 0.012, 0.024)


@pytest.mark.parametrize("stages,microbatches,f,b,w", [(4, 4, 1, 1, 1), (4, 8, 1, 2, 0.5), (8, 16, 1, 1, 1), (4, 12, 1, 1, 0.5)])
def test_zero_bubble_uniform_matches_zb_h1(stages: int, microbatches: int, f: float, b: float, w: float) -> None:
    timing = pipeline_timing(op_table("zero_bubble", stages, microbatches), f, b, w)
    assert timing.makespan_s[0] == pytest.approx(closed_form_zero_bubble_s(stages, microbatches, f, b, w), rel=1e-9)


def test_every_stage_runs_each_chunk_once_in_a_dependency_respecting_order() -> None:
    for args in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zero_bubble", 4, 8, 1)]:
        table = op_table(*args)
        timing = pipeline_timing(table, np.random.default_rng(0).uniform(0.5, 1.5, (3, 4, 8)), 1.0, 0.5, 0.1)
        kinds = 3 if args[0] == "zero_bubble" else 2
        assert table.n_ops == 4 * 8 * args[3] * kinds
        for s in range(4):  # a stage never runs two ops at once
            idx = np.flatnonzero(table.stage == s)
            idx = idx[np.argsort(table.position[idx])]
            assert np.all(timing.start_s[:, idx[1:]] >= timing.end_s[:, idx[:-1]] - 1e-12)
        has_dep = table.dep < table.n_ops
        assert np.all(timing.start_s[:, has_dep] >= timing.end_s[:, table.dep[has_dep]] - 1e-12)


def test_slow_stage_lengthens_1f1b_steady_state_by_the_bottleneck() -> None:
    # A stage slowed ×f becomes the bottleneck: its own m·f·(t_f+t_b) of work, plus at most the
    # fill and drain of the healthy stages around it.
    S, M, f = 4, 32, 2.0
    fw = np.full((S, M), 1.0)
    bw = np.full((S, M), 2.0)
    fw[2] *= f
    bw[2] *= f
    got = pipeline_timing(op_table("1f1b", S, M), fw, bw).makespan_s[0]
    assert M * f * 3 + 2 * 1.0 + 2 * 2.0 <= got <= M * f * 3 + (S - 1) * 3  # stages 0,1 fill and drain
    assert got > closed_form_1f1b_s(S, M, 1.0, 2.0) * 1.8


def test_p2p_adds_to_the_critical_path() -> None:
    S, M = 4, 8
    base = pipeline_timing(op_table("1f1b", S, M), 1.0, 2.0).makespan_s[0]
    with_p2p = pipeline_timing(op_table("1f1b", S, M), 1.0, 2.0, p2p_s=0.1).makespan_s[0]
    assert with_p2p > base
    # Warm-up and cool-down each cross the S-1 links once per direction at least.
    assert with_p2p >= base + 2 * (S - 1) * 0.1 - 1e-9


def test_predict_iteration_groups_replicas_of_different_shapes_and_adds_allreduce() -> None:
    reps = [PipelineDurations(np.full((4, 8), 1.0), np.full((4, 8), 2.0)),
            PipelineDurations(np.full((4, 6), 1.0), np.full((4, 6), 2.0)),
            PipelineDurations(np.full((2, 8), 1.0), np.full((2, 8), 2.0))]
    pred = predict_iteration("1f1b", reps, dp_allreduce_s=0.5)
    assert list(pred.replica_end_s) == [closed_form_1f1b_s(4, 8, 1, 2), closed_form_1f1b_s(4, 6, 1, 2),
                                        closed_form_1f1b_s(2, 8, 1, 2)]
    assert pred.iteration_s == closed_form_1f1b_s(4, 8, 1, 2) + 0.5
    timing, row = pred.timing_of(1)
    assert timing.makespan_s[row] == closed_form_1f1b_s(4, 6, 1, 2)


def test_predict_plan_uses_the_cost_function_per_stage() -> None:
    plan = Plan.uniform(tp=2, pp=4, dp=2, num_layers=8, microbatches_per_replica=8)

    def cost(replica: int, stage: int, st, kind: str, m: int) -> float:
        return st.num_layers * (0.5 if kind == "F" else 1.0) * (2.0 if (replica, stage) == (1, 0) else 1.0)

    pred = predict_plan(plan, cost)
    assert pred.replica_end_s[0] == pytest.approx(closed_form_1f1b_s(4, 8, 1.0, 2.0))
    assert pred.replica_end_s[1] > pred.replica_end_s[0]
    reps = durations_from_plan(plan.model_copy(update={"schedule": "zero_bubble"}), cost)
    assert reps[0].w_s is not None and reps[0].w_s.shape == (4, 8)


def test_interleaved_rejects_microbatches_not_multiple_of_stages() -> None:
    with pytest.raises(ValueError, match="multiple of the stages"):
        op_table("interleaved", 4, 6, 2)
