"""Every event the platform carries, as versioned, immutable pydantic models.

An event is an envelope — unique id, kind, schema version, job, source, per-source sequence number,
time — around a payload. The payload class decides the kind; ``Event[Payload]`` classes are built
from the payload registry below so that decoding is one discriminated-union parse (fast, and an
unknown kind fails with a message that lists the known ones).

Conventions: durations are measured on the host that reports them (``*_s`` fields); never subtract
the clocks of two hosts. ``start_s`` offsets are relative to the reporting rank's own iteration
start. Device ids are the stable identity of a worker (a GPU in the simulator, a process in the
torch trainer) and are what plans name.
"""

from __future__ import annotations

import base64
import itertools
import os
import time
from enum import StrEnum
from collections.abc import Sequence
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, PrivateAttr, SerializerFunctionWrapHandler,
    TypeAdapter, ValidationInfo, ValidatorFunctionWrapHandler, create_model, field_serializer, field_validator,
    model_serializer, model_validator,
)

from collector.plan import SCHEDULES, Plan, parse_id_ranges


# ---- contract ranges ----------------------------------------------------------------------------
# Every number on the wire has a range checked at decode, so whatever the bus holds fits every table
# and array downstream: ids and coordinates fit int32, counters int64 with room to add, durations
# and times are finite and bounded. A record outside them is dead-lettered with the field's name.
# Non-finite floats (NaN, ±Infinity, or a literal too large for a double) are refused by every
# model's ``allow_inf_nan=False``. docs/events.md lists the ranges (collector/reference.py).

INT32_MAX = 2**31 - 1  # ranks, device ids, epochs, coordinates, micro-batch numbers, schema versions
COUNT_MAX = 2**53  # iterations, sequence numbers, offsets, byte and token totals: exact as a double
TOKENS_MAX = 2**40  # tokens of one chunk: sums over a whole iteration stay far inside int64
DURATION_MAX_S = 1e6  # any measured duration or offset (about 11.6 days)
TIME_MAX_S = 1e10  # Unix time (year 2286)
RATE_MAX = 1e15  # tokens per second
LIST_MAX = 1 << 20  # any list (a 1 MB record holds fewer items anyway)
MAX_RANGES_CHARS = 1_000_000  # a range list of ids (the record's own limit bounds it first)
CHUNKS_MAX = 1 << 16  # chunks of one rank-iteration, and packed sequences of one chunk

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Tokens = Annotated[int, Field(ge=0, le=TOKENS_MAX)]
SeqLen = Annotated[int, Field(ge=0, le=INT32_MAX)]
Duration = Annotated[float, Field(ge=0, le=DURATION_MAX_S)]
Finite = Annotated[float, Field(allow_inf_nan=False)]  # a fitted or derived value: finite, any sign
_CONTRACT = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _plan_in_range(plan: Plan) -> Plan:
    """A plan's numbers must fit int32 like every id (collector/plan.py checks its shape)."""
    numbers = [("epoch", plan.epoch), ("virtual_stages", plan.virtual_stages), ("num_layers", plan.num_layers)]
    for pipe in plan.pipelines:
        numbers += [("replica", pipe.replica), ("microbatches", pipe.microbatches)]
        for stage in pipe.stages:
            numbers += [("end_layer", stage.end_layer)] + [("device", d) for d in stage.devices]
    for name, value in numbers:
        if not 0 <= value <= INT32_MAX:
            raise ValueError(f"plan {name} {value} is outside 0..{INT32_MAX}")
    return plan


ContractPlan = Annotated[Plan, AfterValidator(_plan_in_range)]

DTYPE_BYTES = {"<f8": 8, "<f4": 4, "<i4": 4, "<i1": 1}  # the array dtypes a PackedArrays payload carries
ATTACHED_BLOB = "resihp.attached_blob"  # validation context: a binary record's blob bytes (collector/codec.py)
Blob = Annotated[bytes, PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str,
                                        when_used="json")]  # standard base64 in JSON, as the first logs wrote it


class Payload(BaseModel):
    """Base of every payload. ``KIND`` names it on the wire; ``VERSIONS`` are the schema versions
    this build reads (the newest is written)."""

    model_config = _CONTRACT
    KIND: ClassVar[str]
    VERSIONS: ClassVar[tuple[int, ...]] = (1,)


class IterationPayload(Payload):
    """A payload about one iteration: its number and the plan epoch (layout) it ran under.
    Iteration numbers go on across reshapes; the epoch says which layout the figures belong to."""

    epoch: Int32
    iteration: Count


# ---- telemetry (trainer ranks and the simulator) -----------------------------------------------


class ChunkKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"  # input-gradient part of the backward (or the whole backward without W split)
    WEIGHT = "W"  # weight-gradient part, zero-bubble schedules only


class Chunk(BaseModel):
    """One chunk a rank ran: a forward, backward or weight-gradient pass of one micro-batch."""

    model_config = _CONTRACT

    kind: ChunkKind
    microbatch: Int32
    virtual_stage: int = Field(default=0, ge=0, le=INT32_MAX)
    tokens: int | None = Field(default=None, ge=0, le=TOKENS_MAX,
                               description="tokens in the chunk; None when unknown (never 0)")
    seq_lens: list[SeqLen] | None = Field(
        default=None, max_length=CHUNKS_MAX, description="packed sequence lengths; None when the source does not "
        "report them"
    )
    start_s: float = Field(ge=0, le=DURATION_MAX_S, description="offset from the rank's iteration start, local clock")
    duration_s: float = Field(ge=0, le=DURATION_MAX_S)


class CommOp(StrEnum):
    TP_ALLREDUCE = "tp_allreduce"
    PP_SEND = "pp_send"
    PP_RECV = "pp_recv"
    DP_ALLREDUCE = "dp_allreduce"
    PP_SENDRECV = "pp_sendrecv"  # a fused send+recv p2p op (Megatron style); its timer holds the wait
    ALL_GATHER = "all_gather"  # FSDP / sequence-parallel TP
    REDUCE_SCATTER = "reduce_scatter"
    EMBEDDING_ALLREDUCE = "embedding_allreduce"  # tied embeddings, first and last stage
    LOSS_ALLREDUCE = "loss_allreduce"


ProcessGroupName = Literal["tp", "pp", "dp", "cp", "fsdp"]
LocationTarget = Literal["compute", "link", "node"]  # what a Location names: a rank's compute, a link, a node
ConfirmMethod = Literal["probe", "heartbeat", "persistence"]  # how an incident was confirmed
PlanCurrentReason = Literal["start", "reshape", "restart"]  # why the trainer announces the running plan


class CommWait(BaseModel):
    """Time a rank spent in (or waiting on) one communication."""

    model_config = _CONTRACT

    op: CommOp
    peer: int | None = Field(default=None, ge=0, le=INT32_MAX,
                             description="device id on the other end, for point-to-point")
    microbatch: int | None = Field(default=None, ge=0, le=INT32_MAX)
    bytes: int | None = Field(default=None, ge=0, le=COUNT_MAX)
    start_s: float = Field(ge=0, le=DURATION_MAX_S)
    duration_s: float = Field(ge=0, le=DURATION_MAX_S)
    includes_wait: bool = Field(
        default=False, description="true when the timer holds the wait for the peer (a fused or blocking p2p or "
        "collective timer): its duration is wait + wire, not wire alone")
    group: ProcessGroupName | None = Field(
        default=None, description="the process group a collective ran on, when the source knows it")


class Coords(BaseModel):
    """A rank's coordinates under the plan of ``epoch``: TP rank, pipeline stage, DP replica, and
    context-parallel rank (0 in a job without context parallelism)."""

    model_config = _CONTRACT

    tp: Int32
    pp: Int32
    dp: Int32
    cp: int = Field(default=0, ge=0, le=INT32_MAX)




def _column_as_list(value: Sequence, handler: SerializerFunctionWrapHandler) -> Any:
    """A table read from a binary report holds its columns as arrays (collector/rank_columns.py)
    until someone reads them: written out, they are the lists the JSON form holds."""
    return handler(value if isinstance(value, list) else list(value))


