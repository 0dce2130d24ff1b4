"""The events the real trainer emits, built from simulated timings.

Exactly the trainer's contract: one ``RankIteration`` per rank per iteration (every F / B / W chunk
with tokens, packed sequence lengths, local start offset and duration; measured waits for pipeline
receives and for the DP all-reduce), one ``IterationSummary`` per iteration, ``Heartbeat`` per
live rank per interval. All TP ranks of a stage run in lock-step, so they report the same chunks.

Event ids are uuid5 of (job, source, seq), so the same run produces byte-identical events.

That is the ``ours`` dialect. Real trainers record the same run differently, and the simulator can
record it their way too (docs/dialects.md), from the same timeline: ``megatron`` (one traced rank
per TP group, p2p as fused send+recv timers that hold the wait for the peer, no sequence lengths
or token counts), ``profiler`` (what torch.profiler/Kineto shows every rank: blocking pp_send /
pp_recv kernels that hold waits, collectives labelled by process group, no lengths, tokens or node
ids) and ``sampled`` (ours, on a declared subset of ranks and every 2nd step). A p2p record's
transfer part is the simulator's own wire time (message bytes / bandwidth, times a slow link's
factor), so a slow link lengthens a fused timer even where no wait hides in it.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from analytics.detection.schedule import KIND_NAMES, OpTable
from collector.events import (
    ChunkKind, ChunkTable, CommOp, CommWait, Coords, Envelope, EventFactory, Payload, RankIteration, TracingDeclared,
)
from collector.plan import PipelinePlan, Plan, StagePlan
from trainer.sim.presets import ClusterSpec, ModelSpec

Dialect = Literal["ours", "megatron", "profiler", "sampled"]
DIALECTS: tuple[str, ...] = ("ours", "megatron", "profiler", "sampled")
SAMPLED_STEP_EVERY = 2  # the sampled dialect traces every 2nd iteration

_ID_NAMESPACE = uuid.UUID("0b7d3f0e-8a51-4f5e-9a8e-5d3c9b1f2a61")
_ID_NAMESPACE_BYTES = _ID_NAMESPACE.bytes  # UUID.bytes is computed at every read
_KINDS = [ChunkKind(k) for k in KIND_NAMES]


class DeterministicEvents:
    """One EventFactory per source, with ids derived from (job, source, seq)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._factories: dict[str, EventFactory] = {}
        self._counts: dict[str, int] = {}

    def make(self, source: str, payload: Payload, time_s: float) -> Envelope:
        factory = self._factories.get(source)
        if factory is None:
            factory = self._factories[source] = EventFactory(self.job, source)
        n = self._counts.get(source, 0)
        self._counts[source] = n + 1
        return factory.make(payload, time_s=time_s, event_id=deterministic_id(self.job, source, n))

    def numbered(self, source: str, payload: Payload, time_s: float, n: int) -> Envelope:
        """The ``n``-th event of ``source``, for a producer that keeps that source's count itself
        (trainer/sim/wire.py); this object's own count of it does not move."""
        return EventFactory(self.job, source, first_seq=n).make(payload, time_s=time_s,
                                                                 event_id=deterministic_id(self.job, source, n))


