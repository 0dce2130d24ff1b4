"""The simulator engine: steppable, one iteration at a time, computed in vectorised blocks.

``SimEngine.step()`` returns the events of one iteration (or, while the job hangs on a dead rank,
of one heartbeat interval). Internally it computes blocks of iterations at once
(trainer/sim/timing.py) — every replica and every iteration of the block is one row of
:func:`analytics.detection.schedule.pipeline_timing` — and cuts a block where a fault starts or
ends, so the numbers do not depend on the block size: each
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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from collector.auth import Gate, load_keyring
from collector.epoch_fence import fence_verdict, order_refusal
from collector.events import (
    AckStatus, CommandAck, Envelope, FaultInjected, Heartbeat, IterationSummary, ProbeRequest, ProbeResult,
    PlanCurrent, PlanCurrentReason, RankIteration, ReconfigureCommand,
)
from collector.plan import Plan
from collector.replica_drop import drop_replicas
from trainer.integration import probe_refusal
from trainer.sim.faults import ActiveFault, FaultSchedule, FaultSpec, truth_event_payload
from trainer.sim.presets import ClusterSpec, ModelSpec
from trainer.sim.telemetry import (
    Dialect, DeterministicEvents, dialect_rank_iterations, replica_rank_iterations, tracing_of,
)
from trainer.sim.timing import Block, PlanTiming
from trainer.sim.workload import WorkloadSpec

if TYPE_CHECKING:
    from trainer.sim.wire import RankWire

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
    declares_waits: bool = Field(default=True, description=(
        "whether a dialect whose p2p timers hold waits (megatron, profiler) says so (fused_p2p, includes_wait); "
        "false records the same timers unsaid, as a producer that skipped docs/dialects.md does"))

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        """A starting plan no trainer could cut the model to is refused, as a real launcher would."""
        if problem := self.plan.tp_split_problem(self.model.heads):
            raise ValueError(problem)
        return self


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
        self.faults = FaultSchedule(faults or [], c.cluster)
        self._block: Block | None = None
        self._next_heartbeat_s = 0.0
        self._hang_started_s: float | None = None
        self._seen_commands: set[str] = set()
        self._ranks: set[int] | None = None if c.telemetry == "all" else set() if c.telemetry == "none" else set(c.telemetry)
        self._plan_news: PlanCurrentReason | None = "start"  # announce the running plan with the next events
        self._rank_wire: RankWire | None = None
        self._setup_plan()

    @property
    def rank_wire(self) -> RankWire | None:
        """Where the ranks' reports and heartbeats go instead of ``step()``'s events (None: they are
        events). Open loop only, installed before the first step: the wire numbers the ranks'
        events itself, and a closed loop's probe results would number them through the engine."""
        return self._rank_wire

    @rank_wire.setter
    def rank_wire(self, wire: RankWire | None) -> None:
        if self.iteration or self.now_s or self._next_heartbeat_s:
            raise ValueError("install a rank wire before the engine's first step: it numbers the ranks' events "
                             "from their first")
        self._rank_wire = wire

    # ---- plan --------------------------------------------------------------------------------

    def _check_devices(self, plan: Plan) -> None:
        bad = [d for d in plan.devices if d >= self.config.cluster.gpus]
        if bad:
            raise ValueError(f"plan uses devices {bad[:5]} beyond the cluster's {self.config.cluster.gpus} GPUs")

    def _setup_plan(self) -> None:
        self._timing = PlanTiming(self.config, self.plan)
        self._block = None
        self._tracing = tracing_of(self.config.dialect, self.plan, self.config.seed, self._ranks,
                                   self.config.declares_waits)
        # who sends RankIteration and heartbeats: the dialect's traced ranks (the telemetry option narrows them)
        traced = None if self._tracing is None or self._tracing.traced_ranks is None else set(self._tracing.traced_ranks)
        self._reporting: set[int] | None = traced if traced is not None else self._ranks
        if self._rank_wire is not None:
            self._rank_wire.plan_changed(self.plan)

    # ---- faults ------------------------------------------------------------------------------

    @property
    def active(self) -> list[ActiveFault]:
        return self.faults.active

    @property
    def history(self) -> list[ActiveFault]:
        """Every fault that started, in order."""
        return self.faults.history

    def _update_faults(self) -> list[Envelope]:
        """The faults' changes now, as their truth events; a change drops the block computed under
        the faults before it."""
        changed = self.faults.update(self.iteration, self.now_s)
        if changed:
            self._block = None
        return [self._truth(f) for f in changed]

    def _truth(self, f: ActiveFault) -> Envelope:
        payload: FaultInjected = truth_event_payload(f, self.config.cluster, self.plan)
        return self.events.make("simulator", payload, self._abs(self.now_s))

    @property
    def hanging_for_s(self) -> float:
        """How long the job has been stuck on a dead rank (0 when it runs)."""
        return 0.0 if self._hang_started_s is None else self.now_s - self._hang_started_s

    @property
    def dead(self) -> set[int]:
        return self.faults.effects.dead

    def _abs(self, t_s: float) -> float:
        return self.config.start_time_s + t_s

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[Envelope]:
        """Advance one iteration (or one heartbeat interval while hung); return its events."""
        if self.finished:
            return []
        events = self._plan_announcement() + self._update_faults()
        if self.dead & set(self.plan.devices):
            return events + self._hang()
        self._hang_started_s = None
        block = self._current_block()
        events += self._iteration_events(block, self.iteration - block.first)
        self.now_s += float(block.durations_s[self.iteration - block.first])
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
            block = self._current_block()
            j = self.iteration - block.first
            take = min(block.n - j, iterations - len(out))
            # Never run past a scripted fault change: PlanTiming.block cut the block there.
            d = block.durations_s[j:j + take]
            out.extend(d.tolist())
            self.now_s += float(d.sum())
            self.iteration += take
        return np.asarray(out)

    def _current_block(self) -> Block:
        """The block holding the current iteration, computed when the last one ran out (or a
        fault or a plan change dropped it)."""
        if self._block is None or not (self._block.first <= self.iteration < self._block.first + self._block.n):
            self._block = self._timing.block(self.iteration, self.now_s, self.faults.effects, self.faults.changes_at)
        return self._block

    def _iteration_events(self, block: Block, j: int) -> list[Envelope]:
        k = self.iteration
        dur = float(block.durations_s[j])
        t_end = self._abs(self.now_s + dur)
        out: list[Envelope] = []
        ranks, tracing = self._reporting, self._tracing
        if (ranks is None or ranks) and (tracing is None or tracing.step_traced(k)) and self._rank_wire is not None:
            self._rank_wire.reports(block, j, k, t_end, ranks)
        elif (ranks is None or ranks) and (tracing is None or tracing.step_traced(k)):
            for p in _rank_iterations(self.config, self.plan, self._timing.dp_bytes, block, j, k, ranks):
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
                if self._rank_wire is not None:
                    self._rank_wire.heartbeats(alive, self.plan.epoch, self.iteration, interval, self._abs(t))
                    alive = []
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
            self.now_s = min(end, self._next_heartbeat_s, self.faults.next_change_s(self.now_s))
            events += self._update_faults() + self._heartbeats()
        return events

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
        c, eff = self.config, self.faults.effects
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


