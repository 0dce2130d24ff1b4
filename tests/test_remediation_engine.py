"""The engine over the embedded bus, with `resihp plans` acting from a terminal."""

from __future__ import annotations

from pathlib import Path

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import (
    AckStatus, CommandAck, Evidence, FaultCategory, IncidentOpened, IterationPrediction, Location,
    PolicyChanged, PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import Plan
from collector.stream import EventStream
from remediation.engine import EngineConfig, RemediationEngine
from remediation.lifecycle import PlanStatus
from remediation.model import PlannerModel
from resihp.cli import main
from tests.fixtures.signing import Authors

JOB = "itest"


def _commands(bus: EmbeddedBus) -> list:
    stream = EventStream(bus, "reader", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
    out = [d.event for d in stream.poll(timeout_s=0.2) if isinstance(d.event.payload, ReconfigureCommand)]
    stream.close()
    return out


def test_incident_to_verified_plan_over_the_embedded_bus(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bus.sqlite"
    flags = ["--bus", "embedded", "--bus-path", str(path), "--job", JOB]
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    model = PlannerModel.uniform(8)
    with EmbeddedBus(path) as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), model, plan)
        detector = Authors(JOB, "analytics")
        bus.publish([detector.make(IncidentOpened(
            incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
            locations=[Location(target="compute", rank=5)], evidence=Evidence(), summary="rank 5 silent"))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.status == PlanStatus.PROPOSED and 5 not in record.proposal.plan.devices
        assert record.proposal.plan.global_microbatches == plan.global_microbatches

        assert main(["plans", "list", *flags, "-v"]) == 0
        listing = capsys.readouterr().out
        assert record.plan_id in listing and "proposed" in listing

        assert main(["plans", "approve", record.plan_id, *flags, "--as", "cli:alice"]) == 0
        assert main(["plans", "reject", record.plan_id, *flags]) == 1  # a decision applies once
        engine.poll_once()
        engine.poll_once()
        (cmd,) = _commands(bus)
        assert cmd.payload.plan.epoch == 1 and engine.state.plans[record.plan_id].decided_by == "cli:alice"

        trainer = Authors(JOB, "trainer")
        bus.publish([trainer.make(CommandAck(command_id=cmd.payload.command_id, plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1))])
        engine.poll_once()
        assert engine.state.running_epoch == 1
        tps = record.proposal.predicted_tokens_per_s
        bus.publish([detector.make(IterationPrediction(epoch=1, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                       tokens=int(tps))) for i in range(20, 27)])
        engine.poll_once()
        engine.poll_once()
        assert engine.state.plans[record.plan_id].status == PlanStatus.VERIFIED
        # The same incident does not produce a second plan once the layout avoids the dead rank.
        assert len(engine.state.plans) == 1
        engine.close()
        assert len(_commands(bus)) == 1


def test_a_restarted_engine_judges_a_resumed_job_by_the_fraction_its_proposal_carries(tmp_path: Path) -> None:
    """A plan that resumes a job hung on a dead rank is judged against what ran before the fail-stop.
    The predicted fraction travels in the proposal, so an engine restarted after the command still
    sees that the job came back far short of it (and says so; the hung layout cannot be rolled back to)."""
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    config = EngineConfig(job=JOB, num_devices=16)
    analytics = Authors(JOB, "analytics")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish([analytics.make(IterationPrediction(epoch=0, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                        tokens=1_000)) for i in range(5)])
        bus.publish([Authors(JOB, "operator").make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="cli:test")),
            analytics.make(IncidentOpened(
                incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
                locations=[Location(target="compute", rank=5)], evidence=Evidence(), summary="rank 5 silent"))])
        engine = RemediationEngine(bus, config, PlannerModel.uniform(8), plan)
        engine.poll_once()
        (record,) = engine.state.plans.values()
        fraction = record.proposal.fraction_of_before
        assert record.proposal.current_tokens_per_s == 0 and fraction is not None and 0.5 < fraction < 1
        (cmd,) = _commands(bus)
        engine.close()
        bus.publish([Authors(JOB, "trainer").make(CommandAck(
            command_id=cmd.payload.command_id, plan_id=record.plan_id, epoch=1, status=AckStatus.APPLIED,
            running_epoch=1))])
        bus.publish([analytics.make(IterationPrediction(epoch=1, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                        tokens=300)) for i in range(20, 27)])  # 0.3 of before
        again = RemediationEngine(bus, config, PlannerModel.uniform(8), plan)
        again.poll_once()
        again.poll_once()
        assert again.state.plans[record.plan_id].status == PlanStatus.VERIFIED  # kept: nothing to roll back to
        (short,) = [r for r in again.refusals if "fell short" in r]
        assert f"measured 0.300 of the 1,000 tokens/s before the fail-stop against the predicted {fraction:.3f}" in short
        again.close()


def test_under_the_auto_policy_one_poll_takes_an_incident_to_a_command(tmp_path: Path) -> None:
    """Proposal, decision and command come out of the same poll: a trainer hung on a dead rank
    waits for the command, and one poll apart each (the loop's pace while hung) cost it seconds."""
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        bus.publish([Authors(JOB, "operator").make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="cli:test")),
            Authors(JOB, "analytics").make(IncidentOpened(
                incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
                locations=[Location(target="compute", rank=5)], evidence=Evidence(), summary="rank 5 silent"))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.status == PlanStatus.COMMANDED and record.decided_by == "policy:auto"
        (cmd,) = _commands(bus)
        assert cmd.payload.plan_id == record.plan_id and 5 not in cmd.payload.plan.devices
        engine.poll_once()  # reading its own output back changes nothing
        assert len(_commands(bus)) == 1 and len(engine.state.plans) == 1
        engine.close()


def test_what_cannot_be_planned_is_published_as_withheld_and_listed(tmp_path: Path, capsys) -> None:
    """Every device dead: the planner refuses, and the reason reaches the log (plan.withheld), the
    fold and `resihp plans list`, not only the engine's own log; a restarted engine adds nothing."""
    path = tmp_path / "bus.sqlite"
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    incident = Authors(JOB, "analytics").make(IncidentOpened(
        incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.CRITICAL, iteration=5,
        locations=[Location(target="compute", rank=r) for r in range(16)], evidence=Evidence(), summary="all dead"))
    with EmbeddedBus(path) as bus:
        bus.publish([incident])
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        engine.poll_once()
        assert not engine.state.plans
        (withheld,) = engine.state.withheld
        assert not withheld.waiting and withheld.incident_ids == ["i1"] and withheld.reason.startswith("plan refused")
        engine.close()
        again = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        again.poll_once()
        again.poll_once()
        assert len(again.state.withheld) == 1  # the replay re-derived the same event id
        again.close()
    assert main(["plans", "list", "--bus", "embedded", "--bus-path", str(path), "--job", JOB]) == 0
    out = capsys.readouterr().out
    assert "not planned at epoch 0" in out and f"withheld: {withheld.reason}" in out


def test_engine_plans_from_plan_current_and_published_cost_fits(tmp_path: Path) -> None:
    """No --plan, no --model: the trainer's plan.current and analytics' cost fits are enough."""
    from resihp.planning_models import warmup_fits
    from collector.events import CostModelFitted
    from trainer.sim.engine import SimConfig
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    plan = Plan.uniform(tp=4, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
    config = SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=16), plan=plan, telemetry="none")
    fits, current, _, _, _ = warmup_fits(config, iterations=6)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB))
        engine.poll_once()
        assert engine.state.running_plan is None and not engine.state.plans
        bus.publish([Authors(JOB, "trainer").make(current),
                     Authors(JOB, "analytics").make(CostModelFitted(epoch=0, iteration=6, fits=fits)),
                     Authors(JOB, "analytics").make(IncidentOpened(
                         incident_id="i1", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=7,
                         locations=[Location(target="compute", rank=5)], evidence=Evidence(), summary="rank 5 silent"))])
        engine.poll_once()
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.proposal.base_epoch == 0 and 5 not in record.proposal.plan.devices
        assert engine.model is not None and engine.model.tp_bytes_per_token > 0  # built from the fits
        engine.close()


