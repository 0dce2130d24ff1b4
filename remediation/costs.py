"""From a layout on a (possibly damaged) cluster to chunk durations, and from those to a
pipeline's iteration time through the shared schedule model (analytics.schedule).

The planner only ever asks one question of the schedule model: "how long does this pipeline take
for m micro-batches?" — :class:`PipelineScorer`. The default scorer calls
``analytics.detection.schedule.pipeline_timing`` (the DAG's critical path) and, because a pipeline in steady
state adds the same time per extra micro-batch, evaluates the DAG exactly up to ``2·S + 2``
micro-batches and extrapolates linearly from the last two exact points beyond (exact for 1F1B,
checked in tests). Swap the scorer to use another model.

Chunk costs follow the cost model's form, stage by stage (see remediation.model): a stage of n
layers on TP group G runs, per micro-batch,

  F = n·compute/|G| · cf(G) + n·overhead + n·tp_comm(|G|) · lf(G, G)   (+ the LM head on the last stage)
  B = the same with backward_factor × the compute       (zero-bubble: B = input grads, W = weight grads)
  p2p(s → s+1) = activation bytes / (min TP · bandwidth) · lf(G_s, G_s+1)
  DP all-reduce = ring over the replicas of the largest per-device gradient shard · lf

where cf is the slowest member's compute slowdown and lf the comm slowdown between the groups
(ClusterState.comm_factor) — the same terms and the same fault semantics the simulator uses for
its truth, so what the planner predicts is what the job will do, up to noise and the workload's
micro-batch-to-micro-batch variation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from analytics.detection.schedule import op_table, pipeline_timing
from collector.plan import Plan
from remediation.cluster import ClusterState
from remediation.model import PlannerModel


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


MIX_SAMPLES = 256  # draws of the micro-batch mix behind one expected makespan (±0.5 % on the mean)


class ScheduleModelScorer:
    """The schedule DAG of analytics.schedule, memoised per (stage times, m).

    With ``microbatch_cv`` > 0 the makespan is the *expected* one over the workload's micro-batch
    mix: every micro-batch draws a log-normal factor of that relative spread, which scales its
    chunks at every stage alike (the same sequences pass through each stage), and the DAG is run
    on ``MIX_SAMPLES`` draws at once. A pipeline of varying chunks takes longer on average than
    one of mean chunks — a chunk that runs long holds up every stage behind it while a short one
    gives little back — and by how much depends on the pipeline's shape: nothing for one stage,
    ~9 % for four stages of a 7B model at the simulator's mix. Without it a pipeline of fewer,
    longer stages looks cheaper than it runs. The draws are fixed (micro-batch j always draws
    the same factors), so candidates are compared on common random numbers, and m and m − 1
    micro-batches share all but one draw, which keeps the linear extrapolation's slope steady."""

    def __init__(self, schedule: str = "1f1b", virtual_stages: int = 1, microbatch_cv: float = 0.0) -> None:
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.microbatch_cv = microbatch_cv
        self._cache: dict[tuple[StageTimes, int], float] = {}
        self._mix = np.ones((MIX_SAMPLES, 0))

    def _mix_factors(self, m: int) -> np.ndarray:
        """(MIX_SAMPLES, m) factors of mean 1; column j depends on j only."""
        have = self._mix.shape[1]
        if have < m:
            sigma = float(np.sqrt(np.log1p(self.microbatch_cv**2)))
            cols = [np.random.default_rng([20231114, j]).lognormal(-sigma**2 / 2, sigma, MIX_SAMPLES)
                    for j in range(have, m)]
            self._mix = np.concatenate([self._mix, np.stack(cols, axis=1)], axis=1)
        return self._mix[:, :m]

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
        mix = self._mix_factors(m_eval)[:, None, :] if self.microbatch_cv > 0 else None  # (R, 1, m)

        def chunk(xs: tuple[float, ...]) -> np.ndarray:
            """Chunk durations; with the mix, one factor per micro-batch scales it at every stage."""
            return col(xs) if mix is None else col(xs)[None] * mix

        w = None
        if self.schedule == "zero_bubble":
            if times.w_s is None:
                raise ValueError("zero_bubble scoring needs StageTimes.w_s")
            w = chunk(times.w_s)
        timing = pipeline_timing(table, chunk(times.f_s), chunk(times.b_s), w, col(times.p2p_s))
        value = float(timing.makespan_s.mean())
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


ALLREDUCES_PER_LAYER = 2  # attention and MLP outputs (Megatron-style TP): latency hops per layer


def ring_factor(members: int) -> float:
    return 2.0 * (members - 1) / members if members > 1 else 0.0


def _node_local(cluster: ClusterState, devices: Sequence[int]) -> bool:
    return len({cluster.node_of(d) for d in devices}) == 1


