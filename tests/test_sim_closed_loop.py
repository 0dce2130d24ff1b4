"""The simulator in closed loop on the embedded bus: commands are fenced by epoch and acked,
probes are answered, and the engine can also be driven in-process without a bus."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import (
    AckStatus, CommandAck, Envelope, FaultInjected, Heartbeat, ProbeRequest, RankIteration, ReconfigureCommand,
)
from collector.plan import Plan
from collector.stream import EventStream
from trainer.sim.engine import SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import SimulatorRunner
from tests.fixtures.payloads import payload_as
from tests.fixtures.signing import Authors

MODEL = MODEL_PRESETS["tiny"]


def _engine(faults: list[FaultSpec] | None = None) -> SimEngine:
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4)
    cfg = SimConfig(model=MODEL, cluster=ClusterSpec(gpus=16), plan=plan, job="loop", reshape_pause_s=7.0,
                    rebalance_pause_s=0.5)
    return SimEngine(cfg, faults)


def _command(plan: Plan, command_id: str) -> ReconfigureCommand:
    return ReconfigureCommand(command_id=command_id, plan_id=f"plan-{command_id}", plan=plan)


def _order(author: Authors, engine: SimEngine, plan: Plan, command_id: str) -> Envelope:
    """A command as the engine issues it to this simulated run: its run, issued now on the simulated
    clock, expiring COMMAND_TTL_S later."""
    now_s = engine.config.start_time_s + engine.now_s
    return author.make(_command(plan, command_id).model_copy(
        update={"run": engine.run_id, "expires_at_s": now_s + COMMAND_TTL_S}), time_s=now_s)


def _control(bus: EmbeddedBus, group: str) -> list:
    with EventStream(bus, group, [topics.CONTROL]) as s:
        return [d.event for d in s.poll(timeout_s=0.5)]


def test_reconfigure_is_applied_acked_and_stale_or_duplicate_ones_ignored(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    engine = _engine()
    runner = SimulatorRunner(bus, engine)
    ui = Authors("loop", "remediation")
    try:
        runner.run(iterations=3)
        new_plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4,
                                epoch=1, first_device=8)  # move the job to the other node
        t_before = engine.now_s
        bus.publish([_order(ui, engine, new_plan, "c1")])
        runner.run(iterations=2)
        assert engine.plan.epoch == 1 and engine.plan.devices == list(range(8, 16))
        assert engine.now_s >= t_before + 7.0  # the reshape pause passed in simulated time
        bus.publish([_order(ui, engine, new_plan, "c1"),  # the same command again
                     _order(ui, engine, new_plan.model_copy(update={"epoch": 0}), "c0")])  # an old epoch
        runner.run(iterations=1)
        acks = [e.payload for e in _control(bus, "check") if e.kind == "command.ack"]
        assert [(a.command_id, a.status, a.running_epoch) for a in acks] == [
            ("c1", AckStatus.APPLIED, 1), ("c1", AckStatus.IGNORED_DUPLICATE, 1), ("c0", AckStatus.IGNORED_STALE, 1)]
        assert acks[0].pause_s == 7.0 and "stale" not in acks[0].detail
        assert "not newer" in acks[2].detail
        with EventStream(bus, "telemetry-check", [topics.TELEMETRY]) as s:
            late = [d.event.payload for d in s.poll(max_records=100_000, timeout_s=0.5)
                    if isinstance(d.event.payload, RankIteration)]
        assert {p.rank for p in late if p.epoch == 1} == set(range(8, 16))
    finally:
        runner.close()
        bus.close()


def test_a_plan_that_only_moves_micro_batches_pauses_the_rebalance_pause() -> None:
    # The torch trainer applies a micro-batch-only plan without re-forming its groups; the
    # simulator charges it rebalance_pause_s, and anything that changes a stage reshape_pause_s.
    engine = _engine()
    engine.step()
    shifted = engine.plan.model_copy(update={"epoch": 1, "pipelines": tuple(
        p.model_copy(update={"microbatches": m}) for p, m in zip(engine.plan.pipelines, [5, 3]))})
    before = engine.now_s
    engine.reconfigure(_command(shifted, "m"))
    assert engine.plan == shifted and engine.now_s - before == pytest.approx(0.5)
    moved = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4, epoch=2,
                         first_device=8)
    before = engine.now_s
    engine.reconfigure(_command(moved, "r"))
    assert engine.plan == moved and engine.now_s - before == pytest.approx(7.0)


def test_probe_answers_per_live_rank_with_the_slowdown(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    engine = _engine([FaultSpec(kind="slow_compute", device=5, factor=3.0, at_iteration=0),
                      FaultSpec(kind="stop_device", device=6, at_iteration=0)])
    runner = SimulatorRunner(bus, engine)
    try:
        bus.publish([Authors("loop", "analytics").make(ProbeRequest(probe_id="p1", ranks=[4, 5, 6]))])
        runner.step()
        results = {e.payload.rank: e.payload for e in _control(bus, "check") if e.kind == "probe.result"}
        assert set(results) == {4, 5}  # the dead rank does not answer
        ratio = results[5].duration_s / results[5].reference_s
        assert ratio == pytest.approx(3.0, rel=0.1)
        assert results[4].duration_s / results[4].reference_s == pytest.approx(1.0, rel=0.1)
    finally:
        runner.close()
        bus.close()


def test_engine_is_steppable_in_process_and_fences_without_a_bus() -> None:
    engine = _engine([FaultSpec(kind="stop_device", device=1, at_iteration=2)])
    engine.run(2)
    engine.step()
    assert engine.iteration == 2  # hung on the dead device
    bad = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4, epoch=1)
    ack = payload_as(engine.reconfigure(_command(bad, "uses-dead"))[0], CommandAck)
    assert ack.status == AckStatus.FAILED and "dead" in ack.detail and engine.plan.epoch == 0
    good = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4, epoch=1, first_device=8)
    assert payload_as(engine.reconfigure(_command(good, "ok"))[0], CommandAck).status == AckStatus.APPLIED
    skip = good.model_copy(update={"epoch": 3})
    skipped = payload_as(engine.reconfigure(_command(skip, "skip"))[0], CommandAck)
    assert skipped.status == AckStatus.IGNORED_STALE  # out of order: ignored, reported
    engine.run(2)
    assert engine.iteration == 4


def test_telemetry_of_replicas_with_different_stage_counts() -> None:
    """After a reshape replicas may differ in shape (a slow stage split in two): every rank still
    reports, with its own stage's gradient bytes."""
    from collector.plan import PipelinePlan, StagePlan

    base = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL.layers, microbatches_per_replica=4)
    split = PipelinePlan(replica=1, microbatches=4, stages=(
        StagePlan(devices=(4,), first_layer=0, end_layer=2), StagePlan(devices=(5,), first_layer=2, end_layer=4),
        StagePlan(devices=(6, 7), first_layer=4, end_layer=8)))
    plan = Plan.model_validate({**base.model_dump(), "pipelines": [base.pipelines[0].model_dump(), split.model_dump()]})
    engine = SimEngine(SimConfig(model=MODEL, cluster=ClusterSpec(gpus=8), plan=plan, job="shapes"))
    reports = [e.payload for e in engine.step() if isinstance(e.payload, RankIteration)]
    assert sorted(r.rank for r in reports) == list(range(8))
    dp = {r.rank: next(c.bytes for c in r.waits().rows() if c.op == "dp_allreduce") for r in reports}
    assert dp[4] == dp[5] == 2 * MODEL.params_per_layer * MODEL.bytes_per_value  # 2 layers, TP 1
    assert dp[6] == 4 * MODEL.params_per_layer // 2 * MODEL.bytes_per_value


