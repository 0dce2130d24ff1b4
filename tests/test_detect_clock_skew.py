"""Clocks: a heartbeat is believed only within a bounded skew of the job's time as it arrives
(analytics/detection/fail_stop.py, Clocks). One stamped an hour ahead once dragged the job's reference with
it and opened 31 false critical incidents; one stamped in the past could move a rank's last
heartbeat back or revive a dead rank."""

from __future__ import annotations

from test_detect_detector import run, synth

from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from collector.events import EventFactory, Heartbeat, IncidentOpened


def _with_forged(events, rank: int, shift_s: float, at: int):
    """``events`` with one heartbeat of ``rank`` stamped ``shift_s`` from the event ``at``'s time."""
    forged = EventFactory("j", f"rank-{rank}").make(
        Heartbeat(rank=rank, epoch=0, iteration=5, interval_s=1.0), time_s=events[at].time_s + shift_s)
    return events[:at] + [forged] + events[at:]


def test_a_heartbeat_stamped_an_hour_ahead_is_not_believed_and_opens_nothing() -> None:
    events = synth(iterations=20, seed=3, plan=True)
    det, out = run(_with_forged(events, rank=4, shift_s=3600.0, at=len(events) // 2))
    assert [p for p in out if isinstance(p, IncidentOpened)] == []
    assert det.fail_stop.dead == set()
    assert det.fail_stop.untrusted_times == 1


def test_a_heartbeat_stamped_far_in_the_past_moves_nothing_back() -> None:
    # the job starts an hour and more into its clock, so an hour back is still a valid time_s (>= 0)
    events = [e.model_copy(update={"time_s": e.time_s + 5000.0}) for e in synth(iterations=20, seed=3, plan=True)]
    det, out = run(_with_forged(events, rank=4, shift_s=-3600.0, at=len(events) // 2))
    assert [p for p in out if isinstance(p, IncidentOpened)] == []
    assert det.fail_stop.dead == set()


def test_a_real_death_is_still_found_beside_a_forged_future_heartbeat() -> None:
    events = synth(dead=(11, 12), iterations=22, plan=True)
    _, out = run(_with_forged(events, rank=3, shift_s=3600.0, at=len(events) // 3))
    opened = [(p.category.value, p.locations[0].rank) for p in out if isinstance(p, IncidentOpened)]
    assert opened == [("fail_stop", 11)]


def test_a_jump_of_the_whole_jobs_clock_is_believed() -> None:
    """A job resuming after downtime: every rank's clock moves on at once, and a third of the
    ranks agreeing is enough to believe it; the job is judged from there."""
    watch = FailStopWatch(DetectorConfig())
    for t in range(5):
        for r in range(9):
            watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=t, interval_s=1.0), float(t))
    later = 1000.0
    for r in range(9):
        assert watch.heartbeat(Heartbeat(rank=r, epoch=0, iteration=6, interval_s=1.0), later) == []
    assert watch.untrusted_times == 3  # the first three, until they corroborate each other
    assert watch.reference_s() == later
    assert watch.dead == set()
