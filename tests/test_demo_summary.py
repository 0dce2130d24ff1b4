"""The demo's summary logic on a hand-built log: which incident matches which injected fault, how
precisely it is localised, and the throughput windows around each fault."""

from __future__ import annotations

from collector.events import FaultCategory, Location, Severity
from collector.incident_lifecycle import IncidentRecord
from collector.plan_lifecycle import PlanStatus
from resihp.demo.story import story_for
from resihp.demo.summary import fault_stories, match_incident, overall_tokens_per_s, summary_lines
from resihp.demo.watch import Injected, LogState, PlanRow, Summary


def _state() -> LogState:
    s = LogState()
    # 1 s iterations of 1,000 tokens; a fail-slow at 10 s halves the rate until the plan at 20 s;
    # a fail-stop at 40 s stops the job until the plan at 50 s; 800 tokens per s afterwards.
    for i in range(70):
        t = float(i + 1)
        if 40 < t <= 50:
            continue
        tokens = 500 if 10 < t <= 20 else 800 if t > 50 else 1000
        s.summaries.append(Summary(time_s=t, epoch=0, iteration=i, tokens=tokens, wall_s=1.0))
    s.injected = [
        Injected("slow", "fail_slow", Location(target="compute", rank=5, factor=3.0), 10, 10.0),
        Injected("stop", "fail_stop", Location(target="compute", rank=2, factor=1e9), 40, 40.0),
    ]
    s.incidents = {
        "noise": IncidentRecord("noise", FaultCategory("fail_slow"), Severity("low"), [Location(target="compute", rank=7)], "", 5, opened_at_s=5.0),
        "i1": IncidentRecord("i1", FaultCategory("fail_slow"), Severity("high"), [Location(target="compute", tp_group=(4, 5))], "", 11, opened_at_s=11.0),
        "i2": IncidentRecord("i2", FaultCategory("fail_stop"), Severity("critical"), [Location(target="compute", rank=2)], "", 39, opened_at_s=43.0),
    }
    s.plans = {
        "p1": PlanRow("p1", "ours", 0, 1, ["i1"], [], 0, 0, 12.0, status=PlanStatus.VERIFIED, applied_time_s=20.0),
        "p2": PlanRow("p2", "ours", 1, 2, ["i2"], [], 0, 0, 44.0, status=PlanStatus.VERIFIED, applied_time_s=50.0),
    }
    return s


def test_incidents_are_matched_by_category_device_and_onset_not_by_order() -> None:
    s = _state()
    inc, where = match_incident(s, s.injected[0])
    assert inc is not None and inc.incident_id == "i1" and where == "tp_group"  # "noise" predates the fault
    inc, where = match_incident(s, s.injected[1])
    assert inc is not None and inc.incident_id == "i2" and where == "rank"  # last iteration seen: 39 < 40


def test_throughput_windows_count_pauses_and_hangs_as_time_without_tokens() -> None:
    s = _state()
    slow, stop = fault_stories(s)
    assert slow.plan is not None and slow.plan.plan_id == "p1" and stop.plan is not None and stop.plan.plan_id == "p2"
    assert slow.before_tokens_per_s == 1000.0
    assert slow.during_tokens_per_s == 500.0
    assert stop.during_tokens_per_s == 0.0  # hung from 40 s until the reshape at 50 s
    assert stop.after_tokens_per_s == 800.0
    overall = overall_tokens_per_s(s, [slow, stop])
    assert overall["before"] == 1000.0 and overall["during"] == 250.0  # 5,000 tokens over 20 s of faults