def test_a_group_level_fail_slow_waits_for_its_member_and_reactions_carry_event_time(tmp_path: Path) -> None:
    """Nothing is planned while the only incident names a TP group but not the member (a plan then
    would answer no incident); once an update names the rank, the proposal follows, stamped with
    the time of what caused it — on the job's clock, which here is far from the wall's."""
    from collector.events import IncidentUpdated

    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    t0 = 1_000.0
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        analytics = Authors(JOB, "analytics")
        group = Location(target="compute", tp_group=(4, 5), replica=1, stage=0, factor=3.0)
        bus.publish([analytics.make(IncidentOpened(
            incident_id="i1", category=FaultCategory.FAIL_SLOW, severity=Severity.CRITICAL, iteration=5,
            locations=[group], evidence=Evidence(), summary="TP group [4, 5] ×3"), time_s=t0)])
        engine.poll_once()
        assert not engine.state.plans and "i1" in engine.waiting
        named = group.model_copy(update={"rank": 5})
        bus.publish([analytics.make(IncidentUpdated(incident_id="i1", iteration=6, severity=Severity.CRITICAL,
                                                    locations=[named], evidence=Evidence()), time_s=t0 + 2)])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.proposed_at_s == t0 + 2
        engine.close()


def test_a_dead_device_stays_out_of_plans_after_its_incident_resolves_and_a_failed_layout_is_not_retried(
        tmp_path: Path) -> None:
    """The detector resolves a fail-stop once a plan leaves the rank out; the device is still dead,
    so the next plan (for another fault) must not re-grow onto it. When the trainer cannot apply a
    plan (ack failed), the engine plans again, but never proposes that same layout again."""
    from collector.events import IncidentResolved

    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")

        def stop(incident_id: str, rank: int) -> None:
            bus.publish([analytics.make(IncidentOpened(
                incident_id=incident_id, category=FaultCategory.FAIL_STOP, severity=Severity.CRITICAL, iteration=5,
                locations=[Location(target="compute", rank=rank)], evidence=Evidence(), summary=f"rank {rank} silent"))])

        def apply(record, status=AckStatus.APPLIED) -> None:
            bus.publish([Authors(JOB, "console").make(record.decision(approve=True, actor="ui:op"))])
            engine.poll_once()
            engine.poll_once()
            cmd = next(c for c in _commands(bus) if c.payload.plan_id == record.plan_id)
            epoch = cmd.payload.plan.epoch
            bus.publish([trainer.make(CommandAck(command_id=cmd.payload.command_id, plan_id=record.plan_id,
                                                 epoch=epoch, status=status,
                                                 running_epoch=epoch if status == AckStatus.APPLIED else epoch - 1))])
            engine.poll_once()

        stop("s5", 5)
        engine.poll_once()
        (first,) = engine.state.plans.values()
        apply(first)
        bus.publish([analytics.make(IncidentResolved(incident_id="s5", iteration=9,
                                                     reason="the new plan no longer uses this location"))])
        stop("s12", 12)
        engine.poll_once()
        second = [r for r in engine.state.plans.values() if r.plan_id != first.plan_id]
        assert len(second) == 1 and not {5, 12} & set(second[0].proposal.plan.devices)
        apply(second[0], status=AckStatus.FAILED)
        engine.poll_once()
        assert len(engine.state.plans) == 2  # the same layout again would fail again: reported, not proposed
        assert any(second[0].plan_id in r and "failed to apply" in r for r in engine.refusals), engine.refusals
        stop("s13", 13)  # something changed: plan again, around every dead device
        engine.poll_once()
        third = [r for r in engine.state.plans.values() if r.plan_id not in (first.plan_id, second[0].plan_id)]
        assert len(third) == 1 and not {5, 12, 13} & set(third[0].proposal.plan.devices)
        engine.close()


