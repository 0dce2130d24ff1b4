"""The engine never crashes on an incident: TP-group locations, unlocatable links, planner errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.embedded import EmbeddedBus
from collector.events import (
    Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, IncidentUpdated, IterationPrediction,
    Location, Severity,
)
from collector.plan import Plan
from remediation.cluster import ClusterState, Unlocatable, cluster_from_incidents
from remediation.engine import EngineConfig, RemediationEngine
from remediation.model import PlannerModel
from remediation.plan_result import PlanResult
from tests.fixtures.signing import Authors

JOB = "inc"
PLAN = Plan.uniform(tp=4, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)  # replica 1 stage 0: GPUs 8–11
GROUP = (8, 9, 10, 11)
T0 = 1_000.0


def _opened(incident_id: str, location: Location, category=FaultCategory.FAIL_SLOW, time_s: float = T0):
    return Authors(JOB, "analytics").make(IncidentOpened(
        incident_id=incident_id, category=category, severity=Severity.HIGH, iteration=10, locations=[location],
        evidence=Evidence(), summary="test"), time_s=time_s)


def _ticks(first: int, count: int, time_s: float) -> list:
    f = Authors(JOB, "analytics")
    return [f.make(IterationPrediction(epoch=0, iteration=first + i, observed_s=1.0, predicted_s=1.0, tokens=100),
                   time_s=time_s + i) for i in range(count)]


def _engine(bus: EmbeddedBus, **kw) -> RemediationEngine:
    return RemediationEngine(bus, EngineConfig(job=JOB, num_devices=32, localisation_wait_s=30.0, **kw),
                             PlannerModel.uniform(8), PLAN)


def test_a_tp_group_location_marks_every_member_and_an_empty_link_is_unlocatable() -> None:
    slow = ClusterState(32).with_location(Location(target="compute", tp_group=GROUP, factor=3.0))
    assert [slow.compute_factor(d) for d in GROUP] == [3.0] * 4 and slow.is_healthy(12)
    dead = ClusterState(32).with_location(Location(target="compute", tp_group=GROUP), "fail_stop")
    assert dead.dead_devices() == set(GROUP)
    with pytest.raises(Unlocatable, match="names neither its ends"):
        ClusterState(32).with_location(Location(target="link", factor=2.0))
    skipped: list = []
    cluster = cluster_from_incidents(32, [("fail_slow", [Location(target="link", factor=2.0),
                                                         Location(target="compute", rank=3, factor=2.0)])],
                                     skipped=skipped)
    assert cluster.compute_factor(3) == 2.0 and len(skipped) == 1 and "Location.link" in skipped[0][1]


def test_group_fail_slow_waits_for_the_rank_then_plans_around_only_that_member(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([_opened("i1", Location(target="compute", tp_group=GROUP, replica=1, stage=0, factor=3.0))])
        engine.poll_once()
        assert not engine.state.plans and "i1" in engine.waiting
        assert any("not the slow member" in r for r in engine.refusals)
        bus.publish([Authors(JOB, "analytics").make(IncidentConfirmed(
            incident_id="i1", method="probe", detail="rank 10 ×3",
            locations=[Location(target="compute", rank=10, factor=3.0)]), time_s=T0 + 2)])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert not record.plan_id.endswith("-g1") and not engine.waiting
        cluster = engine.cluster()
        assert cluster.compute_factor(10) == 3.0 and all(cluster.is_healthy(d) for d in (8, 9, 11))
        engine.close()


def test_group_fail_slow_is_planned_around_as_a_whole_after_the_wait(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([_opened("i1", Location(target="compute", tp_group=GROUP, factor=3.0))] + _ticks(11, 10, T0 + 1))
        engine.poll_once()
        assert not engine.state.plans  # 10 s of event time: still waiting
        bus.publish(_ticks(21, 5, T0 + 40))
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.plan_id.endswith("-g1") and record.proposal.current_tokens_per_s > 0
        assert record.proposal.predicted_tokens_per_s > record.proposal.current_tokens_per_s
        engine.close()


def _updated(incident_id: str, location: Location, time_s: float, probing: tuple[int, ...] = ()):
    return Authors(JOB, "analytics").make(IncidentUpdated(
        incident_id=incident_id, iteration=20, severity=Severity.HIGH, locations=[location], evidence=Evidence(),
        probing=list(probing)), time_s=time_s)


def test_a_re_probed_incident_holds_planning_until_the_answer_names_the_slow_peer(tmp_path: Path) -> None:
    """Rank 10 was named slow; it got worse, and the update says its TP group is being probed
    again. A plan then would keep peer 9, which the answer names slow too: the engine waits."""
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([_opened("i1", Location(target="compute", rank=10, factor=3.0)),
                     _updated("i1", Location(target="compute", rank=10, factor=4.0), T0 + 1, probing=GROUP)])
        engine.poll_once()
        assert not engine.state.plans and "re-asking TP group [8, 9, 10, 11]" in engine.waiting["i1"]
        assert any("re-asking" in r for r in engine.refusals)
        (withheld,) = engine.state.withheld  # published: the console shows why nothing is planned yet
        assert withheld.waiting and "re-asking" in withheld.reason
        bus.publish([_opened("i2", Location(target="compute", rank=9, factor=3.0), time_s=T0 + 3),
                     _updated("i1", Location(target="compute", rank=10, factor=2.0), T0 + 3)])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.proposal.incident_ids == ["i1", "i2"] and not engine.waiting
        cluster = engine.cluster()
        assert cluster.compute_factor(9) > 1.0 and cluster.compute_factor(10) > 1.0 and cluster.is_healthy(8)
        engine.close()


def test_a_re_probe_that_is_never_answered_holds_planning_only_for_the_wait(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([_opened("i1", Location(target="compute", rank=10, factor=3.0)),
                     _updated("i1", Location(target="compute", rank=10, factor=4.0), T0 + 1, probing=GROUP)]
                    + _ticks(11, 10, T0 + 2))
        engine.poll_once()
        assert not engine.state.plans
        bus.publish(_ticks(21, 5, T0 + 40))
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.proposal.incident_ids == ["i1"] and not engine.waiting
        assert record.proposal.predicted_tokens_per_s > record.proposal.current_tokens_per_s
        engine.close()


def test_unlocatable_link_is_reported_and_does_not_block_other_incidents(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([_opened("link", Location(target="link", factor=2.0))])
        engine.poll_once()
        assert not engine.state.plans and "names no device" in engine.waiting["link"]
        assert any("names no device" in r for r in engine.refusals)
        bus.publish([_opened("stop", Location(target="compute", rank=20), FaultCategory.FAIL_STOP, T0 + 5)])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert 20 not in record.proposal.plan.devices and "link" in engine.waiting
        engine.close()


class _Broken:
    name = "broken"

    def plan(self, cluster: ClusterState, current: Plan) -> PlanResult:
        raise RuntimeError("planner bug")


def test_a_planner_error_is_reported_and_the_engine_keeps_running(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=32), PlannerModel.uniform(8), PLAN,
                                   strategy=_Broken())
        bus.publish([_opened("i1", Location(target="compute", rank=3), FaultCategory.FAIL_STOP),
                     _opened("i2", Location(target="compute", rank=99), FaultCategory.FAIL_STOP)])
        assert engine.poll_once() == 2
        assert any("planner bug" in r for r in engine.refusals)
        assert any("outside the cluster" in r for r in engine.refusals)  # rank 99 of 32 devices: left out
        bus.publish(_ticks(11, 2, T0 + 1))
        assert engine.poll_once() == 4  # still polling: the two ticks, and its own two plan.withheld read back
        assert len(engine.state.withheld) == 2 and not any(w.waiting for w in engine.state.withheld)
        engine.close()


def test_a_probes_compute_size_is_planned_as_it_stands_and_a_chunk_size_as_the_compute_behind_it(
        tmp_path: Path) -> None:
    """``Location.measure``: telemetry measures a rank's chunks (compute and TP communication), so
    the engine turns its ×2 into the larger compute slowdown behind it; a probe of a rank nobody
    traces measured compute alone, and its ×2 is the GPU's compute factor as it stands."""
    from resihp.planning_models import exact_model
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
    from trainer.sim.workload import WORKLOAD_PRESETS

    plan = Plan.uniform(tp=8, pp=4, dp=2, num_layers=32, microbatches_per_replica=8)
    model = exact_model(MODEL_PRESETS["7b"], ClusterSpec(gpus=64), WORKLOAD_PRESETS["uniform"])
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=64), model, plan)
        bus.publish([_opened("telemetry", Location(target="compute", rank=3, factor=2.0)),
                     _opened("probe", Location(target="compute", rank=40, factor=2.0, measure="compute"))])
        engine.poll_once()
        cluster = engine.cluster()
        assert cluster.compute_factor(3) > 2.05 and cluster.compute_factor(40) == 2.0, (
            cluster.compute_factor(3), cluster.compute_factor(40))
        engine.close()