class ChunkTable(BaseModel):
    """All chunks of one rank-iteration, column by column: the wire form of ``RankIteration.chunks``.

    Why columns: telemetry is the platform's hot path (one message per rank per iteration, tens of
    chunks each). Column lists halve the JSON (no repeated keys) and validate as plain lists, so a
    consumer decodes about twice as many messages per second, and the analytics projection turns
    them into Arrow columns without touching each chunk. Row ``i`` of every column is one chunk.
    """

    model_config = _CONTRACT

    kind: str = Field(pattern=r"^[FBW]*$", max_length=CHUNKS_MAX,
                      description="one letter per chunk: F forward, B backward, W weight-gradient")
    microbatch: list[Int32] = Field(max_length=CHUNKS_MAX)
    virtual_stage: list[Int32] = Field(max_length=CHUNKS_MAX)
    tokens: list[Tokens | None] = Field(max_length=CHUNKS_MAX, description="tokens per chunk; null when unknown "
                                        "(never 0)")
    seq_lens: list[Annotated[list[SeqLen], Field(max_length=CHUNKS_MAX)] | None] = Field(
        max_length=CHUNKS_MAX, description="packed sequence lengths per chunk; null when not reported")
    start_s: list[Duration] = Field(max_length=CHUNKS_MAX,
                                    description="offsets from the rank's iteration start, local clock")
    duration_s: list[Duration] = Field(max_length=CHUNKS_MAX)

    @model_validator(mode="after")
    def _same_length(self) -> ChunkTable:
        n = len(self.kind)
        if (len(self.microbatch) == len(self.virtual_stage) == len(self.tokens) == len(self.seq_lens)
                == len(self.start_s) == len(self.duration_s) == n):
            return self  # the hot path: every telemetry message passes here
        lengths = {name: len(getattr(self, name)) for name in
                   ("microbatch", "virtual_stage", "tokens", "seq_lens", "start_s", "duration_s")}
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"chunk columns must all hold {n} rows (one per kind letter); got {bad}")
        return self

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> ChunkTable:
        return cls(
            kind="".join(ChunkKind(c.kind).value for c in chunks),
            microbatch=[c.microbatch for c in chunks],
            virtual_stage=[c.virtual_stage for c in chunks],
            tokens=[c.tokens for c in chunks],
            seq_lens=[c.seq_lens for c in chunks],
            start_s=[c.start_s for c in chunks],
            duration_s=[c.duration_s for c in chunks],
        )

    @field_serializer("microbatch", "virtual_stage", "tokens", "seq_lens", "start_s", "duration_s", mode="wrap")
    def _as_lists(self, value: Sequence, handler: SerializerFunctionWrapHandler) -> Any:
        return _column_as_list(value, handler)

    def __len__(self) -> int:
        return len(self.kind)

    def rows(self) -> list[Chunk]:
        """The chunks as objects (already validated as columns, so built without re-validation)."""
        kinds = {k.value: k for k in ChunkKind}
        return [
            Chunk.model_construct(kind=kinds[k], microbatch=m, virtual_stage=v, tokens=t, seq_lens=sl,
                                  start_s=st, duration_s=d)
            for k, m, v, t, sl, st, d in zip(self.kind, self.microbatch, self.virtual_stage, self.tokens,
                                            self.seq_lens, self.start_s, self.duration_s)
        ]


class CommTable(BaseModel):
    """Every communication of one rank-iteration, column by column: the wire form of
    ``RankIteration.comm`` from schema 4 on (row ``i`` of every column is one ``CommWait``).

    Why columns, as for chunks: a rank of a pipeline records a p2p wait per micro-batch, and as a
    list of objects (schema 3) they repeat every key in every row: a report of 32 chunks and 25
    waits was 5,969 bytes and 106 µs to decode, as columns 3,748 bytes and 67 µs (``resihp bench
    analytics``, docs/benchmarks.md).
    ``includes_wait`` and ``group`` may be left empty when no row says them (every timer wire-only,
    no group known); otherwise every column holds one value per row."""

    model_config = _CONTRACT

    op: list[CommOp] = Field(default_factory=list, max_length=LIST_MAX)
    peer: list[Int32 | None] = Field(default_factory=list, max_length=LIST_MAX,
                                     description="device id on the other end (point-to-point); null otherwise")
    microbatch: list[Int32 | None] = Field(default_factory=list, max_length=LIST_MAX)
    bytes: list[Count | None] = Field(default_factory=list, max_length=LIST_MAX)
    start_s: list[Duration] = Field(default_factory=list, max_length=LIST_MAX)
    duration_s: list[Duration] = Field(default_factory=list, max_length=LIST_MAX)
    includes_wait: list[bool] = Field(default_factory=list, max_length=LIST_MAX,
                                      description="per row, as CommWait.includes_wait; empty: false for every row")
    group: list[ProcessGroupName | None] = Field(default_factory=list, max_length=LIST_MAX,
                                                 description="per row, as CommWait.group; empty: unknown for every row")

    @model_validator(mode="after")
    def _same_length(self) -> CommTable:
        n = len(self.op)
        if (len(self.peer) == len(self.microbatch) == len(self.bytes) == len(self.start_s) == len(self.duration_s) == n
                and len(self.includes_wait) in (0, n) and len(self.group) in (0, n)):
            return self  # the hot path: every telemetry message passes here
        lengths = {name: len(getattr(self, name)) for name in
                   ("peer", "microbatch", "bytes", "start_s", "duration_s", "includes_wait", "group")}
        bad = {k: v for k, v in lengths.items() if v != n and not (k in ("includes_wait", "group") and v == 0)}
        raise ValueError(f"comm columns must all hold {n} rows (one per op; includes_wait and group may be empty); "
                         f"got {bad}")

    @classmethod
    def of(cls, waits: Sequence[CommWait]) -> CommTable:
        """The columns of ``waits`` (already validated objects, so built without re-validation)."""
        if not waits:
            return cls.model_construct(op=[], peer=[], microbatch=[], bytes=[], start_s=[], duration_s=[],
                                       includes_wait=[], group=[])
        said_wait = any(w.includes_wait for w in waits)
        said_group = any(w.group is not None for w in waits)
        return cls.model_construct(
            op=[w.op for w in waits], peer=[w.peer for w in waits], microbatch=[w.microbatch for w in waits],
            bytes=[w.bytes for w in waits], start_s=[w.start_s for w in waits],
            duration_s=[w.duration_s for w in waits],
            includes_wait=[w.includes_wait for w in waits] if said_wait else [],
            group=[w.group for w in waits] if said_group else [],
        )

    @field_serializer("op", "peer", "microbatch", "bytes", "start_s", "duration_s", "includes_wait", "group",
                      mode="wrap")
    def _as_lists(self, value: Sequence, handler: SerializerFunctionWrapHandler) -> Any:
        return _column_as_list(value, handler)

    def __len__(self) -> int:
        return len(self.op)

    def rows(self) -> list[CommWait]:
        """The communications as objects (already validated as columns, so built without re-validation)."""
        n = len(self.op)
        waits = self.includes_wait or [False] * n
        groups = self.group or [None] * n
        return [CommWait.model_construct(op=CommOp(o), peer=p, microbatch=m, bytes=b, start_s=st, duration_s=d,
                                         includes_wait=w, group=g)
                for o, p, m, b, st, d, w, g in zip(self.op, self.peer, self.microbatch, self.bytes, self.start_s,
                                                   self.duration_s, waits, groups)]


# A report without communications shares this one (frozen): building an empty CommTable through
# validation for every such report cost its decode 1–2 µs.
NO_COMM = CommTable.model_construct(op=[], peer=[], microbatch=[], bytes=[], start_s=[], duration_s=[],
                                    includes_wait=[], group=[])


class RankColumns(BaseModel):
    """What follows the header of a binary rank report (schema 5): the chunk kinds, one letter per
    chunk, and how many sequence lengths and communications the blob holds (collector/rank_columns.py
    gives the layout). Only in a binary record's JSON header (wire format 1; the fixed header of
    format 2 says the same in numbers); a JSON record carries its columns inline."""

    model_config = _CONTRACT

    kind: str = Field(pattern=r"^[FBW]*$", max_length=CHUNKS_MAX, description="one letter per chunk")
    seq_lens: int = Field(ge=0, le=LIST_MAX, description="packed sequence lengths, all chunks together")
    waits: int = Field(ge=0, le=LIST_MAX, description="communications")
    includes_wait: bool = Field(default=False, description="the blob holds an includes_wait column")
    group: bool = Field(default=False, description="the blob holds a group column")


class RankIteration(IterationPayload):
    """One rank's telemetry for one iteration: every chunk it ran and every wait it measured.

    Build it with ``chunks=[Chunk(...), ...]`` (converted to a ChunkTable) or ``chunk_table=...``,
    and ``comm=[CommWait(...), ...]`` (converted to a CommTable) or ``comm_table=...``; read
    ``.chunks`` / ``.chunk_table`` and ``.waits()`` (columns, whichever form the record came in).
    Schema 2 carries chunks as columns; schema 3 adds ``coords.cp``, unknown token counts (null),
    the collectives real jobs record and the comm fields ``includes_wait`` / ``group``; schema 4
    carries the communications as columns too (``comm_table``); schema 5 travels on the bus as a
    binary record, a fixed header (collector/rank_header.py) and columns as arrays
    (collector/rank_columns.py; its JSON form, in traces, is schema 4's). Every addition has a default and ``comm`` is still read, so a schema-2 to -4
    record decodes unchanged: that is the migration of old logs.
    """

    KIND: ClassVar[str] = "telemetry.iteration"
    VERSIONS: ClassVar[tuple[int, ...]] = (2, 3, 4, 5)
    rank: int = Field(ge=0, le=INT32_MAX, description="device id")
    node: int | None = Field(default=None, ge=0, le=INT32_MAX)
    coords: Coords
    wall_s: float = Field(ge=0, le=DURATION_MAX_S, description="the rank's own iteration time, local clock")
    chunk_table: ChunkTable = Field(description="every chunk the rank ran, as columns")
    comm_table: CommTable = Field(default_factory=lambda: NO_COMM, exclude_if=lambda v: not len(v),
                                  description="every communication it measured, as columns (schema 4)")
    columns: RankColumns | None = Field(default=None, exclude_if=lambda v: v is None,
                                        description="schema 5, a binary record's header only: what its blob holds "
                                                    "(the tables above are then empty)")
    comm: list[CommWait] = Field(default_factory=list, max_length=LIST_MAX, exclude_if=lambda v: not v,
                                 description="schema 2–3: the communications as objects; read from older logs, "
                                 "never written (a record holds comm or comm_table, not both)")

    def __init__(self, **data: Any) -> None:
        if "chunks" in data:
            if "chunk_table" in data:
                raise ValueError("give chunks or chunk_table, not both")
            data["chunk_table"] = ChunkTable.of(data.pop("chunks"))
        if "comm" in data and "comm_table" not in data:
            data["comm_table"] = CommTable.of(data.pop("comm"))
        super().__init__(**data)

    @model_validator(mode="after")
    def _one_comm_form(self) -> RankIteration:
        if self.comm and len(self.comm_table):
            raise ValueError("a record holds comm (schema 2–3) or comm_table (schema 4), not both")
        return self

    def waits(self) -> CommTable:
        """The communications as columns, from whichever form the record carries."""
        return CommTable.of(self.comm) if self.comm else self.comm_table

    # Python construction only: decoding (validate_json) must not run through this __init__, or
    # pydantic would turn every record into Python objects first and lose its direct JSON path.
    # The flag is how pydantic itself marks an __init__ that only forwards (see RootModel); no type
    # can declare an attribute on a function, so pydantic's own RootModel silences its checker too.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @cached_property
    def chunks(self) -> list[Chunk]:
        return self.chunk_table.rows()


