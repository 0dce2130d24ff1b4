"""The simulator's timing core: one plan's iterations, computed in vectorised blocks.

Replicas of one shape (stages, micro-batches) form a group that is simulated together: every
replica and every iteration of a block is one row of
:func:`analytics.detection.schedule.pipeline_timing`. A block is cut where a fault starts or ends,
so the numbers do not depend on the block size: each iteration draws its workload and noise from
generators seeded by (seed, iteration, group), and its stalls from (seed, iteration) alone, so that
runs of one seed under different plans meet the same stalls (common random numbers for comparing
strategies). trainer/sim/engine.py steps through the blocks and builds the events.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from analytics.detection.schedule import OpTable, PipelineTiming, op_table, pipeline_timing
from collector.plan import Plan
from trainer.sim.cost import StageCoefficients, dp_allreduce_s, stage_coefficients
from trainer.sim.faults import FaultEffects
from trainer.sim.telemetry import stage_ops, transfer_consumers
from trainer.sim.workload import Packed, burst_rows, draw_microbatches

if TYPE_CHECKING:
    from trainer.sim.engine import SimConfig


def _poisson_quantile(u: float, lam: float) -> int:
    """The smallest k with P(Poisson(lam) ≤ k) ≥ u: one uniform gives the count, so runs whose
    means differ a little (a plan with one stage more) draw the same count almost always."""
    k, pmf = 0, math.exp(-lam)
    cdf = pmf
    while cdf < u and pmf > 0.0:
        k += 1
        pmf *= lam / k
        cdf += pmf
    return k


@dataclass
class ReplicaGroup:
    """Replicas of one shape, simulated together."""

    index: int
    replicas: list[int]
    table: OpTable
    coeffs: StageCoefficients
    ops_by_stage: list[np.ndarray]
    consumers: np.ndarray  # (n_ops,) the op that receives each op's output over a link, or -1


@dataclass
class Block:
    """A run of iterations computed at once, cut where a fault starts or ends."""

    first: int
    starts_s: np.ndarray  # (n,) since job start
    durations_s: np.ndarray  # (n,)
    tokens: np.ndarray  # (n,) whole job
    parts: list[tuple[ReplicaGroup, PipelineTiming, Packed]] = field(default_factory=list)
    wires: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per part: p2p and TP comm, (n·R, S, M)

    @property
    def n(self) -> int:
        return int(self.durations_s.shape[0])


class PlanTiming:
    """The timing of one plan: its replica groups, the DP all-reduce, and blocks of iterations."""

    def __init__(self, config: SimConfig, plan: Plan) -> None:
        self.config, self.plan = config, plan
        shapes: dict[tuple[int, int], list[int]] = {}
        for pipe in plan.pipelines:
            shapes.setdefault((len(pipe.stages), pipe.microbatches), []).append(pipe.replica)
        self.groups: list[ReplicaGroup] = []
        for gi, ((S, M), reps) in enumerate(sorted(shapes.items())):
            table = op_table(plan.schedule, S, M, plan.virtual_stages)
            coeffs = stage_coefficients(config.model, config.cluster, plan, reps)
            self.groups.append(ReplicaGroup(gi, reps, table, coeffs, stage_ops(table), transfer_consumers(table)))
        self.dp_allreduce_s = dp_allreduce_s(config.model, config.cluster, plan)
        m = config.model  # gradient bytes per TP rank, per replica and stage (replicas may differ in shape)
        self.dp_bytes = [[st.num_layers * m.params_per_layer // st.tp * m.bytes_per_value for st in pipe.stages]
                         for pipe in plan.pipelines]

    def block_size(self) -> int:
        if self.config.block_iterations:
            return self.config.block_iterations
        cells = sum(len(g.replicas) * g.table.n_ops for g in self.groups)
        return int(max(1, min(256, 4_000_000 // max(cells, 1))))

    def block(self, k0: int, now_s: float, eff: FaultEffects, changes_at: Callable[[int, float], bool]) -> Block:
        """Iterations ``k0``… from ``now_s`` under the faults ``eff``, cut before the first
        iteration at which ``changes_at`` says a fault starts or ends."""
        c = self.config
        n = self.block_size()
        parts, wires = [], []
        ends = np.zeros(n)
        tokens = np.zeros(n)
        stalls = self.stalls(n, k0)
        for g in self.groups:
            R, S, M = len(g.replicas), g.table.stages, g.table.microbatches
            pipes = [self.plan.pipelines[r] for r in g.replicas]
            comp_f = np.array([[eff.compute_factor(st.devices) for st in p.stages] for p in pipes])
            tp_f = np.array([[eff.comm_factor(c.cluster, st.devices, st.devices) for st in p.stages] for p in pipes])
            p2p_f = np.array([[eff.comm_factor(c.cluster, st.devices, p.stages[(s + 1) % S].devices)
                               for s, st in enumerate(p.stages)] for p in pipes])
            wl_rngs = [np.random.default_rng([c.seed, k0 + j, g.index, 0]) for j in range(n)]
            bursts = burst_rows(c.workload, c.seed, k0, n, g.replicas)
            packed = draw_microbatches(wl_rngs, c.workload, R, M, bursts)
            f_s, b_s, w_s, p2p_s, tp_s = self.durations(g, n, packed, comp_f, tp_f, p2p_f, k0, stalls[g.index])
            timing = pipeline_timing(g.table, f_s, b_s, w_s, p2p_s)
            wires.append((p2p_s, tp_s))
            ends = np.maximum(ends, timing.makespan_s.reshape(n, R).max(axis=1))
            tokens += packed.tokens.reshape(n, R * M).sum(axis=1)
            parts.append((g, timing, packed))
        dp_f = 1.0
        if self.plan.dp > 1 and (eff.links or eff.nics):
            dp_f = max(eff.comm_factor(c.cluster, tuple(self.plan.devices), tuple(self.plan.devices)), 1.0)
        durations = ends + self.dp_allreduce_s * dp_f
        starts = now_s + np.concatenate([[0.0], np.cumsum(durations)[:-1]])
        cut = next((j for j in range(1, n) if changes_at(k0 + j, starts[j])), n)
        if cut < n:  # a fault starts or ends inside: keep what ran under today's faults
            durations, starts, tokens = durations[:cut], starts[:cut], tokens[:cut]
        return Block(k0, starts, durations, tokens, parts, wires)

    def stalls(self, n: int, k0: int) -> dict[int, np.ndarray]:
        """The stalls of the block's iterations, group index → (n·R, S, M) seconds added to forwards.

        Drawn from (seed, iteration) alone, whatever the layout: a Poisson count with mean
        ``stall_probability`` × the plan's (replica, stage) pairs, exponential lengths, and a place
        drawn uniformly over the pairs (replicas in plan order) and the replica's micro-batches. Two
        runs of the same seed under different plans so meet the same stalls at the same iteration
        (common random numbers): a rare 1-s stall holds every replica's step, and drawn per group it
        made two strategies differ by ~1 % at 8,192 GPUs for nothing but luck."""
        nz = self.config.noise
        out = {g.index: np.zeros((n * len(g.replicas), g.table.stages, g.table.microbatches)) for g in self.groups}
        if not nz.stall_probability or not self.groups:
            return out
        owner: dict[int, tuple[ReplicaGroup, int]] = {r: (g, i) for g in self.groups for i, r in enumerate(g.replicas)}
        order = sorted(owner)
        stages = np.array([owner[r][0].table.stages for r in order])
        ends = np.cumsum(stages)
        pairs = int(ends[-1])
        lam = nz.stall_probability * pairs
        for j in range(n):
            rng = np.random.default_rng([self.config.seed, k0 + j, 3])
            count = _poisson_quantile(float(rng.random()), lam)
            if not count:
                continue
            u = rng.random((count, 3))  # one row per stall: length, pair, micro-batch
            for length_u, pair_u, mb_u in u:
                pair = min(int(pair_u * pairs), pairs - 1)
                at = int(np.searchsorted(ends, pair, side="right"))
                g, pos = owner[order[at]]
                stage = pair - int(ends[at] - stages[at])
                mb = min(int(mb_u * g.table.microbatches), g.table.microbatches - 1)
                out[g.index][j * len(g.replicas) + pos, stage, mb] += -nz.stall_mean_s * math.log1p(-length_u)
        return out

    def durations(self, g: ReplicaGroup, n: int, packed: Packed, comp_f: np.ndarray, tp_f: np.ndarray,
                   p2p_f: np.ndarray, k0: int, stall: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """Chunk durations, pipeline transfer times and the TP all-reduce time inside each F / B
        chunk, (n·R, S, M) each, rows iteration-major; ``stall`` from :meth:`stalls`."""
        nz = self.config.noise
        co = g.coeffs
        R, S, M = len(g.replicas), g.table.stages, g.table.microbatches
        zb = g.table.schedule == "zero_bubble"
        rows = n * R
        tile = lambda a: np.tile(a, (n, 1))[:, :, None]  # (R, S) -> (rows, S, 1)  # noqa: E731
        tok = packed.tokens[:, None, :].astype(np.float64)  # (rows, 1, M)
        sq = packed.sum_sq[:, None, :]
        lin = tile(co.linear_s_per_token) * tok
        att = tile(co.attn_s_per_sq_token) * sq
        over = tile(co.overhead_s)
        comm = (tile(co.tp_comm_s_per_token) * tok + tile(co.tp_comm_latency_s)) * tile(tp_f)
        kinds = 3 if zb else 2
        noise = np.ones((rows, kinds, S, M))
        jitter = np.ones((rows, S, 1))
        if nz.chunk_sigma or nz.rank_sigma:
            for j in range(n):
                rng = np.random.default_rng([self.config.seed, k0 + j, g.index, 1])
                sl = slice(j * R, (j + 1) * R)
                noise[sl] = np.exp(nz.chunk_sigma * rng.standard_normal((R, kinds, S, M)))
                jitter[sl, :, 0] = np.exp(nz.rank_sigma * rng.standard_normal((R, S)))
        cf = tile(comp_f) * jitter
        if zb:
            f_s = (lin + att) * cf * noise[:, 0] + over + comm + stall
            b_s = (lin + 2 * att) * cf * noise[:, 1] + over / 2 + comm
            w_s = lin * cf * noise[:, 2] + over / 2
        else:
            f_s = (lin + att) * cf * noise[:, 0] + over + comm + stall
            b_s = 2 * (lin + att) * cf * noise[:, 1] + over + comm
            w_s = None
        p2p_s = (tile(co.p2p_s_per_token) * tok + tile(co.p2p_latency_s)) * tile(p2p_f)
        return f_s, b_s, w_s, p2p_s, np.broadcast_to(comm, f_s.shape)