def test_the_spread_is_fitted_on_the_iterations_before_the_incident_on_a_healthy_cluster(tmp_path: Path) -> None:
    """The engine builds its figures when it first has to plan, which is when an incident is
    open. The replicas' spread must come from the iterations observed before it (on the plan as
    it ran, healthy), not be dropped because an incident is open, nor fitted on the slow
    iterations after the fault, which would pass the fault's cost off as spread."""
    import numpy as np
    import pytest

    from collector.events import CostModelFitted
    from remediation.cluster import ClusterState
    from remediation.cost_figures import calibrate_spread, model_from_fits
    from remediation.costs import median_slowest_s
    from remediation.throughput import plan_spans
    from resihp.planning_models import warmup_fits
    from trainer.sim.engine import SimConfig
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    plan = Plan.uniform(tp=4, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
    config = SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=16), plan=plan, telemetry="none")
    fits, current, _, _, _ = warmup_fits(config, iterations=6)
    engine_config = EngineConfig(job=JOB)
    tokens = 4096 * plan.global_microbatches
    base = model_from_fits(fits, current, engine_config.hardware, tokens_per_microbatch=tokens / plan.global_microbatches)
    healthy_cluster = ClusterState(16, engine_config.hardware)
    timed = plan_spans(healthy_cluster, base, plan)
    assert timed is not None
    spans, dp_s = timed
    typical_s = median_slowest_s(spans.items(), 0.0) + dp_s
    healthy = typical_s * (1.06 + 0.03 * np.random.default_rng(0).standard_normal(150))
    analytics = Authors(JOB, "analytics")

    def predictions(times, first):
        return [analytics.make(IterationPrediction(epoch=0, iteration=first + i, observed_s=float(t),
                                                   predicted_s=typical_s, tokens=tokens)) for i, t in enumerate(times)]

    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, engine_config)
        bus.publish([Authors(JOB, "trainer").make(current),
                     analytics.make(CostModelFitted(epoch=0, iteration=6, fits=fits))])
        engine.poll_once()
        # the slow iterations may be read before the incident that their slowness caused
        bus.publish([*predictions(healthy, 10), *predictions(1.5 * healthy[:20], 160),
                     analytics.make(IncidentOpened(
                         incident_id="i1", category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=160,
                         locations=[Location(target="compute", rank=5, replica=0, stage=1, factor=1.5)],
                         evidence=Evidence(), summary="rank 5 ×1.5")),
                     *predictions(1.5 * healthy[20:60], 180)])
        engine.poll_once()
        engine.poll_once()
        assert engine.model is not None and engine.model.makespan_cv > 0
        expected = calibrate_spread(engine.model, plan, healthy_cluster, healthy.tolist())
        assert engine.model.makespan_cv == pytest.approx(expected.makespan_cv)
        assert engine.model.tail_s == pytest.approx(expected.tail_s)
        engine.close()