class TracingDeclared(Payload):
    """What a producer records: which ranks and which steps report telemetry, and in which dialect.
    Published at start and again when it changes. A rank the plan holds but the declaration leaves
    out is "not traced": missing telemetry from it is expected, so it is neither dead nor healthy.

    Iteration ``i`` is traced iff ``i % step_every == step_offset % step_every``.
    """

    KIND: ClassVar[str] = "telemetry.tracing"
    epoch: Int32
    dialect: str = Field(min_length=1, max_length=200,
                         description='free label: "ours", "megatron", "profiler", "sampled", ...')
    traced_ranks: list[Int32] | None = Field(
        default=None, max_length=LIST_MAX,
        description="None: every rank of the plan reports; a list: only these device ids do")
    step_every: int = Field(default=1, ge=1, le=INT32_MAX)
    step_offset: int = Field(default=0, ge=0, le=INT32_MAX)
    seq_lens: bool = Field(default=True, description="whether chunks carry packed sequence lengths")
    tokens: bool = Field(default=True, description="whether chunks carry token counts")
    fused_p2p: bool = Field(default=False, description="whether p2p timers hold the wait for the peer")

    def rank_traced(self, rank: int) -> bool:
        return self.traced_ranks is None or rank in self.traced_ranks

    def step_traced(self, iteration: int) -> bool:
        return iteration % self.step_every == self.step_offset % self.step_every


class ReshapePhaseName(StrEnum):
    AGREE = "agree"  # the plan checked and the same epoch confirmed by every running rank
    EXPORT = "export"  # this rank's state read out of the old layout
    NEW_MESH = "new_mesh"  # the process groups / mesh of the new layout
    STAGES_REBUILT = "stages_rebuilt"  # the stage model, its parallelisation, schedule and optimizer
    REDISTRIBUTE = "redistribute"  # the state moved to where the new layout holds it, and loaded
    FIRST_STEP = "first_step"  # the first iteration on the new layout
    ROLLBACK = "rollback"  # a phase failed on some rank: every rank went back to the old layout


class ReshapePhase(Payload):
    """One phase of one live reshape on one rank, with its duration, so that an operator sees why a
    pause took N seconds (and which rank and phase made it long). Any executor may publish it."""

    KIND: ClassVar[str] = "telemetry.reshape_phase"
    executor: Literal["native", "reference", "torchtitan"] = Field(description="which executor ran the reshape")
    epoch: int = Field(ge=0, le=INT32_MAX, description="the epoch the reshape moves to")
    iteration: int = Field(ge=0, le=COUNT_MAX, description="the iteration boundary it happens at")
    rank: int = Field(ge=0, le=INT32_MAX, description="device id")
    phase: ReshapePhaseName
    duration_s: float = Field(ge=0, le=DURATION_MAX_S, description="local clock")
    ok: bool = Field(default=True, description="false: the phase failed here or on a peer; a rollback follows")
    detail: str = Field(default="", max_length=2_000, description=(
        'what the phase did or why it failed: "groups kept", "state from live ranks", "DCP checkpoint …"'))


class IterationSummary(IterationPayload):
    """Job-level view of one iteration, reported once (by the launcher or the last stage)."""

    KIND: ClassVar[str] = "telemetry.summary"
    loss: Finite | None = None
    tokens: Count
    wall_s: float = Field(ge=0, le=DURATION_MAX_S)


class Heartbeat(Payload):
    """A rank is alive. Sent on a timer, independent of iteration progress."""

    KIND: ClassVar[str] = "telemetry.heartbeat"
    rank: Int32
    epoch: Int32
    iteration: int = Field(ge=0, le=COUNT_MAX, description="the last iteration the rank started")
    interval_s: float = Field(gt=0, le=DURATION_MAX_S, description="when the next heartbeat is due")


class HangReported(Payload):
    """A node agent found ranks that made no progress past their deadline (trainer/agent/hang.py):
    the ranks it names entered no op for ``stuck_for_s`` while their peers waited on them. The
    agent's observation, signed with the executor's key; the analytics consumer judges it like
    any evidence of a stopped rank and opens the incident (with its own key), resolved when the
    ranks report again."""

    KIND: ClassVar[str] = "telemetry.hang"
    iteration: int = Field(ge=0, le=COUNT_MAX, description="the iteration the named ranks are stuck in")
    ranks: list[Int32] = Field(min_length=1, max_length=LIST_MAX, description="devices of the ranks that made no progress")
    waiting: list[Int32] = Field(default_factory=list, max_length=LIST_MAX, description="devices of the ranks waiting on them")
    op: str = Field(max_length=200, description="the op the named ranks last entered")
    stuck_for_s: float = Field(ge=0, le=DURATION_MAX_S)
    deadline_s: float = Field(ge=0, le=DURATION_MAX_S, description="factor × the expected step, floored")
    summary: str = Field(max_length=2000)
    stacks: str = Field(default="", max_length=16000, description="the named ranks' Python stacks, newest part")


class RecoveryPhase(Payload):
    """One phase of a fail-stop recovery inside the job (``resihp run --on-failure shrink``): the
    survivors kept running, re-formed the world without the lost ranks and went on. Published by
    the node agent of the new world's rank 0, one event per phase, in order; every duration is
    that rank's own clock. The phases: ``detected`` (how long the rank sat in the collective that
    failed), ``rendezvous closed`` (until every rank of the old world had joined or was marked
    lost), ``new world`` (the new process group formed), ``state restored`` (from the survivor
    with the most committed steps), ``first step`` (the first step of the new world finished)."""

    KIND: ClassVar[str] = "telemetry.recovery"
    generation: int = Field(ge=1, le=INT32_MAX, description="the world formed by this recovery (the job starts at 0)")
    phase: Literal["detected", "rendezvous closed", "new world", "state restored", "first step"]
    duration_s: float = Field(ge=0, le=DURATION_MAX_S, description="this phase alone, measured by the reporting rank")
    since_detected_s: float = Field(ge=0, le=DURATION_MAX_S,
                                    description="from the failed collective's error to this phase's end")
    iteration: int = Field(ge=0, le=COUNT_MAX, description="the committed step the new world goes on from")
    world: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(max_length=LIST_MAX,
                                                                  description="the ranks of the new world")
    lost: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(max_length=LIST_MAX,
                                                                 description="the ranks it recovered from")
    failed_op: str = Field(default="", max_length=200, description="the op the failure surfaced in")


# ---- analytics (derived, published so no other process opens the analytics DuckDB) -----------


class StageTime(BaseModel):
    """One pipeline stage of one DP replica in one iteration: the compute it did (the sum of its
    chunks' own times, the median over the stage's TP ranks) against what the cost model predicted."""

    model_config = _CONTRACT

    replica: Int32
    stage: Int32
    observed_s: float = Field(ge=0, le=DURATION_MAX_S)
    predicted_s: float = Field(ge=0, le=DURATION_MAX_S)


class IterationPrediction(IterationPayload):
    """Observed against predicted time of one iteration, as the detector sees it, and of its stages."""

    KIND: ClassVar[str] = "analytics.prediction"
    observed_s: float = Field(ge=0)
    predicted_s: float = Field(ge=0)
    tokens: int = Field(ge=0, le=COUNT_MAX, description="tokens the job trained in the iteration, each micro-batch once")
    model_error: Finite | None = Field(default=None, description="the cost model's recent relative error")
    stages: list[StageTime] = Field(default_factory=list, max_length=256,
                                    description="per (replica, stage) compute time: every one when the layout has at "
                                                "most 256, else per stage the replica furthest above its prediction")


