"""The planner proposes only what the job's executor declared it can run, and says what it left out.

Unit tests of the rule (collector/capabilities.py) and of the options it cuts
(remediation/capability_fit.py), then the engine over the embedded bus: a job that declares the
native executor's capabilities gets a plan it can run (a TP exclusion on the dead GPU's stage,
its layers kept), with the reason the per-replica PP repartition the reference trainer could get
is not offered; a declaration not signed by the executor is refused.
"""

from __future__ import annotations

from pathlib import Path

from collector import topics
from collector.capabilities import capability_refusal
from collector.embedded import EmbeddedBus
from collector.events import (
    ControlRejected, Evidence, ExecutorCapabilities, EventFactory, FaultCategory, IncidentOpened, Location, Severity,
)
from collector.plan import Plan
from collector.stream import EventStream
from remediation.candidates import PlannerOptions
from remediation.capability_fit import fit_options
from remediation.cluster import ClusterState, DeviceState
from remediation.engine import EngineConfig, RemediationEngine
from remediation.model import PlannerModel
from remediation.planner import Planner
from tests.fixtures.signing import Authors
from trainer.native.capabilities import NATIVE_CAPABILITIES, refusal
from trainer.native.model import LlamaConfig

JOB = "caps"
PLAN = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
MODEL = PlannerModel.uniform(8)


def test_a_job_that_declares_nothing_is_planned_with_every_remediation():
    options = PlannerOptions()
    assert fit_options(options, None) == (options, [])
    assert capability_refusal(PLAN, PLAN, ExecutorCapabilities(executor="reference")) is None


def test_the_native_declaration_offers_tp_exclusion_leaves_per_replica_pp_out_and_says_why():
    options, notes = fit_options(PlannerOptions(), NATIVE_CAPABILITIES)
    assert (options.allow_tp, options.allow_pp, options.allow_dp, options.allow_drop) == (True, False, True, True)
    assert notes == [n for n in notes if n.startswith("PP repartition not offered: executor native moves layers only "
                                                      "alike in every replica")] and len(notes) == 1


GRID = ExecutorCapabilities(executor="grid", tp_shrink="uniform", tp_exclusion=False, pp_repartition="uniform",
                            notes={"tp_exclusion": "one DeviceMesh for the whole job"})


def test_a_dead_gpu_gets_a_tp_exclusion_unless_the_executor_cannot_run_one():
    cluster = ClusterState(16).with_device(5, DeviceState(dead=True))
    free = Planner(MODEL).plan(cluster, PLAN)
    assert 5 not in free.plan.devices
    why = capability_refusal(free.plan, PLAN, GRID)
    assert why is not None and "mixes TP degrees" in why and "TP exclusion" in why and "executor grid" in why

    options, _ = fit_options(PlannerOptions(), NATIVE_CAPABILITIES)
    native = Planner(MODEL, options).plan(cluster, PLAN)
    stage = PLAN.role_of(5)
    kept = native.plan.pipelines[stage.replica].stages[stage.stage]
    assert native.plan.dp == 4 and kept.devices == (4,)  # device 5's stage goes on at TP1 on its peer
    assert [(s.first_layer, s.end_layer) for p in native.plan.pipelines for s in p.stages] == [
        (s.first_layer, s.end_layer) for p in PLAN.pipelines for s in p.stages]  # no layer moved
    assert {s.tp for p in native.plan.pipelines for s in p.stages} == {1, 2}
    assert capability_refusal(native.plan, PLAN, NATIVE_CAPABILITIES) is None
    assert refusal(native.plan, LlamaConfig(n_layers=8), PLAN.epoch, PLAN) is None  # the executor runs it too

    options, _ = fit_options(PlannerOptions(), GRID)
    fitted = Planner(MODEL, options).plan(cluster, PLAN)
    assert 5 not in fitted.plan.devices and fitted.plan.dp == 3  # the replica holding device 5 is dropped
    assert fitted.plan.global_microbatches == PLAN.global_microbatches
    assert capability_refusal(fitted.plan, PLAN, GRID) is None