def test_downtime_keeps_the_clock_the_faults_and_the_heartbeats_in_step() -> None:
    """A restart's downtime trains nothing, but a device that dies in the middle of it is stamped
    when it died, and its heartbeats stop there, not when training resumes."""
    engine = _engine([FaultSpec(kind="stop_device", device=3, at_s=45.0),
                      FaultSpec(kind="slow_compute", device=5, factor=2.0, at_s=20.0, duration_s=30.0)])
    engine.run(2)
    start, iteration = engine.now_s, engine.iteration
    events = engine.idle(100.0)
    assert engine.now_s == pytest.approx(start + 100.0) and engine.iteration == iteration
    assert not [e for e in events if e.kind in ("telemetry.iteration", "iteration.summary")]
    t0 = engine.config.start_time_s
    truth = [(e.payload.category.value, e.payload.end_iteration is None, e.time_s - t0)
             for e in events if isinstance(e.payload, FaultInjected)]
    assert truth == [("fail_slow", True, 20.0), ("fail_stop", True, 45.0), ("fail_slow", False, 50.0)]
    beats = [(e.payload.rank, e.time_s - t0) for e in events if isinstance(e.payload, Heartbeat)]
    assert {t for r, t in beats if r == 3} == {10.0, 20.0, 30.0, 40.0}
    assert {t for r, t in beats if r == 4} == {10.0 * k for k in range(1, 11)}
    with pytest.raises(ValueError, match="non-negative"):
        engine.idle(-1.0)