class PackedArrays(Payload):
    """A payload whose bulk is numeric arrays, carried as their little-endian bytes back to back
    (``blob``) with ``layout`` naming them: (name, numpy dtype, length) in blob order. The
    high-volume analytics records (replica summaries, liveness batches) are built on it.

    On the wire such a payload travels as a binary record (collector/codec.py): the envelope as
    JSON, then ``blob`` raw: base64 made these records a third larger and cost the merge a decoding
    pass over 1,562 blobs an iteration at 100k ranks. In JSON (a trace, ``encode_json``, older logs) ``blob``
    is standard base64. Either way the blob must be exactly as long as its layout says, so a
    truncated or corrupt record is refused at decode (and dead-lettered), never half-read."""

    model_config = ConfigDict(val_json_bytes="base64")  # merged with the contract's config
    layout: list[tuple[str, Literal["<f8", "<f4", "<i4", "<i1"], int]] = Field(
        max_length=256, description="(array, dtype, length) in blob order; lengths 0 … 1,048,576")
    blob: Blob = Field(description="the arrays' little-endian bytes back to back (base64 in JSON)")

    @field_validator("blob")
    @classmethod
    def _blob_matches_layout(cls, blob: bytes, info: ValidationInfo) -> bytes:
        attached = info.context.get(ATTACHED_BLOB) if isinstance(info.context, dict) else None
        if attached is not None:  # a binary record: the header's blob is empty, the bytes follow it
            if blob:
                raise ValueError("a binary record's header must leave blob empty (its bytes follow the header)")
            blob = attached
        layout = info.data.get("layout")
        if layout is None:
            return blob  # the layout itself is invalid, and reported
        want = 0
        for name, dtype, n in layout:  # one plain loop: it runs for each of the merge's 1,562 records an iteration
            if not 0 <= n <= LIST_MAX:
                raise ValueError(f"layout's array {name[:40]!r} has length {n}, outside 0..{LIST_MAX}")
            want += n * DTYPE_BYTES[dtype]
        if len(blob) != want:
            raise ValueError(f"blob holds {len(blob):,} bytes but its layout names {want:,}; the record is "
                             "truncated or corrupt")
        return blob


class ReplicaSummary(PackedArrays):
    """One DP replica's share of one iteration, as the analytics shard holding it scored it: what
    the merge needs to judge the job without the replica's chunks. Per rank: coordinates, wall
    time, the uncentred log-ratio of own compute to the cost model's prediction (overall and per
    chunk kind), own and predicted compute; per link: its uncentred log time per message and stage
    pair; per work unit (thinned evenly to what the job's cost-model window keeps): its class,
    tokens, Σ lᵢ² and own time, for the merge's fit; per replica: its critical paths and tokens.

    ``blob``/``layout`` hold the arrays (PackedArrays; floats may be NaN: "not judged");
    ``class_keys`` names the work classes the unit rows index. Shards of one consumer group each hold whole replicas
    (telemetry is keyed job/replica)."""

    KIND: ClassVar[str] = "analytics.replica_summary"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 adds span_s
    epoch: int = Field(ge=0)
    iteration: int = Field(ge=0)
    replica: int = Field(ge=0)
    ranks: int = Field(ge=1, description="rank rows in this replica's arrays")
    shard: str = Field(default="", description="the analytics process that scored it (diagnostics only)")
    fits_from: tuple[int, int] | None = Field(
        default=None, description="the (epoch, iteration) whose merge fits the shard predicted with; none: its own")
    inferred: bool = Field(description="sequence lengths were not reported: predictions inferred per micro-batch")
    explained_s: Finite | None = Field(description="critical path of observed own compute, no communication")
    pipeline_s: Finite | None = Field(description="critical path of predicted compute with the replica's p2p")
    dp_wait_s: Finite = Field(ge=0, description="the least DP all-reduce wait of the replica's ranks")
    tokens: int = Field(ge=0)
    wall_s: Finite = Field(ge=0, description="the replica's slowest rank's iteration wall time")
    span_s: Finite | None = Field(default=None, ge=0, le=DURATION_MAX_S,
                                  description="when the replica's last chunk ended (its own span, before the DP "
                                              "all-reduce); none: no chunk, or a shard before this field")
    class_keys: str = Field(description="the work classes u_class indexes, a JSON list (replicas share it verbatim)")


class LivenessBatch(PackedArrays):
    """What a shard heard of its ranks' liveness since its last batch, for the merge's fail-stop
    watch (analytics/detection/fail_stop.py), which judges heartbeats and report progress job-wide: one row
    per heartbeat (kind 1, with its interval) or rank report (kind 0) the shard read, in the order
    read. ``blob``/``layout`` (PackedArrays): arrays kind, rank, epoch, iteration, time_s,
    interval_s. ``declared``: the producers' tracing declarations the shard read (they travel on
    the telemetry topic, which the merge does not read), applied before the rows."""

    KIND: ClassVar[str] = "analytics.liveness"
    rows: int = Field(ge=0)
    shard: str = Field(default="", description="the analytics process that read them (diagnostics only)")
    declared: list[TracingDeclared] = Field(default_factory=list, max_length=1024)


class DetectorFits(Payload):
    """The merge's cost-model fits after it judged (epoch, iteration): what the shards predict the
    job's next iteration with, as the single process predicts with the fits of the iterations before
    (analytics/detection/scoring.py ``predict_chunks``). ``classes``: [class key, α, β, γ, uses Σ lᵢ²].
    ``planned_epochs``: the epochs whose plan the merge knows (without one, a new epoch forgets the
    fits, as the single process does). Republished for the same iteration when ``dead`` changes."""

    KIND: ClassVar[str] = "analytics.detector_fits"
    epoch: int = Field(ge=-1, description="-1: before the job's first judged iteration (dead ranks only)")
    iteration: int = Field(ge=-1)
    classes: list[tuple[list[str | int], Finite, Finite, Finite, bool]]
    planned_epochs: list[int] = Field(default_factory=list)
    dead: list[int] = Field(default_factory=list, description="ranks the merge holds dead: a replica completes without them")


class RankState(StrEnum):
    HEALTHY = "healthy"
    SLOW = "slow"
    DEAD = "dead"
    NOT_TRACED = "not_traced"  # the producer declared the rank untraced (TracingDeclared)


class RankHealthEntry(BaseModel):
    """One rank as the detector sees it."""

    model_config = _CONTRACT

    rank: Int32
    state: RankState
    factor: float = Field(default=1.0, gt=0, description="estimated slowdown; 1.0 is healthy")


class RankHealth(IterationPayload):
    """The detector's current view of every rank it has heard of (only changes are published).

    From schema 2 the healthy and the untraced ranks are range lists (``"0-7,9-99967"``) and
    ``ranks`` lists the others, slow and dead, with their factors: at 100k ranks one entry per
    rank made a 4.6 MB record, over the bus's 1 MB limit. Read the whole view with ``entries``."""

    KIND: ClassVar[str] = "analytics.rank_health"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 adds healthy and not_traced as range lists
    ranks: list[RankHealthEntry] = Field(max_length=LIST_MAX, description="ranks in any state (schema 1: every "
                                         "rank); from schema 2 the slow and dead ones")
    healthy: str = Field(default="", max_length=MAX_RANGES_CHARS,
                         description="healthy ranks as a range list, e.g. \"0-7,9-15\"")
    not_traced: str = Field(default="", max_length=MAX_RANGES_CHARS,
                            description="ranks declared untraced, as a range list")

    @field_validator("healthy", "not_traced")
    @classmethod
    def _ranges(cls, text: str) -> str:
        ranks = parse_id_ranges(text)  # raises, naming the bad range
        if ranks and max(ranks) > INT32_MAX:
            raise ValueError(f"rank {max(ranks)} is outside 0..{INT32_MAX}")
        return text

    def entries(self) -> list[RankHealthEntry]:
        """Every rank's entry, by rank: the listed ones, then the ranges' (a listed rank wins)."""
        entry = RankHealthEntry.model_construct  # the ranges were checked at validation
        out = {r: entry(rank=r, state=RankState.HEALTHY, factor=1.0) for r in parse_id_ranges(self.healthy)}
        out.update((r, entry(rank=r, state=RankState.NOT_TRACED, factor=1.0)) for r in parse_id_ranges(self.not_traced))
        out.update((e.rank, e) for e in self.ranks)
        return [out[r] for r in sorted(out)]


class AnalyticsLease(Payload):
    """An analytics consumer with the detector says it runs, every few seconds (and that it stopped,
    ``released``). Two consumers on one bus would both publish incidents; the one that started
    later sees the other's lease, warns, publishes no incidents and says whom it defers to."""

    KIND: ClassVar[str] = "analytics.lease"
    instance: str = Field(min_length=1, max_length=200, description="this consumer's id (random per process)")
    started_s: float = Field(allow_inf_nan=False, description="when it started (its wall clock)")
    db: str = Field(default="", max_length=4096, description="its DuckDB file")
    deferring_to: str | None = Field(default=None, max_length=200,
                                     description="set when this one is the duplicate: the instance that publishes")
    released: bool = Field(default=False, description="it stopped: the lease is free")


class BusOutage(Payload):
    """The analytics consumer lost the bus (its client's connection errors, not missing heartbeats)
    and suspended fail-stop judgement of this job: published once when the outage is seen
    (``ended_s`` None) and once when judgement resumes, after the consumer caught up. Both are
    published once the bus is back, since during the outage nothing can be."""

    KIND: ClassVar[str] = "analytics.bus_outage"
    outage_id: str = Field(min_length=1, max_length=200, description="the same on the start and the end event")
    started_s: float = Field(ge=0, le=TIME_MAX_S, description="when judgement was suspended (the consumer's clock)")
    ended_s: float | None = Field(default=None, ge=0, le=TIME_MAX_S, description="when it resumed; None: still down")
    duration_s: float | None = Field(default=None, ge=0, le=DURATION_MAX_S)
    reason: str = Field(default="", max_length=2000, description="what the bus client saw")
    ranks_suspended: int = Field(default=0, ge=0, le=INT32_MAX,
                                 description="ranks whose fail-stop judgement waited (the live ranks watched)")


