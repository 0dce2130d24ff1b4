"""Fail-stop plans: never rolled back onto a dead device, never blocked by an unverified plan."""

from __future__ import annotations

from collector.events import (
    AckStatus, CommandAck, Evidence, FaultCategory, IncidentOpened, IncidentResolved,
    IterationPrediction, IterationSummary, Location, PlanCurrent, PlanDecision, PlanProposed, PolicyChanged,
    PolicyMode, ReconfigureCommand, Severity,
)
from collector.plan import Plan
from collector.plan_lifecycle import plan_digest
from remediation.lifecycle import PlanStatus, can_roll_back, fold, initial_state, reactions
from tests.fixtures.signing import Authors

F = Authors("job", "test")
PLAN0 = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
PLAN1 = Plan.uniform(tp=2, pp=2, dp=1, num_layers=8, microbatches_per_replica=8, epoch=1)


def _incident(iid: str, category: FaultCategory, rank: int, iteration: int):
    return F.make(IncidentOpened(incident_id=iid, category=category, severity=Severity.CRITICAL, iteration=iteration,
                                 locations=[Location(target="compute", rank=rank)], evidence=Evidence(), summary=iid))


def _summaries(epoch: int, start: int, n: int, tokens: int):
    return [F.make(IterationSummary(epoch=epoch, iteration=i, tokens=tokens, wall_s=1.0)) for i in range(start, start + n)]


def _resumed(current: float = 0.0, fraction_of_before: float | None = None):
    """Healthy at 200 tokens/s, rank 6 stops at 10 (the job hangs), a plan without it is auto-applied."""
    prop = F.make(PlanProposed(plan_id="p1", incident_ids=["stop"], strategy="ours", base_epoch=0, plan=PLAN1,
                               current_tokens_per_s=current, predicted_tokens_per_s=35.0, reshape_cost_s=3.0,
                               diff=["replica 1: dropped"], severity=Severity.CRITICAL,
                               fraction_of_before=fraction_of_before))
    return fold(_summaries(0, 0, 10, 200) + [
        _incident("stop", FaultCategory.FAIL_STOP, 6, 10),
        F.make(PolicyChanged(mode=PolicyMode.AUTO, auto_severities=[Severity.CRITICAL], actor="cli:ops")), prop,
        F.make(PlanDecision(plan_id="p1", approve=True, actor="policy:auto", proposal_id=prop.id,
                            plan_digest=plan_digest(PLAN1))),
        F.make(ReconfigureCommand(command_id="cmd-p1", plan_id="p1", plan=PLAN1)),
        F.make(CommandAck(command_id="cmd-p1", plan_id="p1", epoch=1, status=AckStatus.APPLIED, running_epoch=1,
                          pause_s=2.0)),
        # the detector resolves the fail-stop once the plan leaves the rank out; the GPU is still dead
        F.make(IncidentResolved(incident_id="stop", iteration=11, reason="the new plan no longer uses this location")),
    ], initial_state("job", PLAN0))


def test_a_plan_that_resumed_a_hung_job_is_kept_even_when_short_of_its_prediction():
    s = _resumed(fraction_of_before=0.95)
    s = fold(_summaries(1, 20, 6, 120), s)  # 0.6 of the 200 before the fail-stop, predicted 0.95
    assert 6 in s.known_dead and not can_roll_back(s, s.plans["p1"])
    (key, _), = reactions(s)
    assert key == "verified/p1"


def test_no_roll_back_onto_a_layout_whose_device_died_even_if_its_incident_was_resolved():
    s = _resumed(current=100.0)  # a plan judged on ratios (current > 0) whose old layout holds dead rank 6
    s = fold(_summaries(1, 20, 6, 10), s)
    assert not can_roll_back(s, s.plans["p1"])
    assert [k for k, _ in reactions(s)] == ["verified/p1"]


def test_a_repaired_device_can_be_rolled_back_to_again():
    s = _resumed(current=100.0)
    s = fold([F.make(PlanCurrent(plan=PLAN0.model_copy(update={"epoch": 2}), reason="reshape"))], s)
    assert 6 not in s.known_dead


def test_an_unverified_plan_does_not_block_planning_for_a_new_fail_stop():
    s = _resumed()
    s = fold(_summaries(1, 20, 2, 200), s)  # two iterations: verification still needs samples
    assert s.plans["p1"].status == PlanStatus.APPLIED and s.blocking_plan() is s.plans["p1"]
    s = fold([_incident("stop2", FaultCategory.FAIL_STOP, 2, 22)], s)  # the job hangs again
    assert s.blocking_plan() is None


def test_an_applied_plan_left_behind_by_a_newer_epoch_stops_being_in_flight():
    s = _resumed()
    s = fold([F.make(PlanCurrent(plan=PLAN0.model_copy(update={"epoch": 2}), reason="restart"))], s)
    assert s.plans["p1"].status == PlanStatus.SUPERSEDED and s.plan_in_flight() is None


def test_prediction_tokens_are_taken_as_the_jobs_tokens():
    s = fold([F.make(PlanCurrent(plan=PLAN0, reason="start")),
              F.make(IterationPrediction(epoch=0, iteration=3, observed_s=2.0, predicted_s=2.0, tokens=4096))],
             initial_state("job"))
    assert s.epoch_samples[0][3] == (4096, 2.0)
