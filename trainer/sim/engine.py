"""The simulator engine: steppable, one iteration at a time, computed in vectorised blocks.

``SimEngine.step()`` returns the events of one iteration (or, while the job hangs on a dead rank,
of one heartbeat interval). Internally it computes blocks of iterations at once — every replica
and every iteration of the block is one row of :func:`analytics.detection.schedule.pipeline_timing` — and cuts
a block where a fault starts or ends, so the numbers do not depend on the block size: each
iteration draws its workload and noise from generators seeded by (seed, iteration, group), and its
stalls from (seed, iteration) alone, so that runs of one seed under different plans meet the same
stalls (common random numbers for comparing strategies).

What it adds to the platform's own model (so detectors are not graded on themselves): log-normal
noise per chunk, jitter per (replica, stage, iteration), rare stalls (GC pauses: an exponential
extra delay on one chunk), TP and pipeline communication from message sizes, the LM head on the
last stage, and a DP all-reduce after the slowest replica.

Trust: from the bus (``handle``) it obeys only commands signed by the engine and probes signed by
analytics within the trainer's probe bounds, reporting the rest as ``control.rejected``; its
acknowledgements are signed with the executor's key (collector/auth.py). A command must also name
the simulated run (``run``, announced in its ``plan.current``) and not be past its expiry on the
simulated clock (collector/epoch_fence.py's ``order_refusal``). The run is derived from the job and
the seed unless the config names one, so one scenario and seed give one trace byte for byte; a
command of another simulated run is refused like a torch executor's.

What can go wrong: a plan naming a device beyond the cluster, or with a layer count other than the
model's, is refused (``reconfigure`` acks ``failed``); a plan that keeps a dead device hangs.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from analytics.detection.schedule import OpTable, PipelineTiming, op_table, pipeline_timing
from collector.auth import Gate, load_keyring
from collector.epoch_fence import fence_verdict, order_refusal
from collector.events import (
    AckStatus, CommandAck, Envelope, FaultInjected, Heartbeat, IterationSummary, ProbeRequest, ProbeResult,
    PlanCurrent, PlanCurrentReason, ReconfigureCommand,
)
from collector.plan import Plan
from collector.replica_drop import drop_replicas
from trainer.integration import probe_refusal
from trainer.sim.cost import StageCoefficients, dp_allreduce_s, stage_coefficients
from trainer.sim.faults import ActiveFault, FaultEffects, FaultSpec, truth_event_payload
from trainer.sim.presets import ClusterSpec, ModelSpec
from trainer.sim.telemetry import (
    Dialect, DeterministicEvents, dialect_rank_iterations, replica_rank_iterations, stage_ops, tracing_of, transfer_consumers,
)
from trainer.sim.workload import Packed, WorkloadSpec, draw_microbatches

SIM_EPOCH_TIME_S = 1_700_000_000.0  # 2023-11-14T22:13:20Z: simulated time starts here


class NoiseSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_sigma: float = Field(default=0.03, ge=0, description="log-normal σ per chunk")
    rank_sigma: float = Field(default=0.02, ge=0, description="log-normal σ per (replica, stage, iteration)")
    stall_probability: float = Field(default=0.001, ge=0, le=1, description="per (replica, stage, iteration)")
    stall_mean_s: float = Field(default=0.25, ge=0, description="mean of an exponential stall (GC pause)")


NOISE_OFF = NoiseSpec(chunk_sigma=0.0, rank_sigma=0.0, stall_probability=0.0, stall_mean_s=0.0)


class SimConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    cluster: ClusterSpec
    workload: WorkloadSpec = WorkloadSpec()
    noise: NoiseSpec = NoiseSpec()
    plan: Plan
    job: str = "sim"
    seed: int = 0
    run: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$", description=(
        "the run incarnation commands must name; None: derived from the job and the seed (one scenario, one trace)"))
    heartbeat_interval_s: float = Field(default=10.0, gt=0)
    start_time_s: float = SIM_EPOCH_TIME_S
    reshape_pause_s: float = Field(default=20.0, ge=0, description="simulated pause to apply a new plan")
    rebalance_pause_s: float = Field(default=1.0, ge=0, description=(
        "simulated pause to apply a plan that only moves micro-batches (same stages: the trainer keeps "
        "its process groups and state and switches at an iteration boundary)"))
    restart_after_s: float | None = Field(
        default=None, ge=0, description="open loop: after hanging this long on a dead device, restart without "
        "its replicas (an elastic launcher); None: hang until a reconfigure command")
    telemetry: Literal["all", "none"] | list[int] = Field(
        default="all", description="ranks that emit RankIteration/Heartbeat: all, none (truth-only), or a list")
    probe_reference_s: float = Field(default=0.05, gt=0, description="a healthy device's probe time")
    block_iterations: int = Field(default=0, ge=0, description="iterations per vectorised block; 0: automatic")
    dialect: Dialect = Field(default="ours", description=(
        "how the ranks record (docs/dialects.md): ours, megatron (one rank per TP group, fused p2p timers that "
        "hold waits, no sequence lengths or token counts), profiler (torch.profiler: blocking p2p ops, "
        "collectives by group, no lengths, tokens or nodes), sampled (ours on a declared subset of ranks and "
        "every 2nd step); the timeline is the same in every dialect"))

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        """A starting plan no trainer could cut the model to is refused, as a real launcher would."""
        if problem := self.plan.tp_split_problem(self.model.heads):
            raise ValueError(problem)
        return self


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
class _Group:
    """Replicas of one shape, simulated together."""

    index: int
    replicas: list[int]
    table: OpTable
    coeffs: StageCoefficients
    ops_by_stage: list[np.ndarray]
    consumers: np.ndarray  # (n_ops,) the op that receives each op's output over a link, or -1


@dataclass
class _Block:
    first: int
    starts_s: np.ndarray  # (n,) since job start
    durations_s: np.ndarray  # (n,)
    tokens: np.ndarray  # (n,) whole job
    parts: list[tuple[_Group, PipelineTiming, Packed]] = field(default_factory=list)
    wires: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per part: p2p and TP comm, (n·R, S, M)

    @property
    def n(self) -> int:
        return int(self.durations_s.shape[0])


class SimEngine:
    """A simulated job. Not thread-safe; one driver calls step / reconfigure / probe."""

    def __init__(self, config: SimConfig, faults: list[FaultSpec] | None = None) -> None:
        self.config = config
        c = config
        if c.plan.num_layers != c.model.layers:
            raise ValueError(f"plan has {c.plan.num_layers} layers but model {c.model.name} has {c.model.layers}")
        self._check_devices(c.plan)
        self.plan = c.plan
        self.iteration = 0
        self.now_s = 0.0  # simulated seconds since the job started
        self.finished = False
        self.events = DeterministicEvents(c.job)
        self.keyring = load_keyring()  # signs its acknowledgements as the executor, its ranks' probe results as rank
        self.run_id = c.run or "sim-" + hashlib.sha256(f"{c.job}/{c.seed}".encode()).hexdigest()[:16]
        self._pending = [(f.id or f"fault-{i}", f) for i, f in enumerate(faults or [])]
        self.active: list[ActiveFault] = []
        self.history: list[ActiveFault] = []
        self._effects = FaultEffects.of([], c.cluster)
        self._block: _Block | None = None
        self._next_heartbeat_s = 0.0
        self._hang_started_s: float | None = None
        self._seen_commands: set[str] = set()
        self._ranks: set[int] | None = None if c.telemetry == "all" else set() if c.telemetry == "none" else set(c.telemetry)
        self._plan_news: PlanCurrentReason | None = "start"  # announce the running plan with the next events
        self._setup_plan()

    # ---- plan --------------------------------------------------------------------------------

    def _check_devices(self, plan: Plan) -> None:
        bad = [d for d in plan.devices if d >= self.config.cluster.gpus]
        if bad:
            raise ValueError(f"plan uses devices {bad[:5]} beyond the cluster's {self.config.cluster.gpus} GPUs")

    def _setup_plan(self) -> None:
        shapes: dict[tuple[int, int], list[int]] = {}
        for pipe in self.plan.pipelines:
            shapes.setdefault((len(pipe.stages), pipe.microbatches), []).append(pipe.replica)
        self._groups = []
        for gi, ((S, M), reps) in enumerate(sorted(shapes.items())):
            table = op_table(self.plan.schedule, S, M, self.plan.virtual_stages)
            coeffs = stage_coefficients(self.config.model, self.config.cluster, self.plan, reps)
            self._groups.append(_Group(gi, reps, table, coeffs, stage_ops(table), transfer_consumers(table)))
        self._dp_allreduce_s = dp_allreduce_s(self.config.model, self.config.cluster, self.plan)
        m = self.config.model  # gradient bytes per TP rank, per replica and stage (replicas may differ in shape)
        self._dp_bytes = [[st.num_layers * m.params_per_layer // st.tp * m.bytes_per_value for st in pipe.stages]
                          for pipe in self.plan.pipelines]
        self._block = None
        self._tracing = tracing_of(self.config.dialect, self.plan, self.config.seed, self._ranks)
        # who sends RankIteration and heartbeats: the dialect's traced ranks (the telemetry option narrows them)
        traced = None if self._tracing is None or self._tracing.traced_ranks is None else set(self._tracing.traced_ranks)
        self._reporting: set[int] | None = traced if traced is not None else self._ranks

    # ---- faults ------------------------------------------------------------------------------

    def _triggered(self, spec: FaultSpec, iteration: int, t_s: float) -> bool:
        return (spec.at_iteration is not None and iteration >= spec.at_iteration) or (
            spec.at_s is not None and t_s >= spec.at_s)

    def _ended(self, f: ActiveFault, iteration: int, t_s: float) -> bool:
        s = f.spec
        return (s.duration_iterations is not None and iteration >= f.start_iteration + s.duration_iterations) or (
            s.duration_s is not None and t_s >= f.start_s + s.duration_s)

    def _update_faults(self) -> list[Envelope]:
        out = []
        k, t = self.iteration, self.now_s
        for f in [f for f in self.active if self._ended(f, k, t)]:
            f.end_iteration = k
            self.active.remove(f)
            out.append(self._truth(f))
        for fid, spec in [p for p in self._pending if self._triggered(p[1], k, t)]:
            self._pending.remove((fid, spec))
            f = ActiveFault(spec, fid, k, t)
            if spec.duration_iterations is not None:
                f.end_iteration = k + spec.duration_iterations
            self.active.append(f)
            self.history.append(f)
            out.append(self._truth(f))
        if out:
            self._effects = FaultEffects.of(self.active, self.config.cluster)
            self._block = None
        return out

    def _truth(self, f: ActiveFault) -> Envelope:
        payload: FaultInjected = truth_event_payload(f, self.config.cluster, self.plan)
        return self.events.make("simulator", payload, self._abs(self.now_s))

    def _changes_at(self, iteration: int, t_s: float) -> bool:
        return any(self._triggered(s, iteration, t_s) for _, s in self._pending) or any(
            self._ended(f, iteration, t_s) for f in self.active)

    @property
    def hanging_for_s(self) -> float:
        """How long the job has been stuck on a dead rank (0 when it runs)."""
        return 0.0 if self._hang_started_s is None else self.now_s - self._hang_started_s

    @property
    def dead(self) -> set[int]:
        return self._effects.dead

    def _abs(self, t_s: float) -> float:
        return self.config.start_time_s + t_s

    # ---- the timing core ---------------------------------------------------------------------

    def _block_size(self) -> int:
        if self.config.block_iterations:
            return self.config.block_iterations
        cells = sum(len(g.replicas) * g.table.n_ops for g in self._groups)
        return int(max(1, min(256, 4_000_000 // max(cells, 1))))

    def _compute_block(self) -> _Block:
        c, k0 = self.config, self.iteration
        n = self._block_size()
        eff = self._effects
        parts, wires = [], []
        ends = np.zeros(n)
        tokens = np.zeros(n)
        stalls = self._stalls(n, k0)
        for g in self._groups:
            R, S, M = len(g.replicas), g.table.stages, g.table.microbatches
            pipes = [self.plan.pipelines[r] for r in g.replicas]
            comp_f = np.array([[eff.compute_factor(st.devices) for st in p.stages] for p in pipes])
            tp_f = np.array([[eff.comm_factor(c.cluster, st.devices, st.devices) for st in p.stages] for p in pipes])
            p2p_f = np.array([[eff.comm_factor(c.cluster, st.devices, p.stages[(s + 1) % S].devices)
                               for s, st in enumerate(p.stages)] for p in pipes])
            wl_rngs = [np.random.default_rng([c.seed, k0 + j, g.index, 0]) for j in range(n)]
            packed = draw_microbatches(wl_rngs, c.workload, R, M)
            f_s, b_s, w_s, p2p_s, tp_s = self._durations(g, n, packed, comp_f, tp_f, p2p_f, k0, stalls[g.index])
            timing = pipeline_timing(g.table, f_s, b_s, w_s, p2p_s)
            wires.append((p2p_s, tp_s))
            ends = np.maximum(ends, timing.makespan_s.reshape(n, R).max(axis=1))
            tokens += packed.tokens.reshape(n, R * M).sum(axis=1)
            parts.append((g, timing, packed))
        dp_f = 1.0
        if self.plan.dp > 1 and (eff.links or eff.nics):
            dp_f = max(eff.comm_factor(c.cluster, tuple(self.plan.devices), tuple(self.plan.devices)), 1.0)
        durations = ends + self._dp_allreduce_s * dp_f
        starts = self.now_s + np.concatenate([[0.0], np.cumsum(durations)[:-1]])
        cut = next((j for j in range(1, n) if self._changes_at(k0 + j, starts[j])), n)
        if cut < n:  # a fault starts or ends inside: keep what ran under today's faults
            durations, starts, tokens = durations[:cut], starts[:cut], tokens[:cut]
        return _Block(k0, starts, durations, tokens, parts, wires)

    def _stalls(self, n: int, k0: int) -> dict[int, np.ndarray]:
        """The stalls of the block's iterations, group index → (n·R, S, M) seconds added to forwards.

        Drawn from (seed, iteration) alone, whatever the layout: a Poisson count with mean
        ``stall_probability`` × the plan's (replica, stage) pairs, exponential lengths, and a place
        drawn uniformly over the pairs (replicas in plan order) and the replica's micro-batches. Two
        runs of the same seed under different plans so meet the same stalls at the same iteration
        (common random numbers): a rare 1-s stall holds every replica's step, and drawn per group it
        made two strategies differ by ~1 % at 8,192 GPUs for nothing but luck."""
        nz = self.config.noise
        out = {g.index: np.zeros((n * len(g.replicas), g.table.stages, g.table.microbatches)) for g in self._groups}
        if not nz.stall_probability or not self._groups:
            return out
        owner: dict[int, tuple[_Group, int]] = {r: (g, i) for g in self._groups for i, r in enumerate(g.replicas)}
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

    def _durations(self, g: _Group, n: int, packed: Packed, comp_f: np.ndarray, tp_f: np.ndarray,
                   p2p_f: np.ndarray, k0: int, stall: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """Chunk durations, pipeline transfer times and the TP all-reduce time inside each F / B
        chunk, (n·R, S, M) each, rows iteration-major; ``stall`` from :meth:`_stalls`."""
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

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[Envelope]:
        """Advance one iteration (or one heartbeat interval while hung); return its events."""
        if self.finished:
            return []
        events = self._plan_announcement() + self._update_faults()
        if self.dead & set(self.plan.devices):
            return events + self._hang()
        self._hang_started_s = None
        if self._block is None or not (self._block.first <= self.iteration < self._block.first + self._block.n):
            self._block = self._compute_block()
        events += self._iteration_events(self._block, self.iteration - self._block.first)
        self.now_s += float(self._block.durations_s[self.iteration - self._block.first])
        self.iteration += 1
        events += self._heartbeats()
        return events

    def run(self, iterations: int) -> list[Envelope]:
        """Step until ``iterations`` more iterations completed (hung intervals do not count)."""
        target = self.iteration + iterations
        out: list[Envelope] = []
        while self.iteration < target and not self.finished:
            out += self.step()
        return out

    def iteration_durations(self, iterations: int) -> np.ndarray:
        """Truth only: the durations of the next ``iterations`` iterations, no events built
        (the fast path for benchmarks). Faults still start and end; a hang stops early."""
        out: list[float] = []
        while len(out) < iterations and not self.finished:
            self._update_faults()
            if self.dead & set(self.plan.devices):
                self._hang()
                continue
            if self._block is None or not (self._block.first <= self.iteration < self._block.first + self._block.n):
                self._block = self._compute_block()
            j = self.iteration - self._block.first
            take = min(self._block.n - j, iterations - len(out))
            # Never run past a scripted fault change: _compute_block cut the block there.
            d = self._block.durations_s[j:j + take]
            out.extend(d.tolist())
            self.now_s += float(d.sum())
            self.iteration += take
        return np.asarray(out)

    def _iteration_events(self, block: _Block, j: int) -> list[Envelope]:
        k = self.iteration
        dur = float(block.durations_s[j])
        t_end = self._abs(self.now_s + dur)
        out: list[Envelope] = []
        ranks, tracing = self._reporting, self._tracing
        if (ranks is None or ranks) and (tracing is None or tracing.step_traced(k)):
            for (g, timing, packed), (p2p_s, tp_s) in zip(block.parts, block.wires):
                R = len(g.replicas)
                for i, replica in enumerate(g.replicas):
                    row = j * R + i
                    if self.config.dialect in ("megatron", "profiler"):
                        payloads = dialect_rank_iterations(
                            dialect=self.config.dialect, plan=self.plan, cluster=self.config.cluster, model=self.config.model,
                            replica=replica, iteration=k, table=g.table, ops_by_stage=g.ops_by_stage,
                            consumers=g.consumers, start_s=timing.start_s[row], end_s=timing.end_s[row],
                            wire_s=p2p_s[row], tp_comm_s=tp_s[row], tokens=packed.tokens[row], iteration_s=dur,
                            dp_bytes=self._dp_bytes[replica], ranks=ranks)
                    else:
                        seq = [packed.seq_lens(row, m) for m in range(g.table.microbatches)]
                        payloads = replica_rank_iterations(
                            plan=self.plan, cluster=self.config.cluster, replica=replica, iteration=k, table=g.table,
                            ops_by_stage=g.ops_by_stage, start_s=timing.start_s[row], end_s=timing.end_s[row],
                            tokens=packed.tokens[row], seq_lens=seq, iteration_s=dur, dp_bytes=self._dp_bytes[replica],
                            ranks=ranks)
                    for p in payloads:
                        out.append(self.events.make(f"rank-{p.rank}", p, t_end))
        loss = 2.0 + 6.0 / math.sqrt(1.0 + k / 100.0)
        summary = IterationSummary(epoch=self.plan.epoch, iteration=k, loss=loss, tokens=int(block.tokens[j]), wall_s=dur)
        out.append(self.events.make("launcher", summary, t_end))
        return out

    def _heartbeats(self) -> list[Envelope]:
        out: list[Envelope] = []
        interval = self.config.heartbeat_interval_s
        while self._next_heartbeat_s <= self.now_s:
            t = self._next_heartbeat_s
            ranks = self._reporting  # untraced ranks send no heartbeats either: they are "not traced", not dead
            if ranks is None or ranks:
                alive = [d for d in range(self.config.cluster.gpus) if d not in self.dead
                         and (ranks is None or d in ranks)]
                for d in alive:
                    hb = Heartbeat(rank=d, epoch=self.plan.epoch, iteration=self.iteration, interval_s=interval)
                    out.append(self.events.make(f"rank-{d}", hb, self._abs(t)))
            self._next_heartbeat_s += interval
        return out

    def _hang(self) -> list[Envelope]:
        """The job waits on a dead rank: time passes to the next heartbeat, nothing completes."""
        if self._hang_started_s is None:
            self._hang_started_s = self.now_s
        self.now_s = max(self.now_s, self._next_heartbeat_s)
        events = self._heartbeats()
        limit = self.config.restart_after_s
        if limit is not None and self.now_s - self._hang_started_s >= limit:
            self._restart_without_dead()
        return events

    def idle(self, seconds: float) -> list[Envelope]:
        """The job is down for ``seconds`` (a restart from a checkpoint, say): nothing trains, but
        the cluster's clock runs. Faults start and end at their own times and every live rank keeps
        its heartbeat, so the heartbeats and the truth agree on when a device died during the
        downtime: a death is stamped when it happened, not when training resumed."""
        if seconds < 0:
            raise ValueError(f"idle needs a non-negative duration, got {seconds} s")
        end = self.now_s + seconds
        events = self._update_faults()
        while self.now_s < end:
            self.now_s = min(end, self._next_heartbeat_s, self._next_fault_change_s())
            events += self._update_faults() + self._heartbeats()
        return events

    def _next_fault_change_s(self) -> float:
        """When the next timed fault starts or ends (inf when none is due after now)."""
        times = [s.at_s for _, s in self._pending if s.at_s is not None]
        times += [f.start_s + f.spec.duration_s for f in self.active if f.spec.duration_s is not None]
        return min((t for t in times if t > self.now_s), default=math.inf)

    def _restart_without_dead(self) -> None:
        """Open loop only: what an elastic launcher does — drop every replica that lost a device
        and give its micro-batches to the survivors, at the next epoch."""
        try:
            survivors = drop_replicas(self.plan, self.dead)
        except ValueError:
            self.finished = True
            return
        self._switch(survivors, "restart")
        self._hang_started_s = None

    def _switch(self, plan: Plan, reason: PlanCurrentReason = "reshape") -> None:
        self.plan = Plan.model_validate(plan.model_dump())  # re-validate the copy (model_copy does not)
        self._plan_news = reason
        self._setup_plan()

    def _plan_announcement(self) -> list[Envelope]:
        """plan.current once after start and after every switch, as the trainer publishes it."""
        if self._plan_news is None:
            return []
        c = self.config
        payload = PlanCurrent(
            plan=self.plan, reason=self._plan_news, gpus_per_node=c.cluster.gpus_per_node, model_name=c.model.name,
            # bf16 weights and gradients, fp32 master weights and two Adam moments: 16 bytes a parameter
            layer_state_bytes=c.model.params_per_layer * 16,
            tokens_per_microbatch=c.workload.tokens_per_microbatch, run=self.run_id,
        )
        self._plan_news = None
        out = [self.keyring.sign(self.events.make("trainer", payload, self._abs(self.now_s)), "executor")]
        if self._tracing is not None:  # what the ranks record under this plan (ours declares nothing)
            out.append(self.events.make("trainer", self._tracing, self._abs(self.now_s)))
        return out

    # ---- the closed loop ---------------------------------------------------------------------

    def reconfigure(self, command: ReconfigureCommand) -> list[Envelope]:
        """Apply ``command`` if it moves epoch e to e+1; ack it either way (the trainer's fence)."""
        events = self._update_faults()
        plan, current = command.plan, self.plan.epoch
        status, detail, pause = AckStatus.APPLIED, "", 0.0
        fenced, fence_detail = fence_verdict(command, current, self._seen_commands)
        if fenced is not None:
            status, detail = fenced, fence_detail
        elif plan.num_layers != self.config.model.layers:
            status, detail = AckStatus.FAILED, f"plan has {plan.num_layers} layers; the model has {self.config.model.layers}"
        elif [d for d in plan.devices if d >= self.config.cluster.gpus]:
            status, detail = AckStatus.FAILED, "plan names devices beyond the cluster"
        elif self.dead & set(plan.devices):
            status, detail = AckStatus.FAILED, f"plan uses dead devices {sorted(self.dead & set(plan.devices))}"
        elif tp_problem := plan.tp_split_problem(self.config.model.heads):
            status, detail = AckStatus.FAILED, tp_problem
        self._seen_commands.add(command.command_id)
        if status is AckStatus.APPLIED:
            pause = self.config.rebalance_pause_s if self.plan.same_stages(plan) else self.config.reshape_pause_s
            self._switch(plan)
            self.now_s += pause
            self._hang_started_s = None
            detail = f"now {self.plan.shape()}"
        ack = CommandAck(command_id=command.command_id, plan_id=command.plan_id, epoch=plan.epoch, status=status,
                         running_epoch=self.plan.epoch, pause_s=pause, detail=detail, run=self.run_id)
        events.append(self.keyring.sign(self.events.make("trainer", ack, self._abs(self.now_s)), "executor"))
        return events + self._plan_announcement() + self._heartbeats()

    def handle(self, event: Envelope, gate: Gate) -> list[Envelope]:
        """Obey a control event read from the bus if ``gate`` admits it and (a probe) it is within
        bounds; the events that follow, refusals included (as ``control.rejected``)."""
        p = event.payload
        out: list[Envelope] = []
        if isinstance(p, (ReconfigureCommand, ProbeRequest)) and gate.admit(event, self._abs(self.now_s)):
            if isinstance(p, ReconfigureCommand):
                if (refusal := order_refusal(p, self.run_id, event.time_s, self._abs(self.now_s))) is not None:
                    gate.refuse(event, refusal, self._abs(self.now_s))
                else:
                    out = self.reconfigure(p)
            elif (refusal := probe_refusal(p, range(self.config.cluster.gpus))) is not None:
                gate.refuse(event, refusal, self._abs(self.now_s))
            else:
                out = self.probe(p)
        return gate.take() + out

    def probe(self, request: ProbeRequest) -> list[Envelope]:
        """Each live rank runs a fixed workload alone; dead ranks do not answer."""
        out = self._update_faults()
        c, eff = self.config, self._effects
        rng = np.random.default_rng([c.seed, self.iteration, zlib.crc32(request.probe_id.encode()), 2])
        longest = 0.0
        for d in request.ranks:
            if d in self.dead or d >= c.cluster.gpus:
                continue
            if request.target == "compute":
                factor = eff.compute.get(d, 1.0)
            else:
                factor = max([eff.nics.get(d, 1.0)] + [f for key, f in eff.links.items() if d in key])
            samples = c.probe_reference_s * factor * np.exp(c.noise.chunk_sigma * rng.standard_normal(request.repeats))
            duration = float(samples.mean())
            longest = max(longest, float(samples.sum()))
            result = ProbeResult(probe_id=request.probe_id, rank=d, duration_s=duration, reference_s=c.probe_reference_s)
            out.append(self.keyring.sign(self.events.make(f"rank-{d}", result, self._abs(self.now_s + float(samples.sum()))),
                                         "rank"))
        self.now_s += longest
        return out
