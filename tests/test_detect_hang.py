"""Fail-stop while the job hangs: a dead rank stalls every synchronous peer, and the stall shortens
the wait for its missing heartbeats (analytics/detection/fail_stop.py)."""

from __future__ import annotations

from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from collector.events import Heartbeat

RANKS = 24
HB_S = 5.0  # heartbeat interval; one iteration takes 1 s


def drive(config: DetectorConfig, *, die_at_s: float | None, stall=(None, None), until_s: float = 60.0,
          dying=frozenset({3}), announce_at_s: float | None = None, gpus_per_node: int | None = None,
          lagging: frozenset[int] = frozenset()):
    """Event-time drive of the watch: an iteration completes every second (unless the job stalls or a
    rank is dead), every live rank heartbeats every ``HB_S``; ``gpus_per_node`` announces a plan that
    places ranks on nodes; a ``lagging`` rank's heartbeats during the stall are not delivered (its
    partition lags). Returns (time, change) for each verdict."""
    watch = FailStopWatch(config)
    if gpus_per_node is not None:
        watch.plan_announced(0, set(range(RANKS)), gpus_per_node)
    verdicts = []
    iteration = 0
    for tick in range(int(until_s) + 1):
        t = float(tick)
        dead = die_at_s is not None and t > die_at_s
        stalled = stall[0] is not None and stall[0] <= t < stall[1]
        if announce_at_s is not None and t == announce_at_s:
            watch.plan_announced(1, set(range(RANKS)))  # a reshape: its pause is the stall
        if not dead and not stalled:
            for r in range(RANKS):
                verdicts += [(t, c) for c in watch.telemetry(r, 0, iteration, t)]
            iteration += 1
        if tick % int(HB_S) == 0:
            for r in range(RANKS):
                if not (dead and r in dying) and not (stalled and r in lagging):
                    hb = Heartbeat(rank=r, epoch=0, iteration=iteration, interval_s=HB_S)
                    verdicts += [(t, c) for c in watch.heartbeat(hb, t)]
    return verdicts


def test_a_dead_rank_that_hangs_the_job_is_found_one_interval_after_its_first_missed_heartbeat() -> None:
    (t, change), = drive(DetectorConfig(), die_at_s=20.5)
    assert change.rank == 3 and not change.alive
    assert t == 30.0  # last heartbeat at 20, first missed at 25, judged at the next one
    assert "completed nothing" in change.reason
    (t_plain, _), = drive(DetectorConfig(hang_miss_intervals=3.0), die_at_s=20.5)
    assert t_plain == 40.0  # without the stall rule: three missed intervals


def test_a_stall_while_every_rank_heartbeats_kills_nobody() -> None:
    assert drive(DetectorConfig(), die_at_s=None, stall=(12.0, 45.0)) == []


def test_the_stall_rule_waits_for_a_stall_of_several_iterations() -> None:
    """Slow iterations (3 s) and a 2-interval heartbeat gap while iterations still complete: the
    job is not hung, so the ordinary threshold holds."""
    watch = FailStopWatch(DetectorConfig())
    out = []
    for it in range(10):
        t = 3.0 * it
        for r in range(RANKS):
            out += watch.telemetry(r, 0, it, t)
    assert watch.stalled_s(27.0 + 2.5, HB_S) == 0.0  # 2.5 s after the last report: within one interval
    assert watch.stalled_s(27.0 + 9.5, HB_S) == 9.5  # > 3 iterations of 3 s and > one interval
    assert out == []


