"""Uneven arrival: the same events delivered partition-skewed (each rank's stream in order, but half
of the ranks a dozen iterations ahead of the others, as Kafka partitions can be) must give the
same detections as in-order delivery, and no false fail-stop or "communication" incident."""

from __future__ import annotations

from test_detect_detector import run, synth

from analytics.detection.detector import Detector
from collector.events import CostModelFitted, IncidentOpened, IncidentResolved


def skewed(events, lead_s: float = 12.0, ahead=lambda rank: rank < 9):
    """Per-source order kept; sources of the ``ahead`` ranks delivered ``lead_s`` (here = iterations)
    of event time early, so they run a dozen iterations ahead of the others."""
    def key(item):
        i, e = item
        src = e.source
        lead = lead_s if src.startswith("rank-") and ahead(int(src.split("-")[1])) else 0.0
        return (e.time_s - lead, i)
    return [e for _, e in sorted(enumerate(events), key=key)]


def detections(out) -> list[tuple]:
    return sorted((p.category.value, p.locations[0].target, p.locations[0].rank, p.iteration)
                  for p in out if isinstance(p, IncidentOpened))


def _assert_skewed(events):
    import numpy as np

    order = [int(e.source.split("-")[1]) for e in skewed(events) if e.source.startswith("rank-")]
    assert order[:12] and all(r < 9 for r in order[:40])  # the skew is real: group A leads
    _, base = run(events)
    det, out = run(skewed(events))
    assert detections(out) == detections(base)
    assert det.stats.late_reports == 0
    assert np.isfinite(det.model.error())
    return detections(base)


def test_skewed_delivery_of_a_healthy_run_raises_nothing() -> None:
    assert _assert_skewed(synth(iterations=30, seed=5, plan=True)) == []


def test_skewed_delivery_finds_the_same_slow_rank_at_the_same_iteration() -> None:
    found = _assert_skewed(synth(slow={13: 1.4}, start=10, plan=True))
    assert [(c, t, r) for c, t, r, _ in found] == [("fail_slow", "compute", 13)]


def test_skewed_delivery_finds_the_same_dead_rank_and_no_other() -> None:
    for dead in ((11, 12), (3, 12)):  # one in the lagging group, one in the leading group
        found = _assert_skewed(synth(dead=dead, iterations=22, plan=True))
        assert found == [("fail_stop", "compute", dead[0], 12)], dead


def test_a_lagging_group_is_never_called_dead_while_its_peers_progress() -> None:
    """Half the ranks 20 iterations behind (beyond every heartbeat threshold): no fail-stop, because
    peers completing later iterations prove the laggards ran the earlier ones."""
    events = skewed(synth(iterations=30, seed=2, plan=True), lead_s=20.0)
    det = Detector("j")
    out = [p for e in events for p in det.on_event(e)]
    assert [p for p in out if isinstance(p, (IncidentOpened, IncidentResolved))] == []
    assert det.fail_stop.dead == set()
    assert det.stats.frames == 30  # every iteration complete, scored once, none dropped
    assert any(isinstance(p, CostModelFitted) for p in out)
