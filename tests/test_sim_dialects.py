"""The simulator records one timeline in each dialect of real trainers (docs/dialects.md): what each
dialect's ranks report has the shape its TracingDeclared says, ``ours`` is unchanged, and a slow
link shows in a fused p2p timer as a longer transfer."""

from __future__ import annotations

import pytest

from collector.events import (
    CommOp, Heartbeat, PlanCurrent, RankIteration, ReconfigureCommand, TracingDeclared,
)
from collector.plan import Plan
from trainer.sim.cost import stage_coefficients
from trainer.sim.engine import NOISE_OFF, SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.scenario import load_scenario
from trainer.sim.workload import WORKLOAD_PRESETS

MODEL = MODEL_PRESETS["tiny"]
CLUSTER = ClusterSpec(gpus=16, gpus_per_node=4)
PLAN = Plan.uniform(tp=2, pp=4, dp=2, num_layers=MODEL.layers, microbatches_per_replica=8)


def _config(dialect: str | None = None, **extra) -> SimConfig:
    fields = dict(model=MODEL, cluster=CLUSTER, plan=PLAN, job="dialects", seed=3, **extra)
    if dialect is not None:
        fields["dialect"] = dialect
    return SimConfig(**fields)


def _run(config: SimConfig, iterations: int = 6, faults: list[FaultSpec] | None = None) -> list:
    return SimEngine(config, faults).run(iterations)


def _payloads(events: list, kind: type) -> list:
    return [e.payload for e in events if isinstance(e.payload, kind)]


def _tp0(plan: Plan) -> list[int]:
    return sorted(st.devices[0] for pipe in plan.pipelines for st in pipe.stages)


def test_ours_is_byte_identical_to_the_default_config_and_declares_nothing() -> None:
    default = [e.model_dump_json() for e in _run(_config())]
    ours = [e.model_dump_json() for e in _run(_config("ours"))]
    assert ours == default
    sc = load_scenario("fail_slow_link").model_copy(update={"iterations": 5})
    plain = [e.model_dump_json() for e in SimEngine(sc.sim_config(), sc.all_faults()).run(5)]
    named = sc.model_copy(update={"dialect": "ours"})
    assert [e.model_dump_json() for e in SimEngine(named.sim_config(), named.all_faults()).run(5)] == plain
    assert not any('"telemetry.tracing"' in line for line in default)


def test_megatron_traces_tp_rank_0_with_fused_p2p_and_no_lengths_or_tokens() -> None:
    events = _run(_config("megatron"))
    kinds = [e.kind for e in events]
    assert kinds[:2] == [PlanCurrent.KIND, TracingDeclared.KIND]  # declared with the plan, before any telemetry
    (decl,) = _payloads(events, TracingDeclared)
    assert (decl.dialect, decl.seq_lens, decl.tokens, decl.fused_p2p) == ("megatron", False, False, True)
    assert decl.traced_ranks == _tp0(PLAN)
    its = _payloads(events, RankIteration)
    assert sorted({p.rank for p in its}) == _tp0(PLAN)
    assert {p.coords.tp for p in its} == {0}
    assert sorted({h.rank for h in _payloads(events, Heartbeat)}) == _tp0(PLAN)
    assert len(its) == 6 * len(_tp0(PLAN))
    for p in its:
        assert all(t is None for t in p.chunk_table.tokens) and all(s is None for s in p.chunk_table.seq_lens)
        ops = {c.op for c in p.waits().rows()}
        assert CommOp.PP_RECV not in ops and CommOp.PP_SEND not in ops
        fused = [c for c in p.waits().rows() if c.op == CommOp.PP_SENDRECV]
        assert fused and all(c.includes_wait for c in fused)
        assert {c.peer for c in fused} <= set(decl.traced_ranks)
        if p.coords.pp > 0:  # the first chunk waits for its input: the bubble is in the fused timer
            first = fused[0]
            assert first.start_s == 0.0
            assert first.duration_s == pytest.approx(p.chunk_table.start_s[0])
            assert p.chunk_table.start_s[0] > 0
        assert [c.op for c in p.waits().rows() if c.op == CommOp.DP_ALLREDUCE] == [CommOp.DP_ALLREDUCE]


def test_profiler_traces_every_rank_with_blocking_p2p_and_labelled_collectives() -> None:
    events = _run(_config("profiler"), iterations=3)
    (decl,) = _payloads(events, TracingDeclared)
    assert decl.traced_ranks is None and not decl.seq_lens and not decl.tokens
    its = _payloads(events, RankIteration)
    assert sorted({p.rank for p in its}) == sorted(PLAN.devices)
    for p in its:
        assert p.node is None
        assert all(t is None for t in p.chunk_table.tokens) and all(s is None for s in p.chunk_table.seq_lens)
        p2p = [c for c in p.waits().rows() if c.op in (CommOp.PP_SEND, CommOp.PP_RECV)]
        assert p2p and all(c.includes_wait and c.group == "pp" and c.bytes for c in p2p)
        assert CommOp.PP_SENDRECV not in {c.op for c in p.waits().rows()}
        assert {c.group for c in p.waits().rows() if c.op == CommOp.TP_ALLREDUCE} == {"tp"}
        assert {c.group for c in p.waits().rows() if c.op == CommOp.DP_ALLREDUCE} == {"dp"}
        stage = PLAN.pipelines[p.coords.dp].stages[p.coords.pp]
        sends = [c for c in p2p if c.op == CommOp.PP_SEND]
        # a TP rank talks to the same TP rank of the neighbouring stage
        assert {c.peer for c in sends} <= {PLAN.pipelines[p.coords.dp].stages[s].devices[p.coords.tp]
                                           for s in range(len(PLAN.pipelines[0].stages))} - set(stage.devices)