def _rank_iterations(config: SimConfig, plan: Plan, dp_bytes: list[list[int]], block: Block, j: int, iteration: int,
                     ranks: set[int] | None, replicas: set[int] | None = None) -> Iterator[RankIteration]:
    """The ``RankIteration`` payloads of iteration ``j`` of ``block``, every replica's (``replicas``:
    only these), as the configured dialect records them (``ranks``: the ranks that report, None: all)."""
    dur = float(block.durations_s[j])
    for (g, timing, packed), (p2p_s, tp_s) in zip(block.parts, block.wires):
        R = len(g.replicas)
        for i, replica in enumerate(g.replicas):
            if replicas is not None and replica not in replicas:
                continue
            row = j * R + i
            if config.dialect in ("megatron", "profiler"):
                payloads = dialect_rank_iterations(
                    dialect=config.dialect, plan=plan, cluster=config.cluster, model=config.model,
                    replica=replica, iteration=iteration, table=g.table, ops_by_stage=g.ops_by_stage,
                    consumers=g.consumers, start_s=timing.start_s[row], end_s=timing.end_s[row],
                    wire_s=p2p_s[row], tp_comm_s=tp_s[row], tokens=packed.tokens[row], iteration_s=dur,
                    dp_bytes=dp_bytes[replica], ranks=ranks, declares_waits=config.declares_waits)
            else:
                seq = [packed.seq_lens(row, m) for m in range(g.table.microbatches)]
                payloads = replica_rank_iterations(
                    plan=plan, cluster=config.cluster, replica=replica, iteration=iteration, table=g.table,
                    ops_by_stage=g.ops_by_stage, start_s=timing.start_s[row], end_s=timing.end_s[row],
                    tokens=packed.tokens[row], seq_lens=seq, iteration_s=dur, dp_bytes=dp_bytes[replica],
                    ranks=ranks)
            yield from payloads
