"""PP repartition: split the layers of one pipeline over its stages so the slowest stage is as
fast as possible, within each stage's memory.

Each stage has a speed (seconds per second of TP-1 layer time: a slow or narrow stage has a large
one) and a memory cap in layers. The decision "can every stage finish its layers within B?" is
answered greedily — each stage, in pipeline order, takes as many layers as fit in B and in its
memory while leaving at least one layer for every later stage; taking more never hurts the rest —
and B is found by bisection. Cost: O(S · log L) per probe, so a 100-stage pipeline of 1,000
layers partitions in well under a millisecond.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from remediation.model import ModelSpec

_BISECTION_STEPS = 48


def _cover(prefix: Sequence[float], speeds: Sequence[float], caps: Sequence[int], bound_s: float) -> list[int] | None:
    """Stage end indices if every layer fits within ``bound_s`` per stage, else None."""
    L = len(prefix) - 1
    S = len(speeds)
    start = 0
    ends = []
    for i, (speed, cap) in enumerate(zip(speeds, caps)):
        remaining_after = S - i - 1
        limit = L - remaining_after
        if start >= limit:
            return None
        budget = bound_s / speed
        j = bisect_right(prefix, prefix[start] + budget * (1 + 1e-12)) - 1
        j = min(j, start + cap, limit)
        if i == S - 1:
            if j < L:
                return None
            j = L
        if j <= start:
            return None
        ends.append(j)
        start = j
    return ends


def balanced_partition(model: ModelSpec, speeds: Sequence[float], caps: Sequence[int]) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges [(first, end), ...] minimising max(speed_i · Σ layer_time_s), or
    None when the stages cannot hold the model (too few layers per stage, or too little memory)."""
    S = len(speeds)
    L = model.num_layers
    if S == 0 or S > L or sum(min(c, L) for c in caps) < L or any(c < 1 for c in caps):
        return None
    prefix = model.prefix_s
    lo = 0.0
    hi = max(speeds) * prefix[-1] * 1.000001
    best = _cover(prefix, speeds, caps, hi)
    if best is None:
        return None
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        ends = _cover(prefix, speeds, caps, mid)
        if ends is None:
            lo = mid
        else:
            hi, best = mid, ends
        if hi - lo <= 1e-9 * hi:
            break
    out, first = [], 0
    for e in best:
        out.append((first, e))
        first = e
    return out
