"""Rank telemetry straight to bus records: how the simulator publishes a 100k-rank step quickly.

``SimEngine.step()`` builds every rank report and heartbeat as a pydantic event, and the bus then
encodes each one: at 99,968 ranks that is ~7 s of building and ~3 s of encoding a step, all of it
Python work per rank. A ``RankWire`` installed on the engine (``engine.rank_wire``) takes over the
ranks' events of the ``ours`` dialect and writes their records directly: a stage's columns are
encoded once from the schedule's arrays and shared by its TP ranks (they report the same chunks),
and each rank adds only its header. The records are byte for byte what ``collector.codec.encode``
gives for the events ``step()`` would have built, with the keys ``PartitionKeys`` gives them and
the same ids and sequence numbers (``tests/test_sim_publishers.py`` proves it on faults, hangs and
restarts). Other dialects go through the events, restricted to the wire's replicas.

A wire owns some replicas (``owned``: the rank reports of their ranks, and those ranks'
heartbeats) and, optionally, the heartbeats of ranks no replica holds. Several engines of one
scenario, each with a wire owning a share, publish a job's telemetry between them
(trainer/sim/publishers.py): one replica's reports and its ranks' heartbeats always come from one
producer, in the order one engine emits them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from collector.bus import RawMessage
from collector.codec import MAX_EVENT_BYTES, InvalidEvent, encode, rank_record
from collector.events import CommOp, Heartbeat, RankIteration
from collector.plan import Plan
from collector.rank_columns import COMM_OPS, RankLayout
from collector.rank_header import pack_fields
from collector.topics import REPLICA_KEY, TELEMETRY, PartitionKeys, key_for, topics_for
from trainer.sim.telemetry import deterministic_id

if TYPE_CHECKING:
    from trainer.sim.engine import SimEngine
    from trainer.sim.timing import Block, ReplicaGroup
    from trainer.sim.workload import Packed

_PP_RECV = COMM_OPS.index(CommOp.PP_RECV)
_DP_ALLREDUCE = COMM_OPS.index(CommOp.DP_ALLREDUCE)
_F8, _I8, _I4 = np.dtype("<f8"), np.dtype("<i8"), np.dtype("<i4")
_KIND_LETTERS = np.frombuffer(b"FBW", np.uint8)

Owned = Callable[[Plan], list[int]]  # the replicas a wire owns under a plan


class _Header(NamedTuple):
    """What every rank report of one iteration shares in its fixed header."""

    schema_version: int
    time_s: float
    epoch: int
    iteration: int
    wall_s: float


class RankWire:
    """The bus records of the ranks' events of one engine's share of a job: rank reports of the
    ``owned`` replicas and heartbeats of their ranks (and of ranks no replica holds, with
    ``spare_heartbeats``). ``take()`` hands over what was written since the last call; with a
    ``sink``, every ``flush_records`` records written go to it as they are written (a publisher's
    insert then overlaps the building of the next records in another publisher)."""

    def __init__(self, engine: SimEngine, owned: Owned, *, spare_heartbeats: bool = False,
                 sink: Callable[[list[RawMessage]], None] | None = None, flush_records: int = 10_000) -> None:
        self.engine = engine
        self.sink, self.flush_records = sink, flush_records
        self.job = engine.config.job
        self._owned_of = owned
        self.spare_heartbeats = spare_heartbeats
        self._job_json = json.dumps(self.job)
        self._keys = PartitionKeys()  # the keys of what this wire writes through the events (other dialects)
        n = engine.config.cluster.gpus
        self._seq = np.zeros(n, np.int64)  # per rank: the next sequence number of its source
        self._last_replica = np.full(n, -1, np.int64)  # per rank: the replica of its last report written
        self._records: list[RawMessage] = []
        self._plan: Plan | None = None
        self.plan_changed(engine.plan)

    def plan_changed(self, plan: Plan) -> None:
        """Which replicas and ranks are this wire's under ``plan``."""
        self._plan = plan
        self.replicas = sorted(self._owned_of(plan))
        replica_of = np.full(self.engine.config.cluster.gpus, -1, np.int64)
        for pipe in plan.pipelines:
            for st in pipe.stages:
                replica_of[list(st.devices)] = pipe.replica
        self._replica_of = replica_of
        mine = np.isin(replica_of, self.replicas)
        if self.spare_heartbeats:
            mine |= replica_of < 0
        self._heartbeat_ranks = mine

    def take(self) -> list[RawMessage]:
        out, self._records = self._records, []
        return out

    def _flush(self) -> None:
        if self.sink is not None and len(self._records) >= self.flush_records:
            self.sink(self.take())

    def _next_seq(self, rank: int) -> int:
        n = int(self._seq[rank])
        self._seq[rank] = n + 1
        return n

    # ---- heartbeats --------------------------------------------------------------------------

    def heartbeats(self, alive: list[int], epoch: int, iteration: int, interval_s: float, time_s: float) -> None:
        """The heartbeats of the wire's ranks among ``alive`` (one timer tick of the engine)."""
        mine = self._heartbeat_ranks
        ranks = [d for d in alive if mine[d]]
        if not ranks:
            return
        job, job_json = self.job, self._job_json
        tail = f',"time_s":{_num(time_s)},"payload":{{"rank":%d,"epoch":{epoch},"iteration":{iteration},' \
               f'"interval_s":{_num(interval_s)}}}}}'
        head = '{"id":"%s","kind":"telemetry.heartbeat","schema_version":%d,"job":' % ("%s", max(Heartbeat.VERSIONS))
        head += job_json + ',"source":"rank-%d","seq":%d'
        out = self._records
        seqs = self._seq[ranks].tolist()
        self._seq[ranks] += 1
        last = self._last_replica[ranks].tolist()
        for d, n, r in zip(ranks, seqs, last):
            value = (head % (deterministic_id(job, f"rank-{d}", n), d, n) + tail % d).encode()
            key = f"{job}{REPLICA_KEY}{r}".encode() if r >= 0 else key_for(job, f"rank-{d}")
            out.append(RawMessage(TELEMETRY, key, value))
            if len(out) >= self.flush_records and self.sink is not None:
                self._flush()
                out = self._records

    # ---- rank reports ------------------------------------------------------------------------

    def reports(self, block: Block, j: int, iteration: int, time_s: float, ranks: set[int] | None) -> None:
        """The rank reports of iteration ``j`` of ``block`` for the wire's replicas (``ranks``: only
        these report; None: all)."""
        engine = self.engine
        config, plan = engine.config, engine.plan
        # A heartbeat is keyed by the replica of its rank's last report, whoever wrote that report:
        # after a reshape a rank's reports may come from another publisher than its heartbeats did.
        reporting = np.flatnonzero(self._replica_of >= 0) if ranks is None else np.array(
            [d for d in sorted(ranks) if d < len(self._replica_of) and self._replica_of[d] >= 0], np.int64)
        self._last_replica[reporting] = self._replica_of[reporting]
        if config.dialect != "ours":
            self._reports_as_events(block, j, iteration, time_s, ranks)
            return
        wall_s = float(block.durations_s[j])
        head = _Header(max(RankIteration.VERSIONS), time_s, plan.epoch, iteration, wall_s)
        mine = set(self.replicas)
        dp_bytes = engine._timing.dp_bytes
        for g, timing, packed in block.parts:
            R = len(g.replicas)
            for i, replica in enumerate(g.replicas):
                if replica not in mine:
                    continue
                row = j * R + i
                self._replica_reports(head, g, timing.start_s[row], timing.end_s[row], packed, row, replica,
                                      wall_s, dp_bytes[replica], ranks)
                self._flush()

    def _replica_reports(self, head: _Header, g: ReplicaGroup, start_s: np.ndarray, end_s: np.ndarray, packed: Packed,
                         row: int, replica: int,
                         wall_s: float, dp_bytes: list[int], ranks: set[int] | None) -> None:
        """One replica's reports, as ``replica_rank_iterations`` builds them and the codec encodes them."""
        engine = self.engine
        plan, job, gpn = engine.plan, self.job, engine.config.cluster.gpus_per_node
        table = g.table
        pipe = plan.pipelines[replica]
        S = table.stages
        key = f"{job}{REPLICA_KEY}{replica}".encode()
        tokens = packed.tokens[row]
        first, end = packed.first[row], packed.end[row]
        lengths = packed.lengths[row]
        out = self._records
        for s, stage in enumerate(pipe.stages):
            devices = stage.devices
            wanted = [t for t, d in enumerate(devices) if ranks is None or d in ranks]
            if not wanted:
                continue
            idx = g.ops_by_stage[s]
            st, en = start_s[idx], end_s[idx]
            kinds, mbs, links = table.kind[idx], table.microbatch[idx], table.link[idx]
            counts = (end - first)[mbs]
            total = int(counts.sum())
            # every chunk's documents, chunk after chunk: position p of chunk c is document
            # first[c] + p - (documents of the chunks before c)
            flat = lengths[np.repeat(first[mbs] - (np.cumsum(counts) - counts), counts) + np.arange(total)]
            prev_end = np.concatenate(([0.0], en[:-1]))
            waits = (links >= 0) & (st > prev_end + 1e-12)
            k_pp = int(waits.sum())
            w_start, w_dur = prev_end[waits], st[waits] - prev_end[waits]
            w_mb = mbs[waits]
            w_peer = np.where(kinds[waits] == 0, pipe.stages[(s - 1) % S].devices[0],
                              pipe.stages[(s + 1) % S].devices[0])
            w_bytes = np.full(k_pp, -1, np.int64)
            w_op = np.full(k_pp, _PP_RECV, np.uint8)
            if plan.dp > 1:
                last = float(en[-1]) if len(en) else 0.0
                w_start = np.append(w_start, last)
                w_dur = np.append(w_dur, max(0.0, wall_s - last))
                w_mb = np.append(w_mb, -1)
                w_peer = np.append(w_peer, -1)
                w_bytes = np.append(w_bytes, dp_bytes[s])
                w_op = np.append(w_op, _DP_ALLREDUCE)
            k = len(w_op)
            blob = b"".join((
                np.concatenate((st, en - st, w_start, w_dur)).astype(_F8).tobytes(),
                np.concatenate((tokens[mbs], w_bytes)).astype(_I8).tobytes(),
                np.concatenate((mbs, table.chunk[idx], flat, counts, w_peer, w_mb)).astype(_I4).tobytes(),
                w_op.astype(np.uint8).tobytes()))
            layout = RankLayout(_KIND_LETTERS[kinds].tobytes().decode(), total, k, False, False)
            for t in wanted:
                d = devices[t]
                n = self._next_seq(d)
                source = f"rank-{d}"
                fixed = pack_fields(head.schema_version, n, head.time_s, head.epoch, head.iteration, d, d // gpn,
                                    (t, s, replica, 0), head.wall_s, layout, deterministic_id(job, source, n), job, source)
                if fixed is None:
                    raise InvalidEvent(f"rank report of {source} does not fit its fixed header (job {job!r}); "
                                       "give the job a name in UTF-8")
                value = rank_record(fixed, blob)
                if len(value) > MAX_EVENT_BYTES:
                    raise InvalidEvent(f"telemetry.iteration event of {len(value):,} bytes exceeds the "
                                       f"{MAX_EVENT_BYTES:,}-byte limit; split it (telemetry: one message per rank "
                                       "per iteration)")
                out.append(RawMessage(TELEMETRY, key, value))

    def _reports_as_events(self, block: Block, j: int, iteration: int, time_s: float, ranks: set[int] | None) -> None:
        """Another dialect's reports: built as events for the wire's replicas only, then encoded."""
        from trainer.sim.engine import _rank_iterations

        engine = self.engine
        for p in _rank_iterations(engine.config, engine.plan, engine._timing.dp_bytes, block, j, iteration, ranks,
                                  replicas=set(self.replicas)):
            source = f"rank-{p.rank}"
            event = engine.events.numbered(source, p, time_s, self._next_seq(p.rank))
            raw, key = encode(event), self._keys.key(event.job, event.source, event.kind, p)
            self._records += [RawMessage(topic, key, raw) for topic in topics_for(event.kind)]


def _num(x: float) -> str:
    """A float as the envelope's JSON writes it."""
    return json.dumps(x)
