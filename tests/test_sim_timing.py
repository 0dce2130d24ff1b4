"""The simulator's healthy timing matches the schedules' closed forms; faults cost what the DAG says."""

from __future__ import annotations

import numpy as np
import pytest

from analytics.detection.schedule import (
    closed_form_1f1b_s, closed_form_interleaved_s, closed_form_zero_bubble_s, op_table, pipeline_timing,
)
from collector.events import Envelope, FaultInjected, Heartbeat, RankIteration
from collector.plan import Plan, Schedule
from trainer.sim.engine import NOISE_OFF, SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import ClusterSpec, ModelSpec
from trainer.sim.workload import WORKLOAD_PRESETS

# Uniform chunks: fixed-length documents, no noise, a tiny vocabulary (no LM-head imbalance) and
# links so fast that transfers vanish next to compute; no per-layer overhead (a slow GPU slows its
# FLOPs, not its launch overhead), so a slowed chunk is exactly ×factor.
MODEL = ModelSpec(name="uniform", layers=16, hidden=2048, heads=16, vocab=8)
FAST = dict(intra_node_gbps=1e9, inter_node_gbps=1e9, link_latency_s=0.0, layer_overhead_s=0.0)


def _engine(schedule: Schedule, pp: int, mb: int, *, v: int = 1, dp: int = 1, faults: list[FaultSpec] | None = None,
            noise=NOISE_OFF, seed: int = 0) -> SimEngine:
    plan = Plan.uniform(tp=1, pp=pp, dp=dp, num_layers=MODEL.layers, microbatches_per_replica=mb,
                        schedule=schedule, virtual_stages=v)
    cluster = ClusterSpec.model_validate({"gpus": pp * dp, **FAST})
    cfg = SimConfig(model=MODEL, cluster=cluster, workload=WORKLOAD_PRESETS["uniform"], noise=noise, plan=plan, seed=seed)
    return SimEngine(cfg, faults)


def _rank_iters(events: list[Envelope], iteration: int) -> dict[int, RankIteration]:
    return {e.payload.rank: e.payload for e in events
            if isinstance(e.payload, RankIteration) and e.payload.iteration == iteration}


def _chunk_time(ri: RankIteration, kind: str) -> float:
    return float(np.mean([c.duration_s for c in ri.chunks if c.kind == kind]))


@pytest.mark.parametrize("pp,mb", [(4, 8), (8, 16)])
def test_healthy_1f1b_matches_closed_form(pp: int, mb: int) -> None:
    events = _engine("1f1b", pp, mb).run(2)
    ri = _rank_iters(events, 1)
    t_f, t_b = _chunk_time(ri[0], "F"), _chunk_time(ri[0], "B")
    assert t_b == pytest.approx(2 * t_f, rel=0.05)
    assert ri[0].wall_s == pytest.approx(closed_form_1f1b_s(pp, mb, t_f, t_b), rel=0.01)


def test_healthy_interleaved_matches_closed_form() -> None:
    pp, mb, v = 4, 8, 2
    ri = _rank_iters(_engine("interleaved", pp, mb, v=v).run(1), 0)
    chunks = ri[0].chunks
    assert {c.virtual_stage for c in chunks} == {0, 1}
    t_f = sum(c.duration_s for c in chunks if c.kind == "F") / mb  # a stage's whole forward per micro-batch
    t_b = sum(c.duration_s for c in chunks if c.kind == "B") / mb
    assert ri[0].wall_s == pytest.approx(closed_form_interleaved_s(pp, mb, v, t_f, t_b), rel=0.01)
    assert ri[0].wall_s < closed_form_1f1b_s(pp, mb, t_f, t_b)


