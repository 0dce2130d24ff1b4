"""The links between a plan's devices: the one rule for how a slow link slows traffic between groups.

A contract rule rather than a planner's or a simulator's: the planner's cluster view
(remediation/cluster.py) and the simulator's ground truth (trainer/sim/faults.py) cost the same
traffic by it, and they sit in layers that do not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping


def slowest_link_between(links: Mapping[frozenset[int], float], group_a: tuple[int, ...],
                         group_b: tuple[int, ...]) -> float:
    """The worst slowdown among ``links`` (device pair → factor; a one-device key is a loop) with
    one end in each group (the same group twice: a TP all-reduce), 1.0 when none joins them. The
    planner's cluster view and the simulator's truth both cost traffic by this one rule."""
    worst = 1.0
    for key, factor in links.items():
        a, b = (tuple(key) * 2)[:2]
        if (a in group_a and b in group_b) or (b in group_a and a in group_b):
            worst = max(worst, factor)
    return worst