def test_a_reshape_declined_over_a_bursts_pace_is_proposed_once_the_calm_doubles_the_horizon(tmp_path: Path) -> None:
    """A fault comes and goes a minute apart, then a slow GPU a minute later: the next change looks
    a minute away, and the rebalance (8 % faster, a 20-s pause) does not pay in a minute. Twenty
    calm minutes later it does, and the engine proposes it without a new incident."""
    from collector.events import IncidentResolved
    from remediation.candidates import PlannerOptions

    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    t0 = 1_000.0
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        options = PlannerOptions(pause_s=20.0, rebalance_pause_s=20.0)
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16, options=options), PlannerModel.uniform(8),
                                   plan)
        analytics = Authors(JOB, "analytics")

        def slow(incident_id: str, rank: int, factor: float, t: float) -> None:
            bus.publish([analytics.make(IncidentOpened(
                incident_id=incident_id, category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=5,
                locations=[Location(target="compute", rank=rank, factor=factor)], evidence=Evidence(),
                summary=f"rank {rank} ×{factor}"), time_s=t)])

        slow("blip", 12, 1.01, t0 - 120)
        bus.publish([analytics.make(IncidentResolved(incident_id="blip", iteration=6, reason="recovered"),
                                    time_s=t0 - 60)])
        slow("i1", 5, 1.5, t0)
        engine.poll_once()
        assert engine.horizon.horizon_s(t0) == 60.0 and not engine.state.plans

        def calm(t: float) -> None:
            bus.publish([analytics.make(IterationPrediction(epoch=0, iteration=10, observed_s=1.0, predicted_s=1.0,
                                                            tokens=1), time_s=t)])
            engine.poll_once()

        calm(t0 + 50)  # 110 s: the same doubling of the horizon, nothing to look at again
        assert not engine.state.plans
        calm(t0 + 1_200)
        assert engine.horizon.horizon_s(t0 + 1_200) == 660.0
        (record,) = engine.state.plans.values()
        assert record.proposal.incident_ids == ["i1"] and record.proposed_at_s == t0 + 1_200
        engine.close()