class TelemetryNotice(IterationPayload):
    """The detector read a producer's telemetry otherwise than it was declared, and says what the
    producer should declare: once per job and finding, from the iteration that told. ``finding``
    ``fused_p2p``: p2p timers that did not say they hold waits do (they grow with the peer's compute
    and the pipeline bubble, which no wire can), so they are read as holding waits."""

    KIND: ClassVar[str] = "analytics.telemetry_notice"
    finding: Literal["fused_p2p"]
    message: str = Field(min_length=1, max_length=500, description="what the console shows")
    detail: str = Field(default="", max_length=2000, description="the evidence")


# ---- incidents ----------------------------------------------------------------------------------


class FaultCategory(StrEnum):
    FAIL_SLOW = "fail_slow"
    FAIL_STOP = "fail_stop"


class Severity(StrEnum):
    """How urgent an incident is, from the slowdown or loss it costs; an auto-apply policy names the
    severities whose plans it applies without an operator."""

    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    CRITICAL = "critical"


class Location(BaseModel):
    """Where a fault is: a rank's compute, a link between two devices, or a whole node.

    ``place_confidence`` says how sure the detector is of the place, not whether the fault is real
    (that is the incident's ``p_real``). Schema 1–2 named it ``confidence`` and mixed both; such a
    location is read with that number as its place confidence and written back under the old name,
    because the bytes an incident's signature covers are the ones it was signed with."""

    model_config = _CONTRACT
    _old_confidence: bool = PrivateAttr(default=False)  # the wire said ``confidence``: written back the same

    target: LocationTarget
    rank: int | None = Field(default=None, ge=0, le=INT32_MAX)
    link: tuple[Int32, Int32] | None = None
    node: int | None = Field(default=None, ge=0, le=INT32_MAX)
    replica: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stage: int | None = Field(default=None, ge=0, le=INT32_MAX)
    tp_group: tuple[Int32, ...] | None = Field(default=None, max_length=LIST_MAX)
    factor: float = Field(default=1.0, gt=0, description="estimated slowdown; large (finite) for dead")
    place_confidence: float = Field(
        default=1.0, ge=0, le=1,
        description="share of the evidence that points at this place among the candidates it could be (1: the "
                    "place is measured; 1/n: one of n lock-step or untraced ranks); schema 1–2: confidence")
    measure: Literal["chunks", "compute"] = Field(
        default="chunks", exclude_if=lambda v: v == "chunks",
        description="what a compute location's factor slows: the rank's chunks, as telemetry times them (compute "
                    "and the TP communication inside; a planner takes the compute slowdown behind it), or its "
                    "compute alone, as a probe times it")

    @model_validator(mode="wrap")
    @classmethod
    def _read_old_confidence(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Location:
        old = data._old_confidence if isinstance(data, Location) else False
        if isinstance(data, dict) and "confidence" in data and "place_confidence" not in data:
            data, old = {("place_confidence" if k == "confidence" else k): v for k, v in data.items()}, True
        loc = handler(data)
        loc._old_confidence = old
        return loc

    @model_serializer(mode="wrap")
    def _write_confidence_as_read(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if not self._old_confidence or not isinstance(body, dict):
            return body
        return {("confidence" if k == "place_confidence" else k): v for k, v in body.items()}


class Evidence(BaseModel):
    """What the detector saw: the series it compared and the per-rank factors behind the call."""

    model_config = _CONTRACT

    iterations: list[Count] = Field(default_factory=list, max_length=LIST_MAX)
    observed_s: list[Finite] = Field(default_factory=list, max_length=LIST_MAX)
    predicted_s: list[Finite] = Field(default_factory=list, max_length=LIST_MAX)
    rank_factors: dict[Int32, Finite] = Field(default_factory=dict, max_length=LIST_MAX)
    statistic: str = ""
    note: str = ""
    basis: str = Field(default="", exclude_if=lambda v: not v,
                       description="the kind of evidence the incident's p_real was read from (schema 3; "
                                   "analytics/detection/calibration.py BASES)")
    margin: float | None = Field(default=None, allow_inf_nan=False, exclude_if=lambda v: v is None,
                                 description="how far that evidence passed its alarm bar, in the basis's own "
                                             "units (schema 3)")


# How sure the detector is that an incident's fault is real, calibrated on the detection suite
# (docs/detector.md, "Confidence"); absent (schema 1–2, a baseline detector): uncalibrated.
PReal = Annotated[float | None, Field(
    ge=0, le=1, exclude_if=lambda v: v is None,
    description="probability the fault is real, calibrated on the detection suite (absent: uncalibrated, as "
                "every schema 1–2 incident is)")]


class IncidentOpened(Payload):
    """The detector found something its prediction cannot explain, and says where and why."""

    KIND: ClassVar[str] = "incident.opened"
    # 2 adds Location.measure, 3 p_real and Location.place_confidence (was confidence)
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)
    incident_id: str
    category: FaultCategory
    severity: Severity
    iteration: int = Field(ge=0, le=COUNT_MAX, description="iteration at which it was detected")
    locations: list[Location] = Field(max_length=LIST_MAX)
    evidence: Evidence
    summary: str
    p_real: PReal = None


class IncidentConfirmed(Payload):
    """A suspicion is confirmed: by a probe, by missing heartbeats, or by persisting evidence."""

    KIND: ClassVar[str] = "incident.confirmed"
    # 2 adds Location.measure, 3 p_real and Location.place_confidence (was confidence)
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)
    incident_id: str
    method: ConfirmMethod
    detail: str
    locations: list[Location] = Field(default_factory=list, max_length=LIST_MAX)
    p_real: PReal = None


class IncidentUpdated(Payload):
    """New evidence for an open incident: severity, locations or factors changed."""

    KIND: ClassVar[str] = "incident.updated"
    # 2 adds Location.measure, 3 p_real and Location.place_confidence (was confidence)
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)
    incident_id: str
    iteration: Count
    severity: Severity
    locations: list[Location] = Field(max_length=LIST_MAX)
    evidence: Evidence
    probing: list[Int32] = Field(
        default_factory=list, max_length=LIST_MAX,
        description="ranks a probe is asking again because of this update: a more precise location follows "
                    "(the next update of the incident), so a plan made on this one would soon be stale")
    p_real: PReal = None


class IncidentResolved(Payload):
    """The fault is gone (recovered, or reshaped around) and the incident is closed."""

    KIND: ClassVar[str] = "incident.resolved"
    incident_id: str
    iteration: Count
    reason: str


class ProbeRequest(Payload):
    """Ask ranks to run a short, fixed workload so a suspicion can be confirmed in isolation."""

    KIND: ClassVar[str] = "probe.request"
    probe_id: str
    incident_id: str | None = None
    ranks: list[Int32] = Field(min_length=1, max_length=LIST_MAX)
    target: Literal["compute", "link"] = "compute"
    repeats: int = Field(default=3, ge=1, le=INT32_MAX)


class ProbeResult(Payload):
    """One rank's answer to a probe: how long it took against a healthy device's reference."""

    KIND: ClassVar[str] = "probe.result"
    probe_id: str
    rank: Int32
    duration_s: float = Field(ge=0, le=DURATION_MAX_S)
    reference_s: float = Field(gt=0, le=DURATION_MAX_S, description="what a healthy device takes for the same probe")


# ---- remediation lifecycle ----------------------------------------------------------------------

# A job run's incarnation (collector/epoch_fence.py's ``new_run``): fresh random bits each time an
# executor starts the job, announced in its ``plan.current``; commands name the run they are for.
# Left out of the JSON when absent, so a record written before the field existed keeps the bytes its
# signature covers (collector/auth.py signs the payload as dumped).
RunId = Annotated[str | None, Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$",
                                    exclude_if=lambda v: v is None)]
ExpiresAt = Annotated[float | None, Field(default=None, ge=0, le=TIME_MAX_S, exclude_if=lambda v: v is None)]


NodeAction = Literal["stop", "join"]
# Which waiting spare agent a join names (its NodeSpare.spare); left out of the JSON when absent, so
# an order written before the field existed keeps the bytes its signature covers.
SpareId = Annotated[str | None, Field(default=None, min_length=1, max_length=200, exclude_if=lambda v: v is None)]


class NodeOrder(BaseModel):
    """A node command a plan carries (``PlanProposed.node_orders``): the engine issues it as a
    ``command.node`` with this id once the plan's ``command.reconfigure`` is acknowledged applied,
    so the node stops when nothing of the plan runs on it (docs/remediation.md, "Node plans")."""

    model_config = _CONTRACT

    command_id: str = Field(min_length=1, max_length=200, description="the id of the command.node it issues")
    node: Int32 = Field(description="the agent's group rank in the rendezvous round")
    action: NodeAction
    round: Int32 = Field(description="the rendezvous round the order names (the newest an agent acknowledged, else "
                                     "the engine's --node-round)")
    run: RunId = Field(default=None, description="the job's rendezvous id (--rdzv-id) the order is for")
    devices: list[Int32] = Field(default_factory=list, max_length=LIST_MAX,
                                 description="the devices (global ranks) the engine holds the node to run")
    reason: str = Field(default="", max_length=2000, description="why the detector blames the node")
    spare: SpareId = Field(default=None, description="a join's spare agent (its node.spare id), the one that takes the "
                                                     "place")
    with_command: bool = Field(default=False, exclude_if=lambda v: not v,
                               description="issued with the plan's command, not after its applied ack: the job's devices "
                                           "leave the layout only with their node (plan.capabilities "
                                           "leaves_by_node_stop), so the node's stop is how the layout changes")


