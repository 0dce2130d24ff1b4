"""PP repartition: split the layers of one pipeline over its stages so the slowest stage is as
fast as possible, within each stage's memory, and as even as the speeds allow.

Layers are identical (transformer blocks), so a stage's time is linear in its layer count: stage i
holding n layers takes ``n · per_layer_s[i] + offset_s[i]`` (the offset is what does not move with
layers: the LM head on the last stage). Greedy water-filling is exact for this min-max problem:
every stage starts with one layer and each further layer goes to the stage whose time after taking
it is smallest, skipping stages at their memory cap. Among stages that would end equally fast the
one with the most free memory takes it, so equal stages get equal shares (no 1-layer last stage
while the first holds the surplus). Cost O(L · log S).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partition(
    num_layers: int, per_layer_s: Sequence[float], caps: Sequence[int], offsets_s: Sequence[float] | None = None,
) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges [(first, end), ...] in stage order minimising the slowest stage, or
    None when the stages cannot hold the model (fewer layers than stages, or too little memory)."""
    S = len(per_layer_s)
    L = num_layers
    offsets = list(offsets_s) if offsets_s is not None else [0.0] * S
    if S == 0 or S > L or any(c < 1 for c in caps) or sum(min(c, L) for c in caps) < L:
        return None
    counts = [1] * S

    def key(i: int) -> tuple[float, float, int]:
        n = counts[i] + 1
        return (round((n * per_layer_s[i] + offsets[i]) * 1e12), n / caps[i], i)

    heap = [key(i) for i in range(S) if counts[i] < caps[i]]
    heapq.heapify(heap)
    for _ in range(L - S):
        if not heap:
            return None
        _, _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, key(i))
    out, first = [], 0
    for n in counts:
        out.append((first, first + n))
        first += n
    return out