def test_sampled_reports_only_declared_ranks_on_declared_steps() -> None:
    events = _run(_config("sampled"), iterations=7)
    (decl,) = _payloads(events, TracingDeclared)
    assert decl.step_every == 2 and decl.traced_ranks
    replica_devices = {r: {d for st in p.stages for d in st.devices} for r, p in enumerate(PLAN.pipelines)}
    assert set(decl.traced_ranks) == replica_devices[0]  # every second DP replica: replica 0 of 2
    its = _payloads(events, RankIteration)
    assert {p.rank for p in its} == set(decl.traced_ranks)
    assert sorted({p.iteration for p in its}) == [0, 2, 4, 6]
    assert all(decl.step_traced(p.iteration) for p in its)
    assert {h.rank for h in _payloads(events, Heartbeat)} <= set(decl.traced_ranks)
    assert all(p.chunk_table.seq_lens[0] for p in its)  # ours otherwise: lengths and tokens are there


def test_sampled_without_replicas_traces_a_seeded_quarter_of_the_tp_groups() -> None:
    plan = Plan.uniform(tp=2, pp=8, dp=1, num_layers=MODEL.layers, microbatches_per_replica=8)
    (decl,) = _payloads(_run(_config("sampled").model_copy(update={"plan": plan}), iterations=1), TracingDeclared)
    groups = [set(st.devices) for st in plan.pipelines[0].stages]
    picked = [g for g in groups if g <= set(decl.traced_ranks)]
    assert len(picked) == 2 and set().union(*picked) == set(decl.traced_ranks)


def test_a_reshape_declares_the_new_plans_traced_ranks() -> None:
    engine = SimEngine(_config("megatron"))
    engine.run(2)
    new = Plan.uniform(tp=1, pp=4, dp=2, num_layers=MODEL.layers, microbatches_per_replica=8)
    new = new.model_copy(update={"epoch": 1})
    events = engine.reconfigure(ReconfigureCommand(command_id="c1", plan_id="p1", plan=new))
    (decl,) = _payloads(events, TracingDeclared)
    assert decl.epoch == 1 and decl.traced_ranks == _tp0(new) == list(range(8))


def _fused_to(events: list, rank: int, peer: int) -> list[list[float]]:
    """Per iteration of ``rank``: its fused ops' durations with ``peer``, in order."""
    return [[c.duration_s for c in p.waits().rows() if c.op == CommOp.PP_SENDRECV and c.peer == peer]
            for p in _payloads(events, RankIteration) if p.rank == rank]


def test_a_slow_link_lengthens_the_fused_timers_transfer_part() -> None:
    """Noise off, fixed-size micro-batches. Stage 2's last fused op of an iteration only sends its
    last gradient to stage 1 (nothing is left to receive): it holds no wait, only the transfer the
    link model gives (bytes / bandwidth + latency). A ×4 link makes that transfer four times as
    long, and no fused op over the link gets shorter."""
    config = _config("megatron", noise=NOISE_OFF, workload=WORKLOAD_PRESETS["uniform"])
    a, b = PLAN.pipelines[0].stages[1].devices[0], PLAN.pipelines[0].stages[2].devices[0]
    healthy = _fused_to(_run(config, iterations=3), b, a)
    slow = _fused_to(_run(config, iterations=3, faults=[
        FaultSpec(kind="slow_link", link=(a, b), factor=4.0, at_iteration=0)]), b, a)
    coeffs = stage_coefficients(MODEL, CLUSTER, PLAN, [0])
    wire = coeffs.p2p_s_per_token[0, 1] * WORKLOAD_PRESETS["uniform"].tokens_per_microbatch + coeffs.p2p_latency_s[0, 1]
    assert len(healthy) == len(slow) == 3 and all(healthy)
    for h, s in zip(healthy, slow):
        assert h[-1] == pytest.approx(wire, rel=1e-6)
        assert s[-1] == pytest.approx(4 * wire, rel=1e-6)
        assert len(h) == len(s) and all(y >= x - 1e-12 for x, y in zip(h, s))
    # the timers holding waits grow too, but a slow link is also visible where nothing waits
    assert sum(map(sum, slow)) > sum(map(sum, healthy)) + 3 * 3 * wire


def test_profiler_tp_allreduce_of_an_interleaved_model_chunk_is_its_share_of_the_stages() -> None:
    # a stage's time is spread over its V model chunks, its TP all-reduces too: a record of the whole
    # stage's all-reduce time left each model chunk's own compute a sliver of the truth
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4,
                        schedule="interleaved", virtual_stages=2)
    events = _run(SimConfig(model=MODEL, cluster=CLUSTER, plan=plan, job="v", seed=3, dialect="profiler",
                            noise=NOISE_OFF), iterations=2)
    checked = 0
    for p in _payloads(events, RankIteration):
        t = p.chunk_table
        tp = {(w.microbatch, w.start_s): w.duration_s for w in p.waits().rows() if w.op is CommOp.TP_ALLREDUCE}
        for kind, mb, start, dur in zip(t.kind, t.microbatch, t.start_s, t.duration_s):
            if kind != "W" and (mb, start) in tp:
                assert tp[(mb, start)] < 0.5 * dur, (kind, mb, tp[(mb, start)], dur)
                checked += 1
    assert checked > 0
