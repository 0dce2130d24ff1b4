"""Replays of decisions: a signed approval acts only on the proposal it answers.

Real embedded bus, the real remediation engine. An operator's approval written in one run of a job,
republished byte for byte into a new run of the same job name, commands nothing there: the new
run's plan ids carry its incarnation, so the old decision names no plan of it. A decision that does
name a live plan id but another proposal (its event id) or another plan (its digest), or no
proposal at all (schema 1), is refused and published as ``control.rejected`` by the engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from collector import topics
from collector.bus import RawMessage
from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.events import (
    ControlRejected, Evidence, FaultCategory, IncidentOpened, Location, PlanCurrent, PlanDecision,
    ReconfigureCommand, Severity,
)
from collector.plan import Plan
from collector.plan_lifecycle import plan_digest
from remediation.engine import EngineConfig, RemediationEngine
from remediation.lifecycle import PlanStatus
from remediation.model import PlannerModel
from tests.fixtures.bus_log import control_log
from tests.fixtures.signing import Authors

JOB = "replayed-job"
PLAN = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)


def _proposed_run(bus: EmbeddedBus, run: str, rank: int = 5) -> RemediationEngine:
    """A run of JOB: the executor announces ``run``, analytics finds ``rank`` dead, the engine proposes."""
    bus.publish([Authors(JOB, "trainer").make(PlanCurrent(plan=PLAN, run=run))])
    bus.publish([Authors(JOB, "analytics").make(IncidentOpened(
        incident_id=f"{run}-dead", category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
        locations=[Location(target="compute", rank=rank)], evidence=Evidence(), summary=f"rank {rank} silent"))])
    engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), PLAN)
    engine.poll_once()
    return engine


def test_an_approval_from_another_run_of_the_job_commands_nothing_in_the_new_run(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "first.sqlite") as first:
        engine = _proposed_run(first, "run-one")
        (record,) = engine.state.plans.values()
        approval = Authors(JOB).make(record.decision(approve=True, actor="ui:alice"))
        first.publish([approval])
        engine.poll_once()
        engine.poll_once()
        assert [e.payload.plan_id for e in control_log(first) if isinstance(e.payload, ReconfigureCommand)] == [
            record.plan_id]  # in its own run the approval commands its plan
        engine.close()
    with EmbeddedBus(tmp_path / "second.sqlite") as second:
        engine = _proposed_run(second, "run-two")  # the same job name, the same fault, the same layout
        (fresh,) = engine.state.plans.values()
        assert fresh.plan_id != record.plan_id and fresh.proposal.plan == record.proposal.plan
        second.publish_raw([RawMessage(topics.CONTROL, f"{JOB}/ui:alice".encode(), encode(approval))])  # byte for byte
        engine.poll_once()
        engine.poll_once()
        assert engine.state.plans[fresh.plan_id].status == PlanStatus.PROPOSED
        assert not [e for e in control_log(second) if isinstance(e.payload, ReconfigureCommand)]
        assert any(r.event_id == approval.id and "unknown plan" in r.message for r in engine.state.reports)
        engine.close()


def test_a_decision_that_names_another_proposal_another_plan_or_none_is_refused_and_reported(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _proposed_run(bus, "run-one")
        (record,) = engine.state.plans.values()
        other_plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=8, epoch=1)
        console = Authors(JOB)
        bound = record.decision(approve=True, actor="ui:mallory")
        decisions = {
            "proposal": console.make(bound.model_copy(update={"proposal_id": uuid.uuid4().hex})),
            "digest": console.make(bound.model_copy(update={"plan_digest": plan_digest(other_plan)})),
            "unbound": console.make(PlanDecision(plan_id=record.plan_id, approve=True, actor="ui:mallory")),
        }
        bus.publish(list(decisions.values()))
        engine.poll_once()
        engine.poll_once()
        assert engine.state.plans[record.plan_id].status == PlanStatus.PROPOSED  # none of them decided it
        control = control_log(bus)
        assert not [e for e in control if isinstance(e.payload, ReconfigureCommand)]
        reasons = {e.payload.event_id: e.payload.reason for e in control
                   if isinstance(e.payload, ControlRejected) and e.payload.reader == "remediation"}
        assert "not the live one" in reasons[decisions["proposal"].id]
        assert "digest" in reasons[decisions["digest"].id]
        assert "names no proposal" in reasons[decisions["unbound"].id]

        # the bound decision still applies, once: the refusals left the proposal waiting for it
        bus.publish([console.make(record.decision(approve=True, actor="ui:alice"))])
        engine.poll_once()
        engine.poll_once()
        (command,) = [e.payload for e in control_log(bus) if isinstance(e.payload, ReconfigureCommand)]
        assert command.plan_id == record.plan_id and command.run == "run-one" and command.expires_at_s is not None
        engine.close()