class PlanProposed(Payload):
    """The planner's answer to open incidents: a new plan, what it should gain and cost, and a readable diff.
    A node plan (schema 5) also orders nodes: ``node_orders`` stops the nodes the detector blames,
    whose devices the plan leaves out, and (schema 6) joins a waiting spare into each one's place."""

    KIND: ClassVar[str] = "plan.proposed"
    # 2 adds fraction_of_before, 3 not_offered, 4 writes a stage's devices as ranges ("8-15"), 5 node_orders,
    # 6 a join order's spare and an order's with_command
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3, 4, 5, 6)
    plan_id: str
    incident_ids: list[str] = Field(max_length=LIST_MAX)
    strategy: str
    base_epoch: Int32
    plan: ContractPlan
    current_tokens_per_s: float = Field(ge=0, le=RATE_MAX)
    predicted_tokens_per_s: float = Field(ge=0, le=RATE_MAX)
    reshape_cost_s: float = Field(ge=0, le=DURATION_MAX_S)
    diff: list[str] = Field(max_length=LIST_MAX)
    severity: Severity = Severity.MEDIUM
    fraction_of_before: float | None = Field(
        default=None, gt=0, description="a plan that resumes a job hung on a dead device: its predicted tokens/s over "
                                        "the prediction for the layout that ran before the fail-stop; verification "
                                        "compares the measured throughput with what was measured then")
    not_offered: list[str] = Field(default_factory=list, max_length=LIST_MAX, description=(
        "remediations the planner left out because the job's executor declared it cannot run them "
        "(plan.capabilities), each with the executor's reason"))
    node_orders: list[NodeOrder] = Field(
        default_factory=list, max_length=LIST_MAX, exclude_if=lambda v: not v,
        description="node commands the plan issues once it is applied (empty: an in-job plan); left out of the JSON "
                    "when empty, so a schema 1–4 proposal keeps the bytes its signature covers")


class PlanDecision(Payload):
    """An operator's (or the auto-apply policy's) verdict on a proposal."""

    KIND: ClassVar[str] = "plan.decision"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 binds the decision to its proposal (proposal_id, plan_digest)
    plan_id: str
    approve: bool
    actor: str = Field(min_length=1, description="ui:alice, cli:bob, policy:auto")
    comment: str = ""
    proposal_id: str | None = Field(
        default=None, min_length=1, max_length=64, exclude_if=lambda v: v is None,
        description="the event id of the plan.proposed it answers; the fold applies it only to that proposal "
                    "(absent in schema 1, whose decisions are refused)")
    plan_digest: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", exclude_if=lambda v: v is None,
        description="SHA-256 of the proposal's plan in canonical form (collector/plan_lifecycle.py plan_digest); "
                    "it must match the live proposal's plan")


class PolicyMode(StrEnum):
    PROPOSE = "propose"
    AUTO = "auto"


class PolicyChanged(Payload):
    """Per job: propose and wait for an operator, or auto-apply plans of the listed severities whose
    incidents the detector is sure enough are real (``auto_min_p_real``)."""

    KIND: ClassVar[str] = "policy.changed"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 adds auto_min_p_real
    mode: PolicyMode
    auto_severities: list[Severity] = Field(default_factory=list, max_length=16, description="severities auto-applied in auto mode")
    auto_min_p_real: float | None = Field(
        default=None, ge=0, le=1, exclude_if=lambda v: v is None,
        description="in auto mode, a plan is applied without an operator only when every incident it answers has a "
                    "calibrated p_real at least this (absent, as in schema 1: severity alone decides)")
    actor: str = Field(min_length=1)


class ReconfigureCommand(Payload):
    """Move the job to ``plan`` (whose epoch is the current epoch + 1)."""

    KIND: ClassVar[str] = "command.reconfigure"
    # 2 writes a stage's devices as ranges ("8-15"), 3 adds run and expires_at_s
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)
    command_id: str
    plan_id: str
    plan: ContractPlan
    run: RunId = Field(default=None, description="the run incarnation it is for (the executor's plan.current names it); an "
                                   "executor of another run refuses it")
    expires_at_s: ExpiresAt = Field(default=None, description="Unix time after which no executor obeys it (issued time + a "
                                                "bounded TTL, collector/epoch_fence.py)")


class AckStatus(StrEnum):
    """What the trainer did with a command (the epoch fence refuses stale and duplicated ones)."""

    APPLIED = "applied"
    IGNORED_STALE = "ignored_stale"
    IGNORED_DUPLICATE = "ignored_duplicate"
    FAILED = "failed"


class CommandAck(Payload):
    """The trainer's answer to a command: applied (with the pause it cost) or why not."""

    KIND: ClassVar[str] = "command.ack"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 adds run
    command_id: str
    plan_id: str
    epoch: int = Field(ge=0, le=INT32_MAX, description="the epoch the command asked for")
    status: AckStatus
    running_epoch: int = Field(ge=0, le=INT32_MAX, description="the epoch the trainer runs after handling it")
    pause_s: float = Field(default=0.0, ge=0, le=DURATION_MAX_S)
    pause_iterations: int = Field(default=0, ge=0, le=COUNT_MAX)
    detail: str = ""
    run: RunId = Field(default=None, description="the run incarnation of the executor that answered: a restarted listener of "
                                   "that run rebuilds its fence from these")


