"""The referee: one meaning of 'this incident detects that fault' for every scorer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from collector.events import FaultCategory, FaultInjected, Location
from resihp import referee


class _Window(TypedDict):
    """The run a fault is judged in: ``referee.detects``'s keyword arguments."""

    gpus_per_node: int
    iterations: int
    before: int
    after: int


@dataclass
class _Inc:
    opened: int
    category: str
    locations: list = field(default_factory=list)


@dataclass
class _Cluster:
    gpus_per_node: int = 8


def _fault(loc: Location, start: int = 10, end: int | None = 20, category=FaultCategory.FAIL_SLOW) -> FaultInjected:
    return FaultInjected(fault_id="f", category=category, location=loc, start_iteration=start, end_iteration=end)


def test_a_fault_hits_its_device_not_its_tp_group_and_a_node_hits_all_its_devices():
    assert referee.fault_devices(Location(target="compute", rank=5, tp_group=(4, 5)), 8) == {5}
    assert referee.fault_devices(Location(target="node", node=1), 8) == set(range(8, 16))
    assert referee.fault_devices(Location(target="link", link=(3, 11)), 8) == {3, 11}


def test_detection_needs_category_window_and_a_shared_device():
    f = _fault(Location(target="compute", rank=5, tp_group=(4, 5)))
    ok = _Window(gpus_per_node=8, iterations=100, before=1, after=5)
    assert referee.detects(f, _Inc(12, "fail_slow", [Location(target="compute", tp_group=(4, 5))]), **ok)
    assert not referee.detects(f, _Inc(12, "fail_stop", [Location(target="compute", rank=5)]), **ok)
    assert not referee.detects(f, _Inc(12, "fail_slow", [Location(target="compute", rank=4)]), **ok)
    assert not referee.detects(f, _Inc(8, "fail_slow", [Location(target="compute", rank=5)]), **ok)
    assert referee.detects(f, _Inc(9, "fail_slow", [Location(target="compute", rank=5)]), **ok)
    assert referee.detects(f, _Inc(24, "fail_slow", [Location(target="compute", rank=5)]), **ok)
    assert not referee.detects(f, _Inc(25, "fail_slow", [Location(target="compute", rank=5)]), **ok)
    unplaced = _Inc(12, "fail_slow", [Location(target="compute")])
    assert referee.detects(f, unplaced, **ok)
    assert not referee.detects(f, unplaced, **ok, unplaced_covers=False)


def test_exact_localisation_of_a_link_accepts_the_endpoints_tp_groups_in_either_order():
    f = _fault(Location(target="link", link=(4, 6)))
    tp_of = {4: (4, 5), 5: (4, 5), 6: (6, 7), 7: (6, 7)}
    assert referee.exact(f, [Location(target="link", link=(7, 5))], 8, tp_of)
    assert not referee.exact(f, [Location(target="link", link=(6, 8))], 8, tp_of)
    node = _fault(Location(target="node", node=1))
    assert referee.exact(node, [Location(target="compute", rank=9)], 8, {})
    assert not referee.exact(node, [Location(target="compute", rank=3)], 8, {})


def test_grade_says_how_precisely_a_location_names_the_faulty_device():
    truth = Location(target="compute", rank=5, node=0)
    assert referee.grade(Location(target="compute", rank=5), truth) == "rank"
    assert referee.grade(Location(target="compute", tp_group=(4, 5)), truth) == "tp_group"
    assert referee.grade(Location(target="node", node=0), truth) == "node"
    assert referee.grade(Location(target="compute", rank=6), truth) is None


def test_score_counts_false_alarms_delays_and_localisation():
    f = _fault(Location(target="compute", rank=5))
    incs = {"hit": _Inc(13, "fail_slow", [Location(target="compute", rank=5)]),
            "false": _Inc(50, "fail_slow", [Location(target="compute", rank=1)])}
    (s,) = referee.score([([f], {"d": incs}, 100, 90, _Cluster(), {})], grace=5).values()
    assert (s["precision"], s["recall"], s["localisation"]) == (0.5, 1.0, 1.0)
    assert s["delay_p50_iters"] == 3.0
    assert s["false_alarms_per_10k"] == round(1e4 / 90, 2)