def test_half_the_job_dying_at_once_is_judged_within_the_reference_lag_bound() -> None:
    """A node of a two-node job: the lower third of the watermarks is the dead ranks' own time, so
    only the bound on how far the reference trails the newest event gets them judged."""
    half = frozenset(range(RANKS // 2))
    verdicts = drive(DetectorConfig(), die_at_s=20.5, dying=half, until_s=160.0)
    assert {c.rank for _, c in verdicts} == half and not any(c.alive for _, c in verdicts)
    # newest watermark 20 + 20 intervals of reference lag, then 1.5 missed intervals (judged on a beat)
    assert max(t for t, _ in verdicts) == 20.0 + 20 * HB_S + 2 * HB_S


def test_a_node_that_is_half_the_heartbeating_ranks_is_judged_against_the_other_node() -> None:
    """The same two-node job with its nodes known (plan.current's gpus_per_node): the dead node's
    ranks are judged against the other node's progress, so the stall rule names them as it names
    one dead rank (last heartbeat at 20, missed at 25, judged at 30), not 20 intervals later."""
    half = frozenset(range(RANKS // 2, RANKS))
    verdicts = drive(DetectorConfig(), die_at_s=20.5, dying=half, until_s=160.0, gpus_per_node=RANKS // 2)
    assert {c.rank for _, c in verdicts} == half and not any(c.alive for _, c in verdicts)
    assert {t for t, _ in verdicts} == {30.0}
    assert all("completed nothing" in c.reason for _, c in verdicts)


def test_a_third_of_the_ranks_lagging_over_every_node_is_not_called_dead_while_the_job_stalls() -> None:
    """Streams lag one by one (each rank's own partition): a third of the ranks, spread over the
    three nodes, deliver no heartbeat through a stall. Each node with a third of its ranks behind
    reads behind, so no node's reference runs ahead of the laggards: nobody is judged dead."""
    lagging = frozenset({0, 1, 2, 8, 9, 10, 16, 17})
    assert drive(DetectorConfig(), die_at_s=None, stall=(12.0, 60.0), until_s=59.0, gpus_per_node=8, lagging=lagging) == []


def test_a_reshape_pause_is_a_stall_with_a_reason_and_keeps_the_ordinary_threshold() -> None:
    """A newer plan announced as the stall begins: rank 3's heartbeats late by two intervals (at
    t=30, as in the dead-rank case above) is not a verdict; three intervals (t=40) still is."""
    quiet = drive(DetectorConfig(), die_at_s=20.5, stall=(21.0, 60.0), announce_at_s=21.0, until_s=35.0)
    assert quiet == []
    ((t, change),) = drive(DetectorConfig(), die_at_s=20.5, stall=(21.0, 60.0), announce_at_s=21.0)
    assert change.rank == 3 and t == 40.0 and "completed nothing" not in change.reason


def test_a_dead_node_is_named_at_the_heartbeat_that_makes_it_dead_in_a_large_job() -> None:
    """200 ranks whose heartbeats arrive in a different order every round; a node (8 ranks) dies
    and hangs the job. The verdict comes with the round of the second missed heartbeat, the first
    whose reference is far enough past the last one, not a round later because the periodic
    judgement happened to run before most of that round had arrived."""
    import random

    ranks, hb_s, dying = 200, 10.0, set(range(112, 120))
    watch = FailStopWatch(DetectorConfig())
    rng = random.Random(3)
    verdicts = []
    iteration = 0
    for tick in range(121):
        t = float(tick)
        dead = t > 50.5
        if not dead:
            for r in range(ranks):
                verdicts += [(t, c) for c in watch.telemetry(r, 0, iteration, t)]
            iteration += 1
        if tick % int(hb_s) == 0:
            order = [r for r in range(ranks) if not (dead and r in dying)]
            rng.shuffle(order)
            for r in order:
                verdicts += [(t, c) for c in watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=iteration,
                                                                       interval_s=hb_s), t)]
    assert {c.rank for _, c in verdicts} == dying and not any(c.alive for _, c in verdicts)
    assert {t for t, _ in verdicts} == {70.0}  # last heartbeat at 50, missed at 60 and 70


def test_the_reference_lag_bound_follows_a_rank_that_announces_a_shorter_heartbeat_interval() -> None:
    config = DetectorConfig()
    watch = FailStopWatch(config)
    for r in range(3):
        watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=0, interval_s=5.0), 0.0)
    for r in (0, 1):
        watch.telemetry(r, 0, 50, 100.0)  # rank 2's stream lags far behind: the lag bound decides
    lag = config.reference_max_lag_intervals
    assert watch.reference_s() == 100.0 - lag * 5.0
    watch.heartbeat(Heartbeat(rank=0, epoch=0, iteration=51, interval_s=1.0), 100.0)
    assert watch.reference_s() == 100.0 - lag * 1.0  # the shortest interval announced, at once


def test_a_rank_whose_stream_lags_across_a_reshape_is_alive_while_the_new_epoch_progresses() -> None:
    """Its last event is of epoch 0; the new plan keeps it and its peers complete epoch-1
    iterations, which a synchronous job cannot do without it: late, not dead."""
    watch = FailStopWatch(DetectorConfig())
    for r in range(RANKS):
        watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=0, interval_s=HB_S), 0.0)
        watch.telemetry(r, 0, 0, 0.5)
    watch.plan_announced(1, set(range(RANKS)))
    verdicts = []
    for k, t in enumerate(range(1, 40), start=1):
        for r in range(1, RANKS):  # rank 0's stream lags: nothing of it arrives
            verdicts += watch.telemetry(r, 1, k, float(t))
            if t % int(HB_S) == 0:
                verdicts += watch.heartbeat(Heartbeat(rank=r, epoch=1, iteration=k, interval_s=HB_S), float(t))
    assert [v for v in verdicts if not v.alive] == []
    left_out = FailStopWatch(DetectorConfig())
    for r in range(RANKS):
        left_out.heartbeat(Heartbeat(rank=r, epoch=0, iteration=0, interval_s=HB_S), 0.0)
        left_out.telemetry(r, 0, 0, 0.5)
    left_out.plan_announced(1, set(range(1, RANKS)))  # the new plan leaves rank 0 out: not judged at all
    assert left_out.proof_of_life(0) is False