class RenamedOnWire(Payload):
    """A payload whose newest schema renamed fields: an older event's names (``OLD_NAMES``, old →
    new) are read as the new ones and written back under the names it came with, because the bytes
    a signature covers are the ones it was signed with; a re-encoded old event that wrote the new
    names would no longer verify."""

    OLD_NAMES: ClassVar[dict[str, str]] = {}
    _old_names: bool = PrivateAttr(default=False)  # the wire used OLD_NAMES: written back the same

    @model_validator(mode="wrap")
    @classmethod
    def _read_old_names(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> RenamedOnWire:
        old = data._old_names if isinstance(data, RenamedOnWire) else False
        if (isinstance(data, dict) and any(name in data for name in cls.OLD_NAMES)
                and not any(name in data for name in cls.OLD_NAMES.values())):
            data, old = {cls.OLD_NAMES.get(k, k): v for k, v in data.items()}, True
        payload = handler(data)
        payload._old_names = old
        return payload

    @model_serializer(mode="wrap")
    def _write_names_as_read(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if not self._old_names or not isinstance(body, dict):
            return body
        new_to_old = {new: old for old, new in self.OLD_NAMES.items()}
        return {(new_to_old[k] if k in new_to_old else k): v for k, v in body.items()}


class NodeCommand(RenamedOnWire):
    """An order for one node agent of a ``resihp run`` job (docs/agent.md, "Node commands").

    ``stop``: the agent of ``node`` stops its ranks (SIGTERM, then SIGKILL after its grace) and
    leaves; under ``--on-failure shrink`` the other nodes go on without them, as past a dead agent.
    ``join``: a spare agent waiting with ``--join-running --join-on-command`` takes the place that
    ``node`` left: the spare ``spare`` names (schema 4; its ``node.spare`` id), or any spare. ``round`` is the job's rendezvous round the command was decided in (each agent
    prints it, and acks carry it): node numbers hold within one round, so a command of another
    round is stale. Signed by the engine or an operator; the agent answers with ``command.node_ack``.

    Schema 3 names the round ``round`` (``epoch`` is the plan's, everywhere else); a schema 1–2
    command's ``epoch`` is read as its round and written back under that name, so the bytes its
    signature covers are the ones it was signed with."""

    KIND: ClassVar[str] = "command.node"
    # 2 adds run and expires_at_s; 3 renames epoch to round; 4 adds spare
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    OLD_NAMES: ClassVar[dict[str, str]] = {"epoch": "round"}
    command_id: str = Field(min_length=1, max_length=200)
    node: Int32 = Field(description="the agent's group rank in the rendezvous round (\"node N\" in its messages)")
    action: NodeAction
    round: Int32 = Field(description="the rendezvous round the command was decided in (schema 1–2: epoch)")
    reason: str = Field(default="", max_length=2000, description="why, for the log and the console")
    actor: str | None = Field(default=None, max_length=200, description="the operator (cli:NAME, ui:NAME) when a person "
                                                                        "decided it")
    run: RunId = Field(default=None, description="the job's rendezvous id (--rdzv-id) it is for; an agent of another run "
                                   "refuses it")
    expires_at_s: ExpiresAt = Field(default=None, description="Unix time after which no agent obeys it")
    spare: SpareId = Field(default=None, description="a join: the spare agent (its node.spare id) that takes the place; "
                                                     "None: any spare waiting for an order")


class NodeCommandAck(RenamedOnWire):
    """A node agent's answer to a ``command.node`` addressed to it: ``applied`` (with what it did),
    ``ignored_stale`` (another rendezvous round), ``ignored_duplicate`` (a command id handled
    before) or ``failed`` (it cannot be obeyed: the node hosts the job's stores, no such node, no
    place to join). An unsigned or unauthorised command gets no ack but a ``control.rejected``.

    Schema 3 names the rounds ``round`` and ``running_round``, as :class:`NodeCommand` does; a
    schema 1–2 ack's ``epoch`` and ``running_epoch`` are read as those and written back under their
    old names, so an ack signed before the rename still verifies."""

    KIND: ClassVar[str] = "command.node_ack"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)  # 2 adds run; 3 renames epoch, running_epoch to round, running_round
    OLD_NAMES: ClassVar[dict[str, str]] = {"epoch": "round", "running_epoch": "running_round"}  # schema 1–2 → 3
    command_id: str = Field(min_length=1, max_length=200)
    node: Int32
    action: NodeAction
    round: Int32 = Field(description="the rendezvous round the command named (schema 1–2: epoch)")
    status: AckStatus
    running_round: Int32 = Field(description="the rendezvous round the agent is in (schema 1–2: running_epoch)")
    ranks: list[Int32] = Field(default_factory=list, max_length=LIST_MAX, description="the global ranks it acted on")
    detail: str = Field(default="", max_length=2000)
    run: RunId = Field(default=None, description="the run of the agent that answered: a restarted agent of that run treats the "
                                   "command ids it answered as answered")


class NodeSpare(Payload):
    """A spare node agent (``resihp run --join-running --join-on-command``) waiting to take the
    place a node of run ``run`` leaves: the engine can plan a blamed node's replacement only when
    it knows one waits (docs/remediation.md, "Node plans"). The spare says so when it starts and
    again every ``interval`` until it takes a place or gives up (``waiting`` false); a claim past
    ``expires_at_s`` is stale (the spare died without saying so). Signed as the executor, as the
    agent's acks are."""

    KIND: ClassVar[str] = "node.spare"
    spare: str = Field(min_length=1, max_length=200, description="the spare agent's id: what a join order names")
    run: RunId = Field(default=None, description="the job's rendezvous id (--rdzv-id) whose place it waits for")
    ranks: Int32 = Field(ge=1, description="how many ranks it starts: it takes only a place of that many")
    waiting: bool = Field(description="false: it took a place or stopped waiting, and takes no order")
    expires_at_s: ExpiresAt = Field(default=None, description="Unix time after which the claim is stale unless renewed")
    detail: str = Field(default="", max_length=2000)


class PlanVerified(Payload):
    """Measured throughput under the applied plan matches its prediction, or the plan is kept
    because rolling it back would be slower (``reason`` says which)."""

    KIND: ClassVar[str] = "plan.verified"
    plan_id: str
    measured_tokens_per_s: float = Field(ge=0, le=RATE_MAX)
    predicted_tokens_per_s: float = Field(ge=0, le=RATE_MAX)
    reason: str | None = Field(
        default=None, description="the measured change against the predicted one, and why a plan that fell short of "
        "it is kept; None from an engine that did not say")


class PlanRolledBack(Payload):
    """Measured throughput under the applied plan fell short; the previous layout is restored."""

    KIND: ClassVar[str] = "plan.rolled_back"
    plan_id: str
    reason: str
    measured_tokens_per_s: float = Field(ge=0, le=RATE_MAX)
    predicted_tokens_per_s: float = Field(ge=0, le=RATE_MAX)


class PlanWithheld(Payload):
    """Why the engine did not plan for the open incidents now, or planned around one only in part:
    the planner refused (too few devices left to hold the model), an incident waits to be located
    or for a probe's answer, a failed layout would be proposed again, a roll-back is impossible.
    Published once per reason, so an operator sees on the console what the engine's log says."""

    KIND: ClassVar[str] = "plan.withheld"
    reason: str = Field(min_length=1)
    base_epoch: int = Field(ge=0, le=INT32_MAX, description="the plan epoch running when the engine decided")
    incident_ids: list[str] = Field(default_factory=list, max_length=LIST_MAX, description="the incidents open then")
    waiting: bool = Field(default=False, description="true: it waits for something due (a location, a probe's "
                                                     "answer) and plans once it comes; false: it cannot plan")


class PlanCurrent(Payload):
    """The plan a job runs now, with what a planner needs to know of the model. Published by the
    trainer (or simulator) at start and after every applied reshape, so that no consumer needs
    the plan on its command line."""

    KIND: ClassVar[str] = "plan.current"
    # 2 writes a stage's devices as ranges ("8-15"), 3 adds run
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2, 3)
    plan: ContractPlan
    reason: PlanCurrentReason = "start"
    gpus_per_node: int = Field(default=8, ge=1, le=INT32_MAX)
    model_name: str = ""
    layer_state_bytes: int = Field(default=0, ge=0, le=COUNT_MAX,
                                   description="parameters + optimizer state of one layer")
    tokens_per_microbatch: int = Field(default=0, ge=0, le=TOKENS_MAX)
    run: RunId = Field(default=None, description="the run incarnation: new random bits each time the executor starts the job, the "
                                   "same for every plan.current of that run; commands must name it")


class ExecutorCapabilities(Payload):
    """Which remediations the job's executor can run, declared by the executor (signed) at start,
    so the planner proposes only plans the job can apply and says in each plan what it left out
    and why. A job that never declares is planned for as if it could run everything (the
    reference trainer can). The rules that judge a plan against a declaration live in
    collector/capabilities.py."""

    KIND: ClassVar[str] = "plan.capabilities"
    VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # 2 adds leaves_by_node_stop
    executor: str = Field(min_length=1, max_length=200, description="reference, native, or a loop's own name")
    tp_shrink: Literal["per_stage", "uniform", "no"] = Field(
        default="per_stage", description="per_stage: any stage may run at its own TP degree; uniform: only every "
                                         "stage of every replica together; no: TP degrees never change")
    tp_exclusion: bool = Field(default=True, description="a stage can drop one device of its TP group (TP 4 → 3, or "
                                                         "one stage at a smaller degree than the rest)")
    pp_repartition: Literal["per_replica", "uniform", "no"] = Field(
        default="per_replica", description="per_replica: each replica's layer ranges may differ; uniform: at layer "
                                           "granularity, the same ranges in every replica; no: layers never move")
    dp_drop: bool = True
    dp_microbatch_migration: bool = Field(default=True, description="replicas may run different micro-batch counts")
    spares: bool = Field(default=True, description="devices of the world may idle outside the plan (and come back)")
    leaves_by_node_stop: bool = Field(
        default=False, exclude_if=lambda v: not v,
        description="devices leave the layout only with their node, whose stop drains their ranks at a step boundary "
                    "(a shrinking data-parallel world): a node plan's orders go out with its command, which the "
                    "executor acknowledges applied once the node's ranks have left")
    schedules: list[str] = Field(default_factory=lambda: list(SCHEDULES), max_length=64)
    notes: dict[str, str] = Field(default_factory=dict, description="the executor's own words per remediation "
                                                                    "(tp_shrink, pp_repartition …), quoted in plans")


class CostFit(BaseModel):
    """One fitted line of the cost model: T = alpha·N + beta·Σl² + gamma for a (stage, kind)."""

    model_config = _CONTRACT

    stage: Int32
    kind: ChunkKind
    alpha_s_per_token: Finite
    beta_s_per_token_sq: Finite
    gamma_s: Finite
    samples: Count
    rel_error: Finite | None = Field(default=None, description="recent median |observed − predicted| / predicted")
    workload_cv: float | None = Field(
        default=None, ge=0, description="relative spread of the line's prediction over the window's micro-batches: how "
        "much the packed mix (N, Σl²) moves one micro-batch's chunk time, a spread its chunks share at every stage")
    mean_sum_sq_len: float | None = Field(
        default=None, ge=0, description="mean Σlᵢ² (tokens²) of the window's micro-batches: what beta multiplies for a "
        "typical one; absent when sequence lengths were not reported")


class CostModelFitted(IterationPayload):
    """The detector's current cost model, published when it changes, for the planner to score with."""

    KIND: ClassVar[str] = "analytics.cost_model"
    fits: list[CostFit] = Field(max_length=LIST_MAX)


# ---- ground truth and the dead letters ----------------------------------------------------------


class FaultInjected(Payload):
    """Ground truth from the simulator or the trainer's failure injection: what, where, when."""

    KIND: ClassVar[str] = "truth.fault"
    fault_id: str
    category: FaultCategory
    location: Location
    start_iteration: Count
    end_iteration: int | None = Field(default=None, ge=0, le=COUNT_MAX, description="exclusive; None while it lasts")


DEADLETTER_REASON_MAX = 2_000


class SignInFailed(Payload):
    """The operators' console refused a sign-in. Never holds a password, and names the user only when
    the name exists (a mistyped name may be a password typed into the wrong field). When this failure
    locks the user name or the client out, ``locks`` says which and ``locked_until_s`` until when."""

    KIND: ClassVar[str] = "ui.signin_failed"
    user: str = Field(default="", max_length=64, description="the user name if it exists; empty otherwise")
    client: str = Field(max_length=200, description="the client address the console saw")
    reason: Literal["unknown_user", "wrong_password"]
    user_failures: int = Field(ge=0, le=COUNT_MAX, description="consecutive failures for this user name")
    client_failures: int = Field(ge=0, le=COUNT_MAX, description="consecutive failures from this client")
    locks: list[Literal["user", "client"]] = Field(default_factory=list)
    locked_until_s: float | None = Field(default=None, ge=0, le=TIME_MAX_S, description="Unix time the new lock ends")


