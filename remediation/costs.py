"""From a layout on a (possibly damaged) cluster to chunk durations, and from those to a
pipeline's iteration time through the shared schedule model (analytics.schedule).

The planner only ever asks one question of the schedule model: "how long does this pipeline take
for m micro-batches?" — :class:`PipelineScorer`. The default scorer calls
``analytics.schedule.pipeline_timing`` (the DAG's critical path) and, because a pipeline in steady
state adds the same time per extra micro-batch, evaluates the DAG exactly up to ``2·S + 2``
micro-batches and extrapolates linearly from the last two exact points beyond (exact for 1F1B,
checked in tests/test_planner_costs.py). Swap the scorer to use another model.

Costs (per micro-batch, one stage = one TP group holding layers [a, b)):
  compute = Σ layer_time_s[a:b] / tp · (1 + tp_overhead·log2(tp)·link_factor) · max compute factor
  p2p     = activation_bytes / link_bandwidth · max link factor of the two stages' devices
  DP all-reduce (once per iteration) = 2 · grad bytes per device / bandwidth · link factor, the
  slowest device of the whole job deciding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from analytics.schedule import op_table, pipeline_timing
from remediation.cluster import ClusterState
from remediation.model import ModelSpec


@dataclass(frozen=True)
class StageTimes:
    """Per-micro-batch durations of one pipeline's stages (all tuples of length S). ``p2p_s[s]``
    is the link s → s+1 (the last entry is unused by 1F1B)."""

    f_s: tuple[float, ...]
    b_s: tuple[float, ...]
    w_s: tuple[float, ...] | None
    p2p_s: tuple[float, ...]

    @property
    def stages(self) -> int:
        return len(self.f_s)


class PipelineScorer(Protocol):
    """Iteration time (seconds) of one pipeline running ``microbatches`` micro-batches."""

    def makespan_s(self, times: StageTimes, microbatches: int) -> float: ...


class ScheduleModelScorer:
    """The schedule DAG of analytics.schedule, memoised per (stage times, m)."""

    def __init__(self, schedule: str = "1f1b", virtual_stages: int = 1) -> None:
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self._cache: dict[tuple[StageTimes, int], float] = {}

    def _exact(self, times: StageTimes, m: int) -> float:
        key = (times, m)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        S = times.stages
        m_eval = m
        if self.schedule == "interleaved" and self.virtual_stages > 1 and m % S:
            m_eval = m + (S - m % S)  # the interleaved order needs m % S == 0: cost the next multiple
        table = op_table(self.schedule, S, m_eval, self.virtual_stages)
        col = lambda xs: np.broadcast_to(np.asarray(xs, dtype=float)[:, None], (S, m_eval))  # noqa: E731
        w = col(times.w_s) if self.schedule == "zero_bubble" else None
        if self.schedule == "zero_bubble" and w is None:
            raise ValueError("zero_bubble scoring needs StageTimes.w_s")
        timing = pipeline_timing(table, col(times.f_s), col(times.b_s), w, col(times.p2p_s))
        value = float(timing.makespan_s[0])
        if len(self._cache) > 200_000:
            self._cache.clear()
        self._cache[key] = value
        return value

    def makespan_s(self, times: StageTimes, microbatches: int) -> float:
        if microbatches < 1:
            return 0.0
        exact_up_to = 2 * times.stages + 2
        if microbatches <= exact_up_to:
            return self._exact(times, microbatches)
        a = self._exact(times, exact_up_to - 1)
        b = self._exact(times, exact_up_to)
        return b + (microbatches - exact_up_to) * (b - a)


@dataclass(frozen=True)
class StageLayout:
    """A stage as the planner builds it: a TP group and its layers [first_layer, end_layer)."""

    devices: tuple[int, ...]
    first_layer: int
    end_layer: int


def stage_speed(cluster: ClusterState, devices: Sequence[int]) -> tuple[float, float]:
    """(seconds per unit of layer time, link factor) of a TP group: the slowest member decides."""
    tp = len(devices)
    cf = max((cluster.compute_factor(d) for d in devices), default=1.0)
    lf = max((cluster.link_factor(d) for d in devices), default=1.0)
    overhead = 1.0 + cluster.hardware.tp_overhead * math.log2(tp) * lf if tp > 1 else 1.0
    return cf * overhead / tp, lf


def stage_times(
    cluster: ClusterState, model: ModelSpec, stages: Sequence[StageLayout], schedule: str = "1f1b"
) -> StageTimes:
    """Chunk durations of a pipeline built from ``stages`` on ``cluster``."""
    f, b, w, p2p = [], [], [], []
    ff = model.forward_fraction
    base_p2p = model.activation_bytes / cluster.hardware.link_bandwidth_Bps
    link = []
    for st in stages:
        per_unit, lf = stage_speed(cluster, st.devices)
        compute = model.layers_time_s(st.first_layer, st.end_layer) * per_unit
        f.append(compute * ff)
        if schedule == "zero_bubble":
            b.append(compute * (1 - ff) / 2)
            w.append(compute * (1 - ff) / 2)
        else:
            b.append(compute * (1 - ff))
        link.append(lf)
    for s in range(len(stages)):
        nxt = link[(s + 1) % len(stages)]
        p2p.append(base_p2p * max(link[s], nxt))
    return StageTimes(tuple(f), tuple(b), tuple(w) if schedule == "zero_bubble" else None, tuple(p2p))


def dp_allreduce_s(cluster: ClusterState, model: ModelSpec, stages: Sequence[StageLayout]) -> float:
    """Ring all-reduce time of the gradients held by the busiest device of these stages."""
    worst = 0.0
    for st in stages:
        per_device = model.grad_bytes * (st.end_layer - st.first_layer) / len(st.devices)
        lf = max(cluster.link_factor(d) for d in st.devices)
        worst = max(worst, 2.0 * per_device / cluster.hardware.link_bandwidth_Bps * lf)
    return worst


def stage_fits(cluster: ClusterState, model: ModelSpec, tp: int, num_layers: int) -> bool:
    """Whether ``num_layers`` layers' state fits on a TP group of ``tp`` devices."""
    return num_layers * model.layer_state_bytes <= tp * cluster.hardware.state_capacity_bytes


def max_layers(cluster: ClusterState, model: ModelSpec, tp: int) -> int:
    """The most layers a TP group of ``tp`` devices can hold."""
    if model.layer_state_bytes <= 0:
        return model.num_layers
    return int(tp * cluster.hardware.state_capacity_bytes // model.layer_state_bytes)