@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch seconds of one stage, split by what scales with what (for partitioning)."""

    per_layer_compute_s: float  # forward compute of one layer on this group (already / tp and × slowdown)
    per_layer_fixed_s: float  # overhead + TP comm of one layer, per chunk
    head_s: float  # forward LM head on this group (last stage only), × slowdown


def stage_cost(cluster: ClusterState, model: PlannerModel, devices: Sequence[int], last: bool) -> StageCost:
    """What one layer costs on the TP group ``devices`` (and the head, when it is the last stage)."""
    devices = tuple(devices)
    tp = len(devices)
    cf = max((cluster.compute_factor(d) for d in devices), default=1.0)
    hw = cluster.hardware
    comm = 0.0
    if tp > 1 and model.tp_bytes_per_token > 0:
        bw = hw.intra_node_bandwidth_Bps if _node_local(cluster, devices) else hw.link_bandwidth_Bps
        comm = (ring_factor(tp) * model.tp_bytes_per_token * model.tokens_per_microbatch / bw
                + ALLREDUCES_PER_LAYER * 2 * (tp - 1) * hw.link_latency_s) * cluster.comm_factor(devices, devices)
    return StageCost(
        per_layer_compute_s=model.layer_compute_s() / tp * cf,
        per_layer_fixed_s=model.overhead_s + comm,
        head_s=model.head_compute_s() / tp * cf if last else 0.0,
    )


def stage_round_trip_s(cost: StageCost, model: PlannerModel, layers: int) -> float:
    """F + B (+ W) of a stage holding ``layers`` layers: what the layer split balances."""
    bf = model.backward_factor
    return (1 + bf) * (layers * cost.per_layer_compute_s + cost.head_s) + 2 * layers * cost.per_layer_fixed_s


def stage_times(
    cluster: ClusterState, model: PlannerModel, stages: Sequence[StageLayout], schedule: str = "1f1b"
) -> StageTimes:
    """Chunk durations of a pipeline built from ``stages`` on ``cluster``."""
    f, b, w, p2p = [], [], [], []
    S = len(stages)
    bf = model.backward_factor
    hw = cluster.hardware
    for i, st in enumerate(stages):
        n = st.end_layer - st.first_layer
        c = stage_cost(cluster, model, st.devices, last=i == S - 1)
        compute = n * c.per_layer_compute_s + c.head_s
        fixed = n * c.per_layer_fixed_s
        f.append(compute + fixed)
        if schedule == "zero_bubble":  # B: input grads (half the backward), W: weight grads
            b.append(compute * bf / 2 + fixed)
            w.append(compute * bf / 2)
        else:
            b.append(compute * bf + fixed)
        nxt = stages[(i + 1) % S]
        bw = hw.intra_node_bandwidth_Bps if cluster.node_of(st.devices[0]) == cluster.node_of(nxt.devices[0]) \
            else hw.link_bandwidth_Bps
        per_token = model.activation_bytes_per_token / (min(len(st.devices), len(nxt.devices)) * bw)
        p2p.append((per_token * model.tokens_per_microbatch + hw.link_latency_s)
                   * cluster.comm_factor(st.devices, nxt.devices))
    return StageTimes(tuple(f), tuple(b), tuple(w) if schedule == "zero_bubble" else None, tuple(p2p))


def dp_allreduce_s(cluster: ClusterState, model: PlannerModel, stages: Sequence[StageLayout], dp: int = 2) -> float:
    """Ring all-reduce over ``dp`` replicas of the gradients held by the busiest device of these
    stages (between nodes), slowed by any slow link or NIC these stages' devices use."""
    if dp <= 1:
        return 0.0
    hw = cluster.hardware
    worst = 0.0
    for st in stages:
        per_device = model.grad_bytes * (st.end_layer - st.first_layer) / len(st.devices)
        worst = max(worst, ring_factor(dp) * per_device / hw.link_bandwidth_Bps + 2 * (dp - 1) * hw.link_latency_s)
    if cluster.links or cluster.damaged:
        devices = tuple(d for st in stages for d in st.devices)
        worst *= cluster.comm_factor(devices, devices)
    return worst


def stage_fits(cluster: ClusterState, model: PlannerModel, tp: int, num_layers: int) -> bool:
    """Whether ``num_layers`` layers' state fits on a TP group of ``tp`` devices."""
    return num_layers * model.layer_state_bytes <= tp * cluster.hardware.state_capacity_bytes