class DeadLetter(Payload):
    """A record that could not be decoded, kept with its raw bytes and the reason. A record too large
    to carry whole keeps a prefix, its length and its SHA-256, so a dead letter always fits the bus."""

    KIND: ClassVar[str] = "deadletter"
    topic: str = Field(max_length=1000)
    partition: Int32
    offset: Count
    group: str = Field(max_length=1000)
    reason: str = Field(max_length=DEADLETTER_REASON_MAX)
    raw_b64: str = Field(description="the record's bytes (a prefix when raw_length says it was longer)")
    raw_length: int | None = Field(default=None, ge=0, le=COUNT_MAX,
                                   description="the record's length in bytes when raw_b64 holds only a prefix")
    raw_sha256: str | None = Field(default=None, max_length=64,
                                   description="hex SHA-256 of the whole record, when raw_b64 holds only a prefix")


class ControlRejected(Payload):
    """A reader refused a control event (unsigned, signed by a role that may not write it, or
    asking for more work than it allows) and did not act on it; published once per event id by the
    reader that refused it (collector/auth.py)."""

    KIND: ClassVar[str] = "control.rejected"
    event_id: str
    kind: str
    source: str
    reason: str = Field(min_length=1)
    reader: str = Field(default="", description="who refused it: remediation, trainer, simulator, ...")


PAYLOAD_TYPES: tuple[type[Payload], ...] = (
    RankIteration, IterationSummary, Heartbeat, TracingDeclared, HangReported, RecoveryPhase, ReshapePhase,
    IterationPrediction, RankHealth, AnalyticsLease, ReplicaSummary, DetectorFits, LivenessBatch, BusOutage,
    TelemetryNotice,
    IncidentOpened, IncidentConfirmed, IncidentUpdated, IncidentResolved, ProbeRequest, ProbeResult,
    PlanProposed, PlanDecision, PolicyChanged, ReconfigureCommand, CommandAck, NodeCommand, NodeCommandAck,
    NodeSpare,
    PlanVerified, PlanRolledBack,
    PlanWithheld, PlanCurrent, ExecutorCapabilities, CostModelFitted,
    FaultInjected, DeadLetter, SignInFailed, ControlRejected,
)
PAYLOAD_BY_KIND: dict[str, type[Payload]] = {p.KIND: p for p in PAYLOAD_TYPES}


# ---- the envelope -------------------------------------------------------------------------------


ENVELOPE_HEADER: tuple[str, ...] = ("id", "kind", "schema_version", "job", "source", "seq", "time_s")
# ``KEY_ID:HEX``: who signed (a role, or a role and a person) and the signature's bytes in lower-case hex.
# Checked at decode, so a reader's verifier only ever meets ASCII of a known shape: anything else on the
# wire is a dead letter, never a comparison that raises (collector/auth.py).
SIGNATURE_PATTERN = r"^[a-z][a-z0-9_.@+-]{0,63}:(?:[0-9a-f]{64}|[0-9a-f]{128})$"


class Envelope(BaseModel):
    """Header every event carries. Consumers are idempotent on ``id``."""

    model_config = _CONTRACT

    id: str = Field(min_length=1, max_length=64, description="unique; consumers dedupe on it")
    kind: str = Field(description="names the payload type (see Kinds)")
    schema_version: int = Field(ge=0, le=INT32_MAX, description="version of the payload schema; the newest is written")
    job: str = Field(min_length=1, max_length=200, description="the training job")
    source: str = Field(min_length=1, max_length=200, description="rank-5, analytics, ui:alice, ...")
    seq: int = Field(ge=0, le=COUNT_MAX, description="per-source sequence number")
    time_s: float = Field(ge=0, le=TIME_MAX_S, description="Unix time at the source")
    payload: Payload = Field(description="one of the kinds below")
    signature: str | None = Field(
        default=None, max_length=200, pattern=SIGNATURE_PATTERN, exclude_if=lambda v: v is None,
        description="role:HMAC-SHA256 of the canonical event, on control events only (collector/auth.py); absent "
                    "on telemetry")

    @field_validator("schema_version")
    @classmethod
    def _check_version(cls, version: int, info: ValidationInfo) -> int:
        # A field validator, not a model "before" validator: that would make pydantic build the
        # whole record as Python objects first and lose the direct JSON path (~1.5x slower decode).
        kind = info.data.get("kind")
        payload_type = PAYLOAD_BY_KIND.get(kind) if isinstance(kind, str) else None
        if payload_type is not None and version not in payload_type.VERSIONS:
            lo, hi = min(payload_type.VERSIONS), max(payload_type.VERSIONS)
            raise ValueError(
                f"unknown schema version {version!r} for {kind} (this build reads {lo}–{hi}); "
                f"upgrade the consumer or re-publish with schema {hi}"
            )
        return version


def _event_type(payload_type: type[Payload]) -> type[Envelope]:
    return create_model(
        f"{payload_type.__name__}Event",
        __base__=Envelope,
        __doc__=f"An envelope around a {payload_type.__name__} payload.",
        kind=(Literal[payload_type.KIND], payload_type.KIND),  # type: ignore[arg-type]  # Literal of a runtime value
        payload=(payload_type, ...),
    )


EVENT_TYPES: dict[str, type[Envelope]] = {k: _event_type(p) for k, p in PAYLOAD_BY_KIND.items()}
# One event type per payload kind, known only when the payload classes have been defined: mypy cannot
# read a Union (nor a Literal, above) built from run-time values, which pydantic needs to discriminate.
Event = Annotated[Union[tuple(EVENT_TYPES.values())], Field(discriminator="kind")]  # type: ignore[valid-type]
EVENT_ADAPTER: TypeAdapter[Envelope] = TypeAdapter(Event)  # type: ignore[arg-type]  # a Union built at run time


_SET_FIELDS_SET = BaseModel.__dict__["__pydantic_fields_set__"].__set__  # the slots' own setters: a third
_SET_EXTRA = BaseModel.__dict__["__pydantic_extra__"].__set__  # cheaper than object.__setattr__'s look-up
_SET_PRIVATE = BaseModel.__dict__["__pydantic_private__"].__set__
Model = TypeVar("Model", bound=BaseModel)


def construct_checked(cls: type[Model], values: dict[str, Any], fields_set: set[str]) -> Model:
    """A model of ``cls`` from values checked already: what ``model_construct`` does, without its
    per-field loop (a rank report's decode and a factory's envelope are a few microseconds).
    ``values`` holds every field, in a dict the model then owns; ``fields_set`` is what
    ``model_fields_set`` answers, and may be shared by the models built with it: a frozen model
    never adds to it, and ``model_copy`` copies it before adding the names it updates. Not for a
    model with private attributes (it would have none)."""
    obj = object.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    _SET_FIELDS_SET(obj, fields_set)
    _SET_EXTRA(obj, None)
    _SET_PRIVATE(obj, None)
    return obj


def new_event_id() -> str:
    """A random UUID (version 4) as 32 hex digits, as ``uuid.uuid4().hex`` writes it, at a third of
    its cost (the ``UUID`` object in between is most of it; every event a process makes needs one)."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    return raw.hex()


# What ``model_fields_set`` answers for an envelope a factory made (shared: a frozen model never adds
# to it, and ``model_copy`` copies it before adding the names it updates).
_MADE_FIELDS = {"id", "kind", "schema_version", "job", "source", "seq", "time_s", "payload"}


class EventFactory:
    """Wraps payloads in envelopes for one source, numbering them.

    ``seq`` restarts at ``first_seq``; a source that restarts should pass the last sequence number
    it knows it published, or consumers will see a gap reset (harmless: they key on ``id``).
    """

    def __init__(self, job: str, source: str, first_seq: int = 0) -> None:
        self.job = job
        self.source = source
        self._seq = itertools.count(first_seq)
        self._checked: set[tuple] = set()  # (payload type, job, source) whose envelope validated once here

    def make(self, payload: Payload, *, time_s: float | None = None, event_id: str | None = None) -> Envelope:
        event_type = EVENT_TYPES[payload.KIND]
        seq = next(self._seq)
        now_s = time.time() if time_s is None else time_s
        fields: dict[str, Any] = {"id": event_id or new_event_id(), "kind": payload.KIND,
                                  "schema_version": max(payload.VERSIONS), "job": self.job, "source": self.source,
                                  "seq": seq, "time_s": now_s, "payload": payload}
        checked = (type(payload), self.job, self.source)
        if (event_id is None and time_s is None and checked in self._checked and seq <= COUNT_MAX
                and 0.0 <= now_s <= TIME_MAX_S):
            # What validation would check again: the same job, source, kind and version as an
            # envelope of this payload type that validated here, a fresh id, a sequence number and
            # the clock in range. The payload is a model already (pydantic keeps an instance as it
            # is). Validating each one cost a rank's publish a fifth of its time.
            fields["signature"] = None
            return construct_checked(event_type, fields, _MADE_FIELDS)
        event = event_type(**fields)
        if event_id is None and time_s is None:
            self._checked.add(checked)
        return event