# ---- a node agent's hang report (telemetry.hang) --------------------------------------------------


def _hang(ranks: list[int], iteration: int = 7):
    from collector.events import HangReported

    return HangReported(iteration=iteration, ranks=ranks, waiting=[0, 1, 2], op="forward", stuck_for_s=16.0,
                        deadline_s=15.0, summary="hang: rank [3] stuck in 'forward'")


def test_a_hang_report_stops_the_ranks_it_names_until_they_report_again_not_until_they_heartbeat() -> None:
    watch = FailStopWatch(DetectorConfig())
    for r in range(4):
        watch.telemetry(r, 0, 6, 10.0)
    (change,) = watch.hung([3], 7, "forward", 16.0)
    assert (change.rank, change.alive, change.iteration) == (3, False, 7) and "hung" in change.reason
    assert watch.hung([3], 7, "forward", 20.0) == []  # named once
    assert watch.heartbeat(Heartbeat(rank=3, epoch=0, iteration=7, interval_s=HB_S), 12.0) == []  # its agent still beats
    assert 3 in watch.dead
    (back,) = watch.telemetry(3, 0, 7, 30.0)
    assert back.alive and back.rank == 3 and 3 not in watch.dead


def test_the_detector_opens_a_fail_stop_incident_from_a_hang_report_and_resolves_it_on_progress() -> None:
    from analytics.detection.detector import Detector
    from collector.events import (Chunk, Coords, EventFactory, FaultCategory, IncidentConfirmed, IncidentOpened,
                                  IncidentResolved, RankIteration)

    det = Detector("job-h", DetectorConfig())
    agent = EventFactory("job-h", "agent-node0")
    out = det.on_event(agent.make(_hang([3])))
    opened = [p for p in out if isinstance(p, IncidentOpened)]
    assert len(opened) == 1 and opened[0].category == FaultCategory.FAIL_STOP
    assert [loc.rank for loc in opened[0].locations] == [3] and "hung" in opened[0].summary
    assert any(isinstance(p, IncidentConfirmed) for p in out)
    report = RankIteration(epoch=0, iteration=8, rank=3, coords=Coords(tp=0, pp=0, dp=3), wall_s=1.0,
                           chunks=[Chunk(kind="F", microbatch=0, start_s=0.0, duration_s=0.3, tokens=64)])
    later = det.on_event(EventFactory("job-h", "rank-3").make(report))
    assert any(isinstance(p, IncidentResolved) and p.incident_id == opened[0].incident_id for p in later)


def test_only_the_executors_key_may_report_a_hang() -> None:
    from collector.auth import Gate
    from collector.events import EventFactory
    from tests.fixtures.signing import signed

    gate = Gate("analytics")
    event = EventFactory("job-h", "agent-node0").make(_hang([3]))
    assert gate.admit(signed(event, "executor"))
    assert not gate.admit(signed(EventFactory("job-h", "rank-3").make(_hang([3])), "rank"))
    assert not gate.admit(event)  # unsigned