def test_a_slow_gpu_gets_micro_batches_moved_the_native_executor_can_run():
    cluster = ClusterState(16).with_device(9, DeviceState(compute_factor=3.0))
    options, _ = fit_options(PlannerOptions(), NATIVE_CAPABILITIES)
    r = Planner(MODEL, options).plan(cluster, PLAN)
    assert r.changed and r.plan.same_stages(PLAN.model_copy(update={"epoch": r.plan.epoch}))
    slow_replica = PLAN.role_of(9).replica
    assert [p.microbatches < 4 for p in r.plan.pipelines] == [p.replica == slow_replica for p in r.plan.pipelines]
    assert r.plan.global_microbatches == PLAN.global_microbatches
    assert capability_refusal(r.plan, PLAN, NATIVE_CAPABILITIES) is None


def test_each_rule_names_the_remediation_and_the_executor():
    rigid = ExecutorCapabilities(executor="rigid", tp_shrink="no", pp_repartition="no", dp_drop=False,
                                 dp_microbatch_migration=False, schedules=["1f1b"], notes={"dp_drop": "fixed world"})
    tp1 = Plan.uniform(tp=1, pp=2, dp=4, num_layers=8, microbatches_per_replica=4, epoch=1)
    assert "changes TP degrees [2] → [1]" in (capability_refusal(tp1, PLAN, rigid) or "")
    moved = _resplit(PLAN, 3)
    assert capability_refusal(moved, PLAN, rigid) == (
        "plan epoch 1 moves layers: PP repartition — executor rigid cannot run it")
    assert capability_refusal(moved, PLAN, NATIVE_CAPABILITIES) is None  # alike in every replica
    uneven = moved.model_copy(update={"pipelines": (PLAN.pipelines[0], *moved.pipelines[1:])})
    assert "different layer ranges" in (capability_refusal(uneven, PLAN, NATIVE_CAPABILITIES) or "")
    fewer = Plan.uniform(tp=2, pp=2, dp=3, num_layers=8, microbatches_per_replica=4, epoch=1)
    assert capability_refusal(fewer, PLAN, rigid) == (
        "plan epoch 1 drops 1 replica(s): executor rigid cannot run it (fixed world)")
    zb = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4, epoch=1, schedule="zero_bubble")
    assert "runs only 1f1b" in (capability_refusal(zb, PLAN, rigid) or "")


def _resplit(plan: Plan, cut: int) -> Plan:
    """``plan`` at the next epoch with every replica's two stages split at layer ``cut``."""
    data = plan.model_dump()
    data["epoch"] = plan.epoch + 1
    for pipe in data["pipelines"]:
        pipe["stages"][0]["end_layer"] = pipe["stages"][1]["first_layer"] = cut
    return Plan.model_validate(data)


def _incident() -> IncidentOpened:
    return IncidentOpened(incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
                          locations=[Location(target="compute", rank=5)], evidence=Evidence(), summary="rank 5 silent")


def test_the_engine_plans_within_the_declared_capabilities_over_the_embedded_bus(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), MODEL, PLAN)
        bus.publish([Authors(JOB, "launcher").make(NATIVE_CAPABILITIES),
                     Authors(JOB, "analytics").make(_incident())])
        engine.poll_once()
        assert engine.state.capabilities == NATIVE_CAPABILITIES
        (record,) = engine.state.plans.values()
        proposal = record.proposal
        assert 5 not in proposal.plan.devices and capability_refusal(proposal.plan, PLAN, NATIVE_CAPABILITIES) is None
        assert any(n.startswith("PP repartition not offered: executor native") for n in proposal.not_offered)
        engine.close()


def test_a_declaration_not_signed_by_the_executor_changes_nothing(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), MODEL, PLAN)
        bus.publish([EventFactory(JOB, "rank-3").make(NATIVE_CAPABILITIES), Authors(JOB, "analytics").make(_incident())])
        engine.poll_once()
        assert engine.state.capabilities is None
        (record,) = engine.state.plans.values()
        assert record.proposal.not_offered == []  # planned as for a job that declared nothing
        stream = EventStream(bus, "reader", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
        rejected = [d.event.payload for d in stream.poll(timeout_s=0.2) if isinstance(d.event.payload, ControlRejected)]
        stream.close()
        assert any("unsigned plan.capabilities" in r.reason for r in rejected), rejected
        engine.close()
