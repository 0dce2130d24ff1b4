"""The events the real trainer emits, built from simulated timings.

Exactly the trainer's contract: one ``RankIteration`` per rank per iteration (every F / B / W chunk
with tokens, packed sequence lengths, local start offset and duration; measured waits for pipeline
receives and for the DP all-reduce), one ``IterationSummary`` per iteration, ``Heartbeat`` per
live rank per interval. All TP ranks of a stage run in lock-step, so they report the same chunks.

Event ids are uuid5 of (job, source, seq), so the same run produces byte-identical events.
"""

from __future__ import annotations

import uuid

import numpy as np

from analytics.schedule import KIND_NAMES, OpTable
from collector.events import (
    ChunkKind, ChunkTable, CommOp, CommWait, Coords, Envelope, EventFactory, Payload, RankIteration,
)
from collector.plan import Plan
from trainer.sim.presets import ClusterSpec

_ID_NAMESPACE = uuid.UUID("0b7d3f0e-8a51-4f5e-9a8e-5d3c9b1f2a61")
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
        return factory.make(payload, time_s=time_s, event_id=uuid.uuid5(_ID_NAMESPACE, f"{self.job}/{source}/{n}").hex)


def stage_ops(table: OpTable) -> list[np.ndarray]:
    """Op indices of each stage, in the order the stage runs them."""
    out = []
    for s in range(table.stages):
        idx = np.flatnonzero(table.stage == s)
        out.append(idx[np.argsort(table.position[idx])])
    return out


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
    for s, stage in enumerate(pipe.stages):
        wanted = [d for d in stage.devices if ranks is None or d in ranks]
        if not wanted:
            continue
        idx = ops_by_stage[s]
        st = start_s[idx].tolist()
        en = end_s[idx].tolist()
        kinds = table.kind[idx].tolist()
        mbs = table.microbatch[idx].tolist()
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
            if d not in wanted:
                continue
            out.append(RankIteration(
                epoch=plan.epoch, iteration=iteration, rank=d, node=cluster.node_of(d),
                coords=Coords(tp=t, pp=s, dp=replica), wall_s=iteration_s, chunk_table=chunks, comm=comm,
            ))
    return out