def max_layers(cluster: ClusterState, model: PlannerModel, tp: int) -> int:
    """The most layers a TP group of ``tp`` devices can hold."""
    if model.layer_state_bytes <= 0:
        return model.num_layers
    return int(tp * cluster.hardware.state_capacity_bytes // model.layer_state_bytes)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z) (Abramowitz–Stegun 7.1.26 for erf, |error| < 1.5e-7), vectorised."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _slowest_cdf(spans: Iterable[tuple[float, int]], cv: float, sd_s: float, grid_points: int
                 ) -> tuple[np.ndarray, np.ndarray] | float:
    """(grid, P[slowest ≤ t] on it) — or the plain maximum when nothing varies."""
    items = [(m, c) for m, c in spans if c > 0 and m > 0]
    if not items:
        return 0.0
    if cv <= 0 and sd_s <= 0:
        return max(m for m, _ in items)
    means = np.array([m for m, _ in items])
    counts = np.array([c for _, c in items], dtype=float)
    sigmas = np.sqrt((cv * means) ** 2 + sd_s**2)
    lo = float(max(0.0, (means - 8 * sigmas).min()))
    hi = float((means + 8 * sigmas).max())
    t = np.linspace(lo, hi, grid_points)
    z = (t[:, None] - means[None, :]) / sigmas[None, :]
    log_f = (np.log(np.clip(_normal_cdf(z), 1e-300, 1.0)) * counts[None, :]).sum(axis=1)
    return t, np.exp(log_f)


def expected_slowest_s(spans: Iterable[tuple[float, int]], cv: float, grid_points: int = 400,
                       sd_s: float = 0.0) -> float:
    """Expected time of the slowest of the pipelines, whose makespans vary iteration to iteration
    around their means, independently. ``spans``: (mean makespan, how many pipelines have it).
    A pipeline of mean m has spread σ = √((cv·m)² + sd_s²): ``cv`` the part that scales with
    its length, ``sd_s`` (seconds) the part that does not. E[max] = lo + ∫ (1 − Π Φ(·)^count) dt
    over a grid, with normal spreads. With no spread it is the plain maximum.

    Why it matters: with many replicas the iteration already waits for the unluckiest one, so a
    replica slightly slower on average costs less than its mean says, and fixing it gains less.
    ``cost_figures.calibrate_spread`` fits the relative spread on the body of the observed
    iterations (their median); rare stalls are a separate, additive ``PlannerModel.tail_s``."""
    cdf = _slowest_cdf(spans, cv, sd_s, grid_points)
    if isinstance(cdf, float):
        return cdf
    t, f = cdf
    return float(t[0]) + float(np.trapezoid(1.0 - f, t))


def median_slowest_s(spans: Iterable[tuple[float, int]], cv: float, grid_points: int = 400,
                     sd_s: float = 0.0) -> float:
    """The median of the slowest pipeline's time (see :func:`expected_slowest_s`): what a typical
    iteration waits for, which rare long stalls barely move."""
    cdf = _slowest_cdf(spans, cv, sd_s, grid_points)
    if isinstance(cdf, float):
        return cdf
    t, f = cdf
    return float(np.interp(0.5, f, t))


def compute_factor_from_chunks(cluster: ClusterState, model: PlannerModel, plan: Plan, device: int,
                               chunk_factor: float) -> float:
    """The compute slowdown behind a measured chunk slowdown of ``device``.

    The detector's factor is how much longer the rank's chunks take than predicted: compute, TP
    communication and per-layer overhead together. ``DeviceState.compute_factor`` multiplies the
    compute alone (what a throttled GPU slows). With c the stage's compute and f the rest of one
    F+B round trip, chunk_factor = (cf·c + f) / (c + f), so cf = 1 + (chunk_factor − 1)·(c + f)/c.
    A device the plan does not use keeps the measured factor (no stage to take c and f from)."""
    healthy = ClusterState(cluster.num_devices, cluster.hardware)
    for pipe in plan.pipelines:
        for i, st in enumerate(pipe.stages):
            if device in st.devices:
                cost = stage_cost(healthy, model, st.devices, last=i == len(pipe.stages) - 1)
                compute = (1 + model.backward_factor) * (st.num_layers * cost.per_layer_compute_s + cost.head_s)
                total = stage_round_trip_s(cost, model, st.num_layers)
                return 1 + (chunk_factor - 1) * total / compute if compute > 0 else chunk_factor
    return chunk_factor


def compute_factor_of(cluster: ClusterState, model: PlannerModel, plan: Plan, device: int, factor: float,
                      measure: str) -> float:
    """The compute slowdown a compute location of ``device`` states, as the planner reads it: a
    factor measured on chunks (telemetry, ``Location.measure == "chunks"``) through
    ``compute_factor_from_chunks``; one measured on compute alone (a probe) as it stands."""
    return factor if measure == "compute" else compute_factor_from_chunks(cluster, model, plan, device, factor)
