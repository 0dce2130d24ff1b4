"""Judging a hang from flight records (unit logic; the real SIGSTOP is in test_agent_signals.py)."""

from __future__ import annotations

from pathlib import Path

from trainer.agent.flight import FINISHED, FlightEntry, FlightRecorder, read_flight
from trainer.agent.hang import HangPolicy, judge_hang


def entry(rank: int, op: str, seq: int, started: float = 100.0, recent: tuple[float, ...] = (0.5, 0.5)) -> FlightEntry:
    return FlightEntry(rank=rank, pid=1000 + rank, restart=0, iteration=7, step_started_s=started, op=op,
                       op_entered_s=started, seq=seq, recent_step_s=recent)


def test_the_rank_one_op_behind_is_named_with_the_op_it_is_stuck_in() -> None:
    world = {0: entry(0, "all_reduce", 22), 1: entry(1, "forward", 21), 2: entry(2, "all_reduce", 22)}
    report = judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=101.6)
    assert report is not None
    assert (report.culprits, report.op, report.deadline_s) == ((1,), "forward", 1.5)
    assert "rank [1] stuck in 'forward'" in report.summary() and "ranks [0, 2] wait in all_reduce" in report.summary()


def test_no_report_before_the_deadline_the_floor_or_the_first_finished_step() -> None:
    world = {0: entry(0, "all_reduce", 22), 1: entry(1, "forward", 21)}
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=101.4) is None
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=5.0), now_s=104.0) is None
    fresh = {r: entry(r, "forward", 1, recent=()) for r in (0, 1)}
    assert judge_hang(fresh, HangPolicy(factor=3.0, floor_s=1.0), now_s=1e9) is None


def test_a_slow_rank_that_still_enters_its_ops_is_not_hung() -> None:
    """Fail-slow is not a hang: the step has run 4 × its expected 0.5 s, yet the rank behind entered
    its op 0.2 s ago; once it enters none for the deadline it is."""
    slow = FlightEntry(rank=1, pid=1001, restart=0, iteration=7, step_started_s=100.0, op="backward",
                       op_entered_s=101.8, seq=21, recent_step_s=(0.5, 0.5))
    world = {0: entry(0, "all_reduce", 22), 1: slow}
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=102.0) is None
    report = judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=103.4)
    assert report is not None and report.culprits == (1,) and report.op == "backward"


def test_a_rank_warming_up_in_a_new_world_is_not_judged_even_with_a_prediction() -> None:
    """The first step of a restarted world loads its checkpoint: no finished step there yet, no
    verdict, whatever the cost model predicts for a step."""
    fresh = {r: entry(r, "step", 1, recent=()) for r in (0, 1)}
    assert judge_hang(fresh, HangPolicy(factor=3.0, floor_s=1.0), now_s=1e9, predicted_s=0.5) is None


def test_the_cost_model_estimate_replaces_the_ranks_own_history() -> None:
    world = {0: entry(0, "all_reduce", 22), 1: entry(1, "all_reduce", 22)}
    report = judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0, expected_step_s=2.0), now_s=106.5)
    assert report is not None and report.deadline_s == 6.0 and report.culprits == (0, 1)
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0, expected_step_s=2.0), now_s=105.5) is None


def test_a_finished_rank_is_never_hung(tmp_path: Path) -> None:
    recorder = FlightRecorder(str(tmp_path / "local-0.flight"), rank=4)
    for i in range(3):
        recorder.step(i)
        recorder.enter("all_reduce")
    recorder.finish()
    record = read_flight(str(tmp_path / "local-0.flight"))
    assert record is not None and (record.rank, record.iteration, record.op, len(record.recent_step_s)) == \
        (4, 2, FINISHED, 2)
    assert judge_hang({4: record}, HangPolicy(floor_s=0.0), now_s=record.step_started_s + 1e6) is None


def test_the_cost_models_prediction_on_the_bus_sets_the_deadline(tmp_path: Path) -> None:
    """The agent reads the analytics consumer's newest ``analytics.prediction`` for its job (a real
    embedded bus): 3 × the predicted iteration, floored, and the report says where it came from.
    Only a prediction analytics signed counts: a rank writer's unsigned 1 ms would call every step a
    hang, and is refused and reported."""
    from collector.bus import open_bus
    from collector.events import ControlRejected, EventFactory, IterationPrediction
    from collector.stream import EventStream
    from tests.fixtures.signing import factory
    from trainer.agent.predicted import PredictedIteration

    path = str(tmp_path / "bus.db")
    predicted = PredictedIteration(open_bus("embedded", path=path), "job-a", "agent-test")
    assert predicted.poll() is None
    writer = open_bus("embedded", path=path)
    make = factory("job-a", "analytics").make
    other = factory("job-b", "analytics").make
    forged = EventFactory("job-a", "analytics").make(IterationPrediction(epoch=0, iteration=3, observed_s=0.5,
                                                                         predicted_s=0.001, tokens=1))
    writer.publish([make(IterationPrediction(epoch=0, iteration=i, observed_s=0.5, predicted_s=s, tokens=1))
                    for i, s in ((1, 0.4), (2, 0.6))] +
                   [other(IterationPrediction(epoch=0, iteration=9, observed_s=1, predicted_s=9.0, tokens=1)), forged])
    assert predicted.poll() == 0.6
    predicted.close()
    with EventStream(writer, "audit", ["resihp.control"], on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
        refused = [d.event.payload for d in s.poll(timeout_s=0.1) if isinstance(d.event.payload, ControlRejected)]
    writer.close()
    assert [r.event_id for r in refused] == [forged.id] and "unsigned" in refused[0].reason

    world = {0: entry(0, "all_reduce", 22), 1: entry(1, "forward", 21)}  # the ranks' own steps: 0.5 s
    report = judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=101.85, predicted_s=0.6)
    assert report is not None and abs(report.deadline_s - 1.8) < 1e-9 and report.expected_from == "the cost model's prediction"
    assert "expected from the cost model's prediction" in report.summary()
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=101.75, predicted_s=0.6) is None
    assert judge_hang(world, HangPolicy(factor=3.0, floor_s=2.5), now_s=102.4, predicted_s=0.6) is None  # floored


def test_a_stopped_rank_inside_the_collective_is_the_culprit_not_its_waiting_peers() -> None:
    import dataclasses

    world = {r: entry(r, "all_reduce", 22) for r in range(3)}
    world[2] = dataclasses.replace(world[2], stopped=True)
    report = judge_hang(world, HangPolicy(factor=3.0, floor_s=1.0), now_s=101.6)
    assert report is not None and report.culprits == (2,) and report.op == "all_reduce"
    everyone = judge_hang({r: entry(r, "all_reduce", 22) for r in range(3)}, HangPolicy(factor=3.0, floor_s=1.0),
                          now_s=101.6)
    assert everyone is not None and everyone.culprits == (0, 1, 2)