def test_healthy_zero_bubble_matches_zb_h1() -> None:
    pp, mb = 4, 8
    ri = _rank_iters(_engine("zero_bubble", pp, mb).run(1), 0)
    t_f, t_b, t_w = (_chunk_time(ri[0], k) for k in "FBW")
    assert t_w < t_b
    assert ri[0].wall_s == pytest.approx(closed_form_zero_bubble_s(pp, mb, t_f, t_b, t_w), rel=0.01)


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_fail_slow_lengthens_iteration_by_what_the_dag_predicts(factor: float) -> None:
    pp, mb = 4, 8
    fault = FaultSpec(kind="slow_compute", device=2, factor=factor, at_iteration=2)
    events = _engine("1f1b", pp, mb, faults=[fault]).run(4)
    healthy, slow = _rank_iters(events, 1), _rank_iters(events, 3)
    # The DAG's prediction from healthy chunk times, with stage 2's compute ×factor.
    f = np.array([[c.duration_s for c in healthy[s].chunks if c.kind == "F"] for s in range(pp)])
    b = np.array([[c.duration_s for c in healthy[s].chunks if c.kind == "B"] for s in range(pp)])
    f[2] *= factor
    b[2] *= factor
    predicted = pipeline_timing(op_table("1f1b", pp, mb), f, b).makespan_s[0]
    assert slow[0].wall_s == pytest.approx(predicted, rel=0.01)
    assert slow[0].wall_s > healthy[0].wall_s * (1 + 0.5 * (factor - 1))
    # Only the slowed stage's chunks got longer; the others wait instead.
    assert _chunk_time(slow[2], "F") == pytest.approx(factor * _chunk_time(healthy[2], "F"), rel=0.01)
    assert _chunk_time(slow[1], "F") == pytest.approx(_chunk_time(healthy[1], "F"), rel=0.01)
    truth = [e.payload for e in events if isinstance(e.payload, FaultInjected)]
    assert len(truth) == 1 and truth[0].location.rank == 2 and truth[0].start_iteration == 2


def test_fail_stop_silences_the_rank_and_hangs_the_job() -> None:
    pp, dp, mb = 2, 2, 4
    fault = FaultSpec(kind="stop_device", device=1, at_iteration=3)
    engine = _engine("1f1b", pp, mb, dp=dp, faults=[fault])
    before = engine.run(3)
    assert {e.payload.rank for e in before if isinstance(e.payload, RankIteration)} == {0, 1, 2, 3}
    after: list[Envelope] = []
    for _ in range(5):
        after += engine.step()
    assert engine.iteration == 3  # nothing completes while a rank of the plan is dead
    assert not [e for e in after if isinstance(e.payload, RankIteration)]
    beats = [e.payload.rank for e in after if isinstance(e.payload, Heartbeat)]
    assert beats and 1 not in beats and {0, 2, 3} <= set(beats)
    assert [e.payload.category for e in after if isinstance(e.payload, FaultInjected)] == ["fail_stop"]


def test_elastic_restart_drops_the_dead_replica_and_keeps_the_batch() -> None:
    fault = FaultSpec(kind="stop_device", device=1, at_iteration=2)
    engine = _engine("1f1b", 2, 4, dp=2, faults=[fault])
    engine = SimEngine(engine.config.model_copy(update={"restart_after_s": 30.0}), [fault])
    events = engine.run(5)
    late = [e.payload for e in events if isinstance(e.payload, RankIteration) and e.payload.iteration == 4]
    assert {p.rank for p in late} == {2, 3} and {p.epoch for p in late} == {1}
    assert engine.plan.global_microbatches == 8 and engine.plan.dp == 1


def test_noise_and_stalls_make_chunks_vary_but_not_the_noise_free_model() -> None:
    noisy = _engine("1f1b", 2, 8, noise=SimConfig.model_fields["noise"].default)
    ri = _rank_iters(noisy.run(1), 0)
    durations = [c.duration_s for c in ri[0].chunks if c.kind == "F"]
    assert np.std(durations) > 0
    quiet = _rank_iters(_engine("1f1b", 2, 8).run(1), 0)
    assert np.std([c.duration_s for c in quiet[0].chunks if c.kind == "F"]) == pytest.approx(0, abs=1e-12)


def test_block_size_does_not_change_the_numbers() -> None:
    a = _engine("1f1b", 4, 8, noise=SimConfig.model_fields["noise"].default, seed=5)
    b = SimEngine(a.config.model_copy(update={"block_iterations": 3}))
    assert np.array_equal(a.iteration_durations(10), b.iteration_durations(10))


def test_the_dp_allreduce_waits_for_the_largest_shard_of_any_replica():
    from collector.plan import PipelinePlan
    from trainer.sim.cost import dp_allreduce_s
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    model, cluster = MODEL_PRESETS["7b"], ClusterSpec(gpus=64)
    even = Plan.uniform(tp=8, pp=4, dp=2, num_layers=model.layers, microbatches_per_replica=8)
    # replica 1's first stage shrinks to TP 4: its devices hold twice the gradient bytes
    shrunk_stage = even.pipelines[1].stages[0].model_copy(update={"devices": even.pipelines[1].stages[0].devices[:4]})
    shrunk = even.model_copy(update={"pipelines": (
        even.pipelines[0],
        PipelinePlan(replica=1, microbatches=8, stages=(shrunk_stage, *even.pipelines[1].stages[1:])),
    )})
    assert dp_allreduce_s(model, cluster, shrunk) > 1.9 * dp_allreduce_s(model, cluster, even)