def deterministic_id(job: str, source: str, n: int) -> str:
    """The id of the ``n``-th event of ``source`` in ``job``: uuid5 of (job, source, n), written
    out from its hash (``uuid.uuid5`` costs ~4x as much a call, at 100k ranks 0.4 s a step)."""
    digest = bytearray(hashlib.sha1(_ID_NAMESPACE_BYTES + f"{job}/{source}/{n}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    return digest.hex()


def stage_ops(table: OpTable) -> list[np.ndarray]:
    """Op indices of each stage, in the order the stage runs them."""
    out = []
    for s in range(table.stages):
        idx = np.flatnonzero(table.stage == s)
        out.append(idx[np.argsort(table.position[idx])])
    return out


def _traced_stages(pipe: PipelinePlan, table: OpTable, ops_by_stage: list[np.ndarray], start_s: np.ndarray,
                   end_s: np.ndarray, ranks: set[int] | None) -> Iterator[tuple]:
    """Per stage of ``pipe`` with a rank to report: (stage index, stage, TP indices that report, op
    indices in run order, their starts, ends, kinds and micro-batches as lists). Every dialect walks
    the same timeline this way; only what it records from it differs."""
    for s, stage in enumerate(pipe.stages):
        wanted = [t for t, d in enumerate(stage.devices) if ranks is None or d in ranks]
        if not wanted:
            continue
        idx = ops_by_stage[s]
        yield (s, stage, wanted, idx, start_s[idx].tolist(), end_s[idx].tolist(), table.kind[idx].tolist(),
               table.microbatch[idx].tolist())


def replica_rank_iterations(
    *,
    plan: Plan,
    cluster: ClusterSpec,
    replica: int,
    iteration: int,
    table: OpTable,
    ops_by_stage: list[np.ndarray],
    start_s: np.ndarray,  # (n_ops,) of this replica's row, offsets from the iteration start
    end_s: np.ndarray,  # (n_ops,)
    tokens: np.ndarray,  # (M,)
    seq_lens: list[list[int]],  # per micro-batch
    iteration_s: float,
    dp_bytes: list[int],  # per stage, gradient bytes per TP rank
    ranks: set[int] | None,
) -> list[RankIteration]:
    """The RankIteration payloads of one replica's ranks (``ranks``: only these; None: all)."""
    pipe = plan.pipelines[replica]
    S = table.stages
    out: list[RankIteration] = []
    tok = tokens.tolist()
    for s, stage, wanted, idx, st, en, kinds, mbs in _traced_stages(pipe, table, ops_by_stage, start_s, end_s, ranks):
        chunks_v = table.chunk[idx].tolist()
        links = table.link[idx].tolist()
        # Columns straight from the schedule arrays: one table shared by the stage's TP ranks.
        chunks = ChunkTable.model_construct(
            kind="".join(_KINDS[k].value for k in kinds), microbatch=mbs, virtual_stage=chunks_v,
            tokens=[tok[m] for m in mbs], seq_lens=[seq_lens[m] for m in mbs], start_s=st,
            duration_s=[b - a for a, b in zip(st, en)],
        )
        comm: list[CommWait] = []
        prev_end = 0.0
        for k, m, a, b, link in zip(kinds, mbs, st, en, links):
            if link >= 0 and a > prev_end + 1e-12:
                peer_stage = (s - 1) % S if k == 0 else (s + 1) % S
                comm.append(CommWait.model_construct(
                    op=CommOp.PP_RECV, peer=pipe.stages[peer_stage].devices[0], microbatch=m, bytes=None,
                    start_s=prev_end, duration_s=a - prev_end))
            prev_end = b
        if plan.dp > 1:
            comm.append(CommWait.model_construct(op=CommOp.DP_ALLREDUCE, peer=None, microbatch=None,
                                                 bytes=dp_bytes[s], start_s=prev_end,
                                                 duration_s=max(0.0, iteration_s - prev_end)))
        for t, d in enumerate(stage.devices):
            if t not in wanted:
                continue
            out.append(RankIteration(
                epoch=plan.epoch, iteration=iteration, rank=d, node=cluster.node_of(d),
                coords=Coords(tp=t, pp=s, dp=replica), wall_s=iteration_s, chunk_table=chunks, comm=comm,
            ))
    return out


# ---- the dialects of real trainers ---------------------------------------------------------------


def tracing_of(dialect: Dialect, plan: Plan, seed: int, ranks: set[int] | None,
               declares_waits: bool = True) -> TracingDeclared | None:
    """What a producer of ``dialect`` declares under ``plan`` (None for ours: it declares nothing,
    and every rank reports). ``ranks``: the simulator's telemetry option, which narrows the traced set.
    ``declares_waits`` false: the producer leaves ``fused_p2p`` unsaid although its timers hold waits
    (a user who skipped docs/dialects.md).

    megatron traces TP rank 0 of every stage; sampled traces every second DP replica (replicas 0, 2,
    …) when there are two or more, otherwise a quarter of the TP groups drawn with ``seed`` (at
    least one), and every 2nd step of either."""
    if dialect == "ours":
        return None
    if dialect == "profiler":
        return TracingDeclared(epoch=plan.epoch, dialect=dialect, traced_ranks=None if ranks is None else sorted(ranks),
                               seq_lens=False, tokens=False, fused_p2p=declares_waits)
    if dialect == "megatron":
        traced = [st.devices[0] for pipe in plan.pipelines for st in pipe.stages]
        extra: dict = dict(seq_lens=False, tokens=False, fused_p2p=declares_waits)
    else:
        if plan.dp >= 2:
            groups = [st.devices for pipe in plan.pipelines if pipe.replica % 2 == 0 for st in pipe.stages]
        else:
            every = [st.devices for pipe in plan.pipelines for st in pipe.stages]
            rng = np.random.default_rng([seed, 33])
            pick = rng.choice(len(every), size=max(1, len(every) // 4), replace=False)
            groups = [every[i] for i in sorted(pick.tolist())]
        traced = [d for devs in groups for d in devs]
        extra = dict(step_every=SAMPLED_STEP_EVERY, step_offset=0)
    if ranks is not None:
        traced = [d for d in traced if d in ranks]
    return TracingDeclared(epoch=plan.epoch, dialect=dialect, traced_ranks=sorted(traced), **extra)


def transfer_consumers(table: OpTable) -> np.ndarray:
    """(n_ops,) the op that receives each op's output over a pipeline link, or -1 (no transfer:
    the last virtual stage's forward feeds its own backward, and W sends nothing)."""
    out = np.full(table.n_ops, -1)
    has = table.link >= 0
    out[table.dep[has]] = np.flatnonzero(has)
    return out


def dialect_rank_iterations(
    *,
    dialect: Literal["megatron", "profiler"],
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    replica: int,
    iteration: int,
    table: OpTable,
    ops_by_stage: list[np.ndarray],
    consumers: np.ndarray,  # transfer_consumers(table)
    start_s: np.ndarray,  # (n_ops,) this replica's row
    end_s: np.ndarray,  # (n_ops,)
    wire_s: np.ndarray,  # (S, M) the simulator's transfer time over link s -> (s+1) % S, faults included
    tp_comm_s: np.ndarray,  # (S, M) TP all-reduce time inside each F / B chunk
    tokens: np.ndarray,  # (M,)
    iteration_s: float,
    dp_bytes: list[int],
    ranks: set[int] | None,
    declares_waits: bool = True,
) -> list[RankIteration]:
    """The RankIteration payloads of one replica's ranks as Megatron-LM's timers or torch.profiler
    record them, from the same timeline as :func:`replica_rank_iterations`. ``declares_waits``
    false: the same timers, their records not saying that they hold waits (``includes_wait`` false).

    A stage calls its p2p op when its previous chunk ends (``b``) and its next chunk starts when the
    op returns (``a``): the op holds the wait for the peer and the transfer. Megatron fuses the send
    of the previous chunk's output and the receive of the next chunk's input into one timer, ending
    at ``max(a, b + send wire)``; the profiler sees the receive kernel (``b`` to ``max(a, b + wire)``)
    and the send kernel apart, the send holding the wait until the peer posts its receive (when the
    peer's chunk before the consuming one ends) and then the wire time."""
    pipe = plan.pipelines[replica]
    timers = _P2PTimers(dialect, pipe, table, np.append(end_s, 0.0), model.hidden * model.bytes_per_value,
                        tokens.tolist(), tp_comm_s, declares_waits)
    out: list[RankIteration] = []
    for s, stage, wanted, idx, st, en, kinds, mbs in _traced_stages(pipe, table, ops_by_stage, start_s, end_s, ranks):
        chunks = ChunkTable.model_construct(
            kind="".join(_KINDS[k].value for k in kinds), microbatch=mbs, virtual_stage=table.chunk[idx].tolist(),
            tokens=[None] * len(idx), seq_lens=[None] * len(idx), start_s=st, duration_s=[b - a for a, b in zip(st, en)],
        )
        recv, send = timers.transfers(idx, consumers, wire_s)
        for t in wanted:
            if dialect == "megatron":
                comm = timers.fused(recv, send, st, en, mbs, t)
            else:
                comm = timers.kernels(s, stage, recv, send, st, en, kinds, mbs, t)
            last = max(en) if en else 0.0
            if plan.dp > 1:
                profiler = dialect == "profiler"
                comm.append(CommWait.model_construct(
                    op=CommOp.DP_ALLREDUCE, peer=None, microbatch=None, bytes=dp_bytes[s], start_s=last,
                    duration_s=max(0.0, iteration_s - last), includes_wait=profiler, group="dp" if profiler else None))
            out.append(RankIteration(
                epoch=plan.epoch, iteration=iteration, rank=stage.devices[t],
                node=None if dialect == "profiler" else cluster.node_of(stage.devices[t]),
                coords=Coords(tp=t, pp=s, dp=replica), wall_s=iteration_s, chunk_table=chunks, comm=comm,
            ))
    return out


Received = tuple[int, int, float]  # a transfer an op receives: (link, peer stage, wire s)
Sent = tuple[int, int, float, int]  # a transfer an op sends: (link, peer stage, wire s, the consumer op)


@dataclass(frozen=True)
class _P2PTimers:
    """One replica's pipeline transfers as Megatron-LM's fused timers (:meth:`fused`) or as
    torch.profiler's kernels (:meth:`kernels`), for :func:`dialect_rank_iterations`."""

    dialect: Literal["megatron", "profiler"]
    pipe: PipelinePlan
    table: OpTable
    ends: np.ndarray  # (n_ops + 1,) each op's end; index n_ops: "no op" ends at the iteration start
    hidden_bytes: int
    tokens: list  # (M,)
    tp_comm_s: np.ndarray  # (S, M)
    declares_waits: bool = True  # false: p2p records do not say that they hold waits (the timers still do)

    def peer(self, stage_index: int, t: int) -> int:
        """The rank a TP rank ``t`` exchanges with in ``stage_index``: Megatron traces one per TP group."""
        devices = self.pipe.stages[stage_index].devices
        return devices[0] if self.dialect == "megatron" else devices[min(t, len(devices) - 1)]

    def msg_bytes(self, link: int, m: int) -> int:
        pipe = self.pipe
        return int(self.tokens[m]) * self.hidden_bytes // min(pipe.stages[link].tp,
                                                              pipe.stages[(link + 1) % self.table.stages].tp)

    def transfers(self, idx: np.ndarray, consumers: np.ndarray,
                  wire_s: np.ndarray) -> tuple[list[Received | None], list[Sent | None]]:
        """Per op position of a stage: the transfer it receives and the one it sends (None: none)."""
        table = self.table
        recv: list[Received | None] = []
        send: list[Sent | None] = []
        for j in idx.tolist():
            link, m = int(table.link[j]), int(table.microbatch[j])
            recv.append(None if link < 0 else (link, int(table.stage[table.dep[j]]), float(wire_s[link, m])))
            c = int(consumers[j])
            lc = int(table.link[c]) if c >= 0 else -1
            send.append(None if c < 0 else (lc, int(table.stage[c]), float(wire_s[lc, m]), c))
        return recv, send

    def fused(self, recv: list[Received | None], send: list[Sent | None], st: list, en: list, mbs: list,
              t: int) -> list[CommWait]:
        """Megatron's timers: one fused send+recv per gap between chunks, ending at
        ``max(next start, previous end + send wire)``; no byte counts."""
        comm: list[CommWait] = []
        for k in range(len(recv) + 1):  # the gap before chunk k (k = len: after the last chunk)
            r = recv[k] if k < len(recv) else None
            snd = send[k - 1] if k > 0 else None
            if r is not None:
                peer_stage = r[1]
            elif snd is not None:
                peer_stage = snd[1]
            else:
                continue
            b = en[k - 1] if k > 0 else 0.0
            end = st[k] if r is not None else b
            if snd is not None:
                end = max(end, b + snd[2])
            m = mbs[k] if r is not None else mbs[k - 1]
            comm.append(CommWait.model_construct(
                op=CommOp.PP_SENDRECV, peer=self.peer(peer_stage, t), microbatch=m,
                bytes=None, start_s=b, duration_s=end - b, includes_wait=self.declares_waits, group=None))
        return comm

    def kernels(self, s: int, stage: StagePlan, recv: list[Received | None], send: list[Sent | None], st: list, en: list,
                kinds: list, mbs: list, t: int) -> list[CommWait]:
        """The profiler's kernels: the receive (from the previous chunk's end until the input is
        there), the send (holding the wait until the peer posts its receive, then the wire) and
        each chunk's TP all-reduces on the TP group."""
        table, ends, prev, n = self.table, self.ends, self.table.prev_on_stage, self.table.n_ops
        V = table.virtual_stages
        comm: list[CommWait] = []
        for k in range(len(recv)):
            b = en[k - 1] if k > 0 else 0.0
            r = recv[k]
            if r is not None:
                comm.append(CommWait.model_construct(
                    op=CommOp.PP_RECV, peer=self.peer(r[1], t), microbatch=mbs[k], bytes=self.msg_bytes(r[0], mbs[k]),
                    start_s=b, duration_s=max(st[k], b + r[2]) - b, includes_wait=self.declares_waits, group="pp"))
            snd = send[k]
            if snd is not None:
                posted = float(ends[prev[snd[3]]]) if prev[snd[3]] < n else 0.0
                comm.append(CommWait.model_construct(
                    op=CommOp.PP_SEND, peer=self.peer(snd[1], t), microbatch=mbs[k],
                    bytes=self.msg_bytes(snd[0], mbs[k]), start_s=en[k],
                    duration_s=max(en[k], posted) + snd[2] - en[k], includes_wait=self.declares_waits, group="pp"))
            if stage.tp > 1 and kinds[k] != 2:  # the chunk's TP all-reduces, on the TP group
                # a stage's time is spread evenly over its V model chunks (analytics/detection/schedule.py),
                # its TP all-reduces too: each model chunk holds 1/V of them
                comm.append(CommWait.model_construct(
                    op=CommOp.TP_ALLREDUCE, peer=None, microbatch=mbs[k],
                    bytes=2 * stage.num_layers * int(self.tokens[mbs[k]]) * self.hidden_bytes // V, start_s=st[k],
                    duration_s=float(self.tp_comm_s[s, mbs[k]]) / V, includes_wait=True, group="tp"))
        return comm