def test_windows_follow_the_iteration_stream_not_the_stamps_of_late_records() -> None:
    """A loop that closes within a few iterations: 1 s healthy iterations of 1,000 tokens, ×3 slow
    from iteration 10 (3 s each), a 2 s reshape pause, then iterations under epoch 1. The faulty
    rank publishes its fault record 1.5 s after its first slow iteration, and the acknowledgement
    lands during the first reshaped iteration: windows at those stamps would count a slow
    iteration as healthy time and a reshaped one as faulty time. Drawn on the iteration stream,
    "during" is 3,000 tokens over 3 × 3 s + 2 s and "after" the reshaped rate."""
    s = LogState()
    t = 0.0
    for i in range(30):
        epoch, wall = (0, 1.0) if i < 10 else (0, 3.0) if i < 13 else (1, 1.25)
        if i == 13:
            t += 2.0  # the reshape pause
        t += wall
        s.summaries.append(Summary(time_s=t, epoch=epoch, iteration=i, tokens=1000, wall_s=wall))
    s.injected = [Injected("slow", "fail_slow", Location(target="compute", rank=1, factor=3.0), 10, 13.0 + 1.5)]
    s.incidents = {"i1": IncidentRecord("i1", FaultCategory("fail_slow"), Severity("high"), [Location(target="compute", rank=1)], "", 11, opened_at_s=16.0)}
    first_new = next(x for x in s.summaries if x.epoch == 1)
    s.plans = {"p1": PlanRow("p1", "ours", 0, 1, ["i1"], [], 0, 0, 17.0, status=PlanStatus.VERIFIED,
                                applied_time_s=first_new.time_s - 0.5)}
    (story,) = fault_stories(s)
    assert story.onset_s == 10.0 and story.fixed_s == first_new.time_s - first_new.wall_s == 21.0
    assert story.before_tokens_per_s == 1000.0
    assert story.during_tokens_per_s == 3000.0 / 11.0
    assert story.after_tokens_per_s == 1000.0 / 1.25
    assert overall_tokens_per_s(s, [story])["during"] == story.during_tokens_per_s


def test_an_unfixed_fault_has_no_after_window_and_a_missed_one_no_incident() -> None:
    s = _state()
    s.plans.pop("p2")
    s.incidents.pop("i2")
    _, stop = fault_stories(s)
    assert stop.incident is None and stop.localisation == "missed" and not stop.detected
    assert stop.plan is None and stop.after_tokens_per_s is None


def test_the_story_puts_its_two_faults_in_different_replicas_at_every_scale() -> None:
    for gpus in (8, 32, 256):
        story = story_for(gpus)
        assert story.slow is not None and story.stop is not None
        replicas = {d // (story.tp * story.pp) for d in (story.slow.device, story.stop.device)}
        assert len(replicas) == 2 and story.stop.at_iteration > story.slow.at_iteration
        assert story.tp * story.pp * story.dp <= gpus


def test_the_default_story_is_tp2_and_the_detector_runs_at_its_defaults_plus_probes() -> None:
    from analytics.detection.config import DetectorConfig
    from resihp.demo.story import DETECTOR_SETTINGS

    story = story_for(8)
    assert (story.tp, story.pp, story.dp) == (2, 2, 2)
    assert story.slow.device == 5  # the second member of replica 1's first TP pair: a probe must name it
    config, defaults = DetectorConfig.model_validate(DETECTOR_SETTINGS), DetectorConfig()
    assert config.probes and config.model_copy(update={"probes": False}) == defaults


def test_a_plans_verdict_is_printed_under_it() -> None:
    """Why a plan was verified or rolled back, as the engine's event says it: a plan kept short of
    its prediction reads as verified, and the line under it says what it measured."""
    s = _state()
    s.plans["p1"].verdict = "measured ×1.680 (350 → 588 tokens/s) against the predicted ×2.004 (needs ×1.703)"
    s.plans["p2"].status, s.plans["p2"].verdict = PlanStatus.ROLLED_BACK, "below the predicted change: measured ×0.900"
    text = "\n".join(summary_lines(s, fault_stories(s)))
    assert "      verified: measured ×1.680 (350 → 588 tokens/s)" in text
    assert "      rolled back: below the predicted change: measured ×0.900" in text


def test_the_watcher_records_a_command_once_whichever_topic_it_reads_first(tmp_path) -> None:
    """A command is on two topics with one id: the commands topic (the order) and the control topic
    (the record). The watcher reads the record; had it folded the order that a poll can hand it
    before the proposal, the plan would read "none applied" though the trainer applied it."""
    from collector import topics
    from collector.bus import RawMessage
    from collector.codec import encode
    from collector.embedded import EmbeddedBus
    from resihp.demo.watch import LogWatch
    from tests.test_remediation_lifecycle import ack, command, decision, proposed

    order = command()
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        watch = LogWatch(bus, "job", tmp_path / "trace.parquet")
        bus.publish_raw([RawMessage(topics.COMMANDS, None, encode(order))])  # the order, polled first
        watch.drain()
        bus.publish([proposed(), decision()])
        bus.publish_raw([RawMessage(topics.CONTROL, None, encode(order))])  # the record, after its proposal
        bus.publish([ack()])
        watch.drain()
        watch.close()
    (plan,) = watch.state.plans.values()
    assert plan.applied_time_s is not None and plan.pause_s == 2.0
    assert not watch.state.lifecycle.reports