def test_a_layout_rolled_back_for_the_same_incidents_is_not_proposed_again_when_the_horizon_grows(
        tmp_path: Path) -> None:
    """A plan for a ×3 GPU is applied and rolled back. Twenty calm minutes later the horizon has
    grown, the engine plans again and finds the same layout: it says so and proposes nothing (a
    re-plan on the horizon alone would apply and roll back the same plan again and again)."""
    from collector.events import IncidentResolved

    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)
    t0 = 1_000.0
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), plan)
        analytics, ui, trainer = (Authors(JOB, s) for s in ("analytics", "ui", "trainer"))

        def opened(incident_id: str, rank: int, factor: float, t: float) -> None:
            bus.publish([analytics.make(IncidentOpened(
                incident_id=incident_id, category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=5,
                locations=[Location(target="compute", rank=rank, factor=factor)], evidence=Evidence(),
                summary=f"rank {rank} ×{factor}"), time_s=t)])

        def applied(plan_id: str, epoch: int, t: float) -> None:
            bus.publish([ui.make(engine.state.plans[plan_id].decision(approve=True, actor="ui:alice"), time_s=t)])
            engine.poll_once()
            bus.publish([trainer.make(CommandAck(command_id=f"cmd-{plan_id}", plan_id=plan_id, epoch=epoch,
                                                 status=AckStatus.APPLIED, running_epoch=epoch), time_s=t)])
            engine.poll_once()

        def iterations(epoch: int, first_iteration: int, t: float) -> None:  # 100 tokens/s, no better
            bus.publish([analytics.make(IterationPrediction(epoch=epoch, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                            tokens=100), time_s=t + k)
                         for k, i in enumerate(range(first_iteration, first_iteration + 6))])
            engine.poll_once()

        opened("blip", 12, 1.01, t0 - 120)  # a burst: the next change looks a minute away
        bus.publish([analytics.make(IncidentResolved(incident_id="blip", iteration=6, reason="recovered"),
                                    time_s=t0 - 60)])
        iterations(0, 5, t0 - 6)
        opened("i1", 5, 3.0, t0)
        engine.poll_once()
        (first,) = engine.state.plans.values()
        applied(first.plan_id, 1, t0 + 1)
        iterations(1, 12, t0 + 2)  # the plan gained nothing of what it promised: rolled back
        assert engine.state.plans[first.plan_id].status == PlanStatus.ROLLED_BACK
        rollback = engine.state.plans[f"{first.plan_id}-rollback"]
        applied(rollback.plan_id, 2, t0 + 31)
        iterations(2, 20, t0 + 32)  # the roll-back did what it promised (the old rate)
        assert engine.state.plans[rollback.plan_id].status == PlanStatus.VERIFIED
        band = engine.horizon.band(t0 + 40)

        iterations(2, 40, t0 + 1_200)  # twenty calm minutes

        assert engine.horizon.band(t0 + 1_200) > band  # the engine did look again
        assert sorted(engine.state.plans) == sorted([first.plan_id, rollback.plan_id])
        assert any(f"the best plan is {first.plan_id}'s layout, rolled back for these incidents" in r
                   for r in engine.refusals), engine.refusals
        engine.close()
