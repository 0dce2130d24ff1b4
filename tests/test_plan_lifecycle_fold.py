"""collector/plan_lifecycle.py: the one fold of the plan lifecycle, and its readers agreeing on it."""

from __future__ import annotations

import pytest

from collector.events import (
    AckStatus, CommandAck, PlanCurrent, PlanDecision, PlanProposed, PlanRolledBack, PlanVerified,
    PolicyChanged, PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import Plan
from collector.plan_lifecycle import plan_digest
from collector.plan_lifecycle import PlanLifecycle, PlanStatus, claimed_status, fold, step
from tests.fixtures.signing import Authors

JOB = "job"
F = Authors(JOB, "test")
PLAN0 = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
PLAN1 = Plan.uniform(tp=2, pp=2, dp=1, num_layers=8, microbatches_per_replica=8, epoch=1)
PLAN2 = Plan.uniform(tp=1, pp=2, dp=1, num_layers=8, microbatches_per_replica=8, epoch=2)


def proposed(plan_id="p1", base=0, plan=PLAN1):
    return F.make(PlanProposed(plan_id=plan_id, incident_ids=["i1"], strategy="ours", base_epoch=base, plan=plan,
                               current_tokens_per_s=50.0, predicted_tokens_per_s=100.0, reshape_cost_s=3.0,
                               diff=["replica 1: dropped"], severity=Severity.HIGH), time_s=1.0,
                  event_id=f"proposal-{plan_id}")


def decision(plan_id="p1", approve=True, actor="ui:alice", plan=PLAN1):
    """A decision bound to ``proposed(plan_id, plan=plan)``."""
    return F.make(PlanDecision(plan_id=plan_id, approve=approve, actor=actor, proposal_id=f"proposal-{plan_id}",
                               plan_digest=plan_digest(plan)), time_s=2.0)


def command(plan_id="p1", plan=PLAN1):
    return F.make(ReconfigureCommand(command_id=f"cmd-{plan_id}", plan_id=plan_id, plan=plan), time_s=3.0)


def ack(plan_id="p1", status=AckStatus.APPLIED, epoch=1, running=1):
    return F.make(CommandAck(command_id=f"cmd-{plan_id}", plan_id=plan_id, epoch=epoch, status=status,
                             running_epoch=running, pause_s=2.5), time_s=4.0)


def started() -> PlanLifecycle:
    return fold([F.make(PlanCurrent(plan=PLAN0), time_s=0.0)], PlanLifecycle(job=JOB))


def test_each_transition_moves_the_plan_one_state_and_stamps_its_time() -> None:
    s = started()
    seen = []
    for event in (proposed(), decision(), command(), ack()):
        changed = step(s, event)
        assert changed is s.plans["p1"]
        seen.append(changed.status)
    assert seen == [PlanStatus.PROPOSED, PlanStatus.APPROVED, PlanStatus.COMMANDED, PlanStatus.APPLIED]
    record = s.plans["p1"]
    assert (record.proposed_at_s, record.decided_at_s, record.applied_at_s) == (1.0, 2.0, 4.0)
    assert record.decided_by == "ui:alice" and record.ack is not None and record.ack.pause_s == 2.5
    assert s.running_epoch == 1 and s.running_plan == PLAN1 and s.layouts[1] == PLAN1 and not s.reports
    step(s, F.make(PlanVerified(plan_id="p1", measured_tokens_per_s=99.0, predicted_tokens_per_s=100.0)))
    assert record.status == PlanStatus.VERIFIED and record.measured_tokens_per_s == 99.0


def test_a_roll_back_closes_an_applied_plan_with_its_reason() -> None:
    s = fold([proposed(), decision(), command(), ack()], started())
    step(s, F.make(PlanRolledBack(plan_id="p1", measured_tokens_per_s=40.0, predicted_tokens_per_s=100.0,
                                  reason="below the predicted change")))
    assert s.plans["p1"].status == PlanStatus.ROLLED_BACK and s.plans["p1"].verdict == "below the predicted change"


def test_a_rejection_is_final_and_a_command_for_it_is_reported() -> None:
    s = fold([proposed(), decision(approve=False, actor="ui:bob"), command()], started())
    assert s.plans["p1"].status == PlanStatus.REJECTED and s.commands == {}
    assert "not approved" in s.reports[-1].message


def test_a_second_decision_applies_never_and_is_reported_with_the_first_actor() -> None:
    s = fold([proposed(), decision(), decision(approve=False, actor="ui:bob")], started())
    assert s.plans["p1"].status == PlanStatus.APPROVED and s.plans["p1"].decided_by == "ui:alice"
    assert "already approved by ui:alice" in s.reports[-1].message


def test_a_duplicate_event_id_is_folded_once() -> None:
    s = started()
    events = [proposed(), decision(), command(), ack()]
    for e in events + events:
        step(s, e)
    assert s.plans["p1"].status == PlanStatus.APPLIED and not s.reports
    assert step(s, events[1]) is None


def test_a_stale_command_is_refused_by_its_epoch() -> None:
    s = fold([proposed(), decision(), command(plan=PLAN2)], started())  # epoch 2 on top of epoch 0
    assert s.plans["p1"].status == PlanStatus.APPROVED and "stale command" in s.reports[-1].message


def test_an_ack_before_its_command_is_reported_and_the_late_command_still_lands() -> None:
    s = fold([proposed(), decision()], started())
    assert step(s, ack()) is None and "ack for unknown command" in s.reports[-1].message
    assert s.running_epoch == 0
    step(s, command())
    assert s.plans["p1"].status == PlanStatus.COMMANDED


def test_a_second_applied_ack_and_an_ignored_ack_change_nothing() -> None:
    s = fold([proposed(), decision(), command(), ack()], started())
    assert step(s, ack()) is None and "second 'applied' ack" in s.reports[-1].message
    assert step(s, ack(status=AckStatus.IGNORED_DUPLICATE)) is None
    assert s.plans["p1"].status == PlanStatus.APPLIED


def test_a_stale_ack_for_another_running_epoch_fails_the_plan() -> None:
    s = fold([proposed(), decision(), command(), ack(status=AckStatus.IGNORED_STALE, running=3)], started())
    assert s.plans["p1"].status == PlanStatus.FAILED and "trainer runs epoch 3" in s.plans["p1"].verdict


def test_a_plan_commanded_for_the_epoch_another_plan_took_fails_as_stale() -> None:
    """A roll-back and a new plan both decided at epoch 0, both commanded as epoch 1: the trainer
    applies the first and ignores the second as stale. The second can never apply; it must fail,
    not stay commanded (the engine plans again only once nothing is in flight)."""
    s = fold([proposed("p1"), decision("p1"), proposed("p2"), command("p1"), decision("p2"), command("p2"),
              ack("p1"), ack("p2", status=AckStatus.IGNORED_STALE, epoch=1, running=1)], started())
    assert s.plans["p1"].status == PlanStatus.APPLIED and s.running_epoch == 1
    assert s.plans["p2"].status == PlanStatus.FAILED and "command was stale" in s.plans["p2"].verdict


def test_a_verification_of_a_plan_not_applied_is_reported() -> None:
    s = fold([proposed(), F.make(PlanVerified(plan_id="p1", measured_tokens_per_s=1.0, predicted_tokens_per_s=1.0))],
             started())
    assert s.plans["p1"].status == PlanStatus.PROPOSED and "not applied" in s.reports[-1].message


def test_a_newer_proposal_and_a_new_epoch_supersede_waiting_plans() -> None:
    s = fold([proposed("p1"), proposed("p2")], started())
    assert s.plans["p1"].status == PlanStatus.SUPERSEDED and s.plans["p1"].verdict == "superseded by p2"
    step(s, F.make(PlanCurrent(plan=PLAN1)))  # the trainer restarted on epoch 1 by itself
    assert s.plans["p2"].status == PlanStatus.SUPERSEDED and s.running_epoch == 1
    late = step(s, proposed("p3", base=0))
    assert late is not None and late.status == PlanStatus.SUPERSEDED and "superseded on arrival" in s.reports[-1].message


def test_other_jobs_events_and_policy_changes_move_no_plan() -> None:
    s = started()
    other = Authors("other", "test")
    assert step(s, other.make(proposed().payload)) is None and s.plans == {}
    assert step(s, F.make(PolicyChanged(mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="ui:a"))) is None
    assert s.policy_mode == PolicyMode.AUTO and s.auto_severities == [Severity.HIGH]


@pytest.mark.parametrize(("payload", "claimed"), [
    (proposed().payload, PlanStatus.PROPOSED), (decision().payload, PlanStatus.APPROVED),
    (decision(approve=False).payload, PlanStatus.REJECTED), (command().payload, PlanStatus.COMMANDED),
    (ack().payload, PlanStatus.APPLIED), (ack(status=AckStatus.FAILED).payload, PlanStatus.FAILED),
    (ack(status=AckStatus.IGNORED_STALE).payload, None),
    (PlanRolledBack(plan_id="p1", measured_tokens_per_s=1.0, predicted_tokens_per_s=2.0, reason="r"),
     PlanStatus.ROLLED_BACK),
])
def test_claimed_status_names_each_event_in_the_one_vocabulary(payload, claimed) -> None:
    assert claimed_status(payload) == claimed


def test_engine_console_demo_and_duckdb_agree_on_where_each_plan_stands() -> None:
    """Every reader of the stream projects the same fold: a second decision and a stale ack do
    not make any of them disagree with the engine."""
    import duckdb

    from analytics.projections.control_tables import ControlProjection
    from collector.stream import Delivery
    from remediation.lifecycle import fold as engine_fold
    from remediation.lifecycle import initial_state
    from resihp.demo.watch import LogState, LogWatch
    from ui.read_model import ReadModel

    events = [F.make(PlanCurrent(plan=PLAN0)), proposed(), decision(), decision(approve=False, actor="ui:bob"),
              command(), ack(), proposed("p2", base=1, plan=PLAN2), decision("p2", approve=False, plan=PLAN2)]
    engine = engine_fold(events, initial_state(JOB))
    console = ReadModel()
    for e in events:
        console.apply(e)
    watch = LogWatch.__new__(LogWatch)
    watch.state = LogState()
    for e in events:
        watch._fold(e)
    conn = duckdb.connect()
    projection = ControlProjection()
    projection.create(conn)
    projection.apply(conn, [Delivery("control", 0, i, e) for i, e in enumerate(events)])
    duck = dict(conn.execute("SELECT plan_id, status FROM plans").fetchall())
    assert {k: r.status for k, r in engine.plans.items()} == {"p1": PlanStatus.APPLIED, "p2": PlanStatus.REJECTED}
    assert {k: r.status for k, r in watch.state.plans.items()} == {k: r.status for k, r in engine.plans.items()}
    assert {k: v.status for k, v in console.plans.items()} == {"p1": "applied", "p2": "rejected"}
    assert duck == {"p1": "applied", "p2": "rejected"}


def test_a_plan_current_of_a_new_run_starts_the_fold_afresh_and_supersedes_the_old_runs_plans() -> None:
    s = fold([F.make(PlanCurrent(plan=PLAN0, run="run-one"), time_s=0.0), proposed(), decision(), command(), ack(),
              proposed("p2", base=1, plan=PLAN2)], PlanLifecycle(job=JOB))
    assert (s.run, s.running_epoch, s.plans["p2"].status) == ("run-one", 1, PlanStatus.PROPOSED)
    step(s, F.make(PlanCurrent(plan=PLAN0, run="run-two"), time_s=5.0))  # the job started again: epoch 0
    assert (s.run, s.running_epoch, s.running_plan) == ("run-two", 0, PLAN0)
    assert s.plans["p2"].status == PlanStatus.SUPERSEDED and "run run-one ended" in s.plans["p2"].verdict
    step(s, decision("p2", plan=PLAN2))  # a decision on the old run's plan decides nothing
    assert s.plans["p2"].status == PlanStatus.SUPERSEDED
