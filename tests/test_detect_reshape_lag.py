"""A partition that lags across a reshape is late, not dead (analytics/detection/fail_stop.py, arrival.py).

The shape of the Kafka demo's flake: right after a reshape the other ranks' heartbeats of the new
epoch (sent through the reshape's pause) arrive, while one rank's partition is still in the old
epoch and the new plan (control topic) has not been read yet. No report of the new epoch exists,
so no peer can prove the laggard alive; its last delivered heartbeat is several intervals older
than the others'. It must not be called dead, and a rank that really stops later must still be.
"""

from __future__ import annotations

from typing import cast

from analytics.detection.arrival import FrameAssembler
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from collector.events import Heartbeat, RankIteration

RANKS = 8
HB_S = 2.0


def _steady(watch: FailStopWatch, until_s: float) -> int:
    """Every rank reports an iteration per second and heartbeats every HB_S; returns the next iteration."""
    iteration = 0
    t = 0.0
    while t <= until_s:
        for r in range(RANKS):
            assert watch.telemetry(r, 0, iteration, t) == []
            if t % HB_S == 0:
                assert watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=iteration + 1, interval_s=HB_S), t) == []
        iteration += 1
        t += 1.0
    return iteration


def test_a_stream_behind_its_peers_epoch_through_a_reshape_pause_is_not_called_dead() -> None:
    watch = FailStopWatch(DetectorConfig())
    iteration = _steady(watch, 20.0)
    verdicts = []
    # The reshape: a 5 s pause, then epoch 1 resumes. Rank 2's partition lags: nothing of it
    # arrives; the plan for epoch 1 is not read yet either. Peers heartbeat in epoch 1.
    for t in (22.0, 24.0, 26.0, 28.0):
        for r in range(RANKS):
            if r != 2:
                verdicts += watch.heartbeat(Heartbeat(rank=r, epoch=1, iteration=iteration, interval_s=HB_S), t)
    assert [v for v in verdicts if not v.alive] == [], verdicts
    # Rank 2's lagging events arrive: its epoch-1 heartbeats, then it progresses with the others.
    for t in (22.0, 24.0, 26.0, 28.0):
        verdicts += watch.heartbeat(Heartbeat(rank=2, epoch=1, iteration=iteration, interval_s=HB_S), t)
    assert watch.dead == set() and verdicts == []


def test_a_rank_that_really_stops_in_the_old_epoch_is_still_judged_within_the_lag_bound() -> None:
    config = DetectorConfig()
    watch = FailStopWatch(config)
    iteration = _steady(watch, 20.0)
    verdicts = []
    t = 22.0
    while t <= 20.0 + (config.reference_max_lag_intervals + 2) * HB_S:
        for r in range(RANKS):
            if r != 2:  # rank 2 never comes back
                verdicts += [(t, v) for v in watch.heartbeat(
                    Heartbeat(rank=r, epoch=1, iteration=iteration, interval_s=HB_S), t)]
        t += HB_S
    dead = [(t, v) for t, v in verdicts if not v.alive]
    assert [v.rank for _, v in dead] == [2], dead
    t_dead, change = dead[0]
    assert t_dead - 20.0 > config.reference_max_lag_intervals * HB_S
    assert "still in epoch 0" in change.reason


def test_a_reshape_seen_only_in_heartbeats_is_a_pause_not_a_hung_job() -> None:
    """Heartbeats of a newer epoch than any report: the job is reshaping, so the hung job's short
    miss does not apply to a rank whose partition is a few seconds behind within the new epoch."""
    watch = FailStopWatch(DetectorConfig())
    iteration = _steady(watch, 20.0)
    assert watch.stall_from_s(HB_S) < float("inf")
    watch.heartbeat(Heartbeat(rank=0, epoch=1, iteration=iteration, interval_s=HB_S), 22.0)
    assert watch.stall_from_s(HB_S) == float("inf")


def test_a_rank_whose_first_heartbeat_is_late_is_waited_for_while_its_peers_heartbeat() -> None:
    """At the job's start a partition lags: rank 1 reported iteration 0, but nothing of it since,
    heartbeats included, while its peers (which heartbeat) report on. Its frames are not scored
    without it after two iterations as for a source that never heartbeats."""
    config = DetectorConfig()
    watch = FailStopWatch(config)
    arrival = FrameAssembler(config)
    for r in range(RANKS):
        watch.telemetry(r, 0, 0, 0.0)
    for r in range(RANKS):
        if r != 1:
            watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=1, interval_s=HB_S), 0.0)
    for k in range(1, 6):
        # held reports: only the keys count, so a bare object stands in for each report
        arrival.pending[(0, k)] = {r: cast(RankIteration, object()) for r in range(RANKS) if r != 1}
        for r in range(RANKS):
            if r != 1:
                watch.telemetry(r, 0, k, float(k))
    arrival._expected[0] = frozenset(range(RANKS))  # the plan of epoch 0 is known
    assert arrival.ready(watch) == []  # iteration 1 waits for rank 1
    quiet = FailStopWatch(config)  # the same without any heartbeat: the short bound still holds
    for r in range(RANKS):
        quiet.telemetry(r, 0, 0, 0.0)
        for k in range(1, 6):
            if r != 1:
                quiet.telemetry(r, 0, k, float(k))
    assert arrival.ready(quiet)[:2] == [(0, 1), (0, 2)]
