"""torch.profiler traces -> the contract: what `resihp import` does, as pure Python (no torch).

A job run without us can still be judged: each rank's Chrome/Kineto trace (``prof.export_chrome_trace``
or ``tensorboard_trace_handler``) plus a small layout (per rank its tp / pp / dp coordinates, the
schedule, micro-batches, layers) becomes the events a live job would have published: ``plan.current``,
a ``telemetry.tracing`` declaration (dialect ``profiler``: what these traces hold and what they do not),
and one ``telemetry.iteration`` per rank per profiled step.

How a trace is read, per rank, on that rank's own clock only (two ranks' timestamps are never
subtracted):

- **Steps**: every ``ProfilerStep#N`` span is iteration N; its duration is ``wall_s``.
- **Chunks**: ``record_function`` spans named as torch.distributed.pipelining's schedules name them
  (``PP:{stage}{F|B|I|W}{mb}`` from the runtime schedules, ``Forward {mb}`` / ``Backward {mb}`` from
  GPipe / 1F1B). A chunk's duration is its span less the communication inside it (a blocking recv
  inside a forward span is waiting, not compute). A step without such spans becomes one forward and
  one backward chunk: forward until the first autograd backward op, backward until the last one.
- **Communication**: the ``c10d::`` op on the step's thread merged with the ``gloo:`` / ``nccl:``
  span that does its work; blocking calls hold the wait for the peer, so every op says
  ``includes_wait=True``. p2p peers come from the trace's args when it records them, else from the
  layout and the chunk around the op (a forward sends down the pipeline, a backward up).

What can go wrong: every problem is an ``ImportProblem`` whose message is one line naming the file
(not JSON, truncated, no ``traceEvents``, no rank, no profiled step, a layout field this build does
not know, a rank the layout lacks).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import uuid
import zlib
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from collector.auth import Signer
from collector.codec import one_line
from collector.events import (
    Chunk, ChunkKind, CommOp, CommWait, Coords, Envelope, EventFactory, PlanCurrent, RankIteration,
    TracingDeclared,
)
from collector.plan import PipelinePlan, Plan, Schedule, StagePlan

_NS = uuid.UUID("5d0c7e9a-61b4-4f2e-8a3c-2b9f4e6d1a70")  # event ids: the same import gives the same ids


class ImportProblem(ValueError):
    """Input `resihp import` cannot use; the message is one line that names the file."""


# ---- the layout --------------------------------------------------------------------------------


class RankLayout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="the rank as torch.distributed numbers it (the trace's distributedInfo.rank)")
    tp: int = Field(default=0, ge=0)
    pp: int = Field(ge=0)
    dp: int = Field(default=0, ge=0)
    cp: int = Field(default=0, ge=0)
    node: int | None = Field(default=None, ge=0)


class Layout(BaseModel):
    """What the traces cannot say: where each rank sat and what the job ran."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str | None = Field(default=None, min_length=1, max_length=200)
    schedule: Schedule = "1f1b"
    virtual_stages: int = Field(default=1, ge=1)
    microbatches: int = Field(ge=1, description="micro-batches per DP replica per step")
    num_layers: int = Field(ge=1)
    tokens_per_microbatch: int | None = Field(default=None, ge=1, description="omit when unknown")
    gpus_per_node: int = Field(default=8, ge=1)
    ranks: list[RankLayout] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Layout:
        seen: dict[int, RankLayout] = {}
        coords: set[tuple[int, int, int, int]] = set()
        for r in self.ranks:
            if r.rank in seen:
                raise ValueError(f"rank {r.rank} is listed twice")
            seen[r.rank] = r
            key = (r.dp, r.pp, r.cp, r.tp)
            if key in coords:
                raise ValueError(f"two ranks share dp={r.dp} pp={r.pp} cp={r.cp} tp={r.tp}")
            coords.add(key)
        return self

    def by_rank(self) -> dict[int, RankLayout]:
        return {r.rank: r for r in self.ranks}

    def plan(self) -> Plan:
        """The layout as a Plan (epoch 0). Device ids are the ranks. The plan has no CP dimension:
        a stage's devices are its CP × TP ranks, CP-major; layers are split evenly, earlier stages
        taking the remainder (the split of ``Plan.uniform``)."""
        replicas = sorted({r.dp for r in self.ranks})
        if replicas != list(range(len(replicas))):
            raise ValueError(f"dp coordinates must be 0..{len(replicas) - 1}, got {replicas}")
        pipelines = []
        for d in replicas:
            mine = [r for r in self.ranks if r.dp == d]
            stages = sorted({r.pp for r in mine})
            if stages != list(range(len(stages))):
                raise ValueError(f"replica {d}: pp coordinates must be 0..{len(stages) - 1}, got {stages}")
            if self.num_layers < len(stages):
                raise ValueError(f"{self.num_layers} layers cannot fill {len(stages)} pipeline stages")
            base, extra = divmod(self.num_layers, len(stages))
            first, built = 0, []
            for s in stages:
                devices = tuple(r.rank for r in sorted((r for r in mine if r.pp == s), key=lambda r: (r.cp, r.tp)))
                end = first + base + (1 if s < extra else 0)
                built.append(StagePlan(devices=devices, first_layer=first, end_layer=end))
                first = end
            pipelines.append(PipelinePlan(replica=d, microbatches=self.microbatches, stages=tuple(built)))
        return Plan(epoch=0, schedule=self.schedule, virtual_stages=self.virtual_stages,
                    num_layers=self.num_layers, pipelines=tuple(pipelines))


def load_layout(path: str | Path) -> Layout:
    """Read a layout (YAML, or JSON, which YAML reads too)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportProblem(f"{p}: cannot read the layout ({exc})") from None
    except yaml.YAMLError as exc:
        raise ImportProblem(f"{p}: not YAML or JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ImportProblem(f"{p}: a layout is a mapping with ranks, microbatches and num_layers")
    try:
        layout = Layout.model_validate(data)
        layout.plan()
    except ValidationError as exc:
        raise ImportProblem(f"{p}: invalid layout: {one_line(exc, '<layout>')}") from None
    except ValueError as exc:
        raise ImportProblem(f"{p}: invalid layout: {exc}") from None
    return layout


# ---- one rank's Kineto trace -------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    name: str
    tid: Any
    ts_us: float
    dur_us: float
    args: dict

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


@dataclass
class RankTrace:
    """The spans of one rank's trace that the import uses."""

    path: Path
    rank: int
    base_ns: int | None
    steps: list[tuple[int, Span]] = field(default_factory=list)  # (step number, span), in time order
    annotations: list[Span] = field(default_factory=list)
    comm: list[Span] = field(default_factory=list)
    backward_ops: list[Span] = field(default_factory=list)


MIB = 1 << 20
MAX_TRACE_BYTES = 2048 * MIB  # one rank's decompressed trace; resihp import --max-trace-mib raises it
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:")


def _gunzip(p: Path, max_bytes: int) -> bytes:
    """``p`` decompressed, refused past ``max_bytes``: a few kilobytes of gzip can inflate to
    gigabytes, and the whole text is held in memory to parse it."""
    out = bytearray()
    with gzip.open(p, "rb") as f:
        while chunk := f.read(min(1 << 20, max_bytes + 1 - len(out))):
            out += chunk
            if len(out) > max_bytes:
                raise ImportProblem(f"{p}: decompresses to more than {max_bytes:,} bytes (--max-trace-mib "
                                    f"{max_bytes // MIB}); pass a larger --max-trace-mib if the trace is that big")
    return bytes(out)


def read_kineto(path: str | Path, rank: int | None = None, *, max_bytes: int = MAX_TRACE_BYTES) -> RankTrace:
    """Read one rank's trace. ``rank`` overrides the trace's own ``distributedInfo.rank``; a gzip
    file (``*.gz``) may decompress to at most ``max_bytes``."""
    p = Path(path)
    try:
        if p.name.endswith(".gz"):  # tensorboard_trace_handler(use_gzip=True)
            raw = _gunzip(p, max_bytes)
        else:
            raw = p.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ImportProblem(f"{p}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError:
        raise ImportProblem(f"{p}: not a torch.profiler trace (not UTF-8 text; expected Chrome-trace JSON)") from None
    except json.JSONDecodeError as exc:
        what = "truncated or damaged JSON" if raw.lstrip()[:1] in (b"{", b"[") else "not a torch.profiler trace (not JSON)"
        raise ImportProblem(f"{p}: {what} ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                            "re-export it with prof.export_chrome_trace") from None
    if isinstance(doc, list):  # the bare-array Chrome trace form
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ImportProblem(f"{p}: not a torch.profiler trace (JSON without a traceEvents list)")
    info = doc.get("distributedInfo")
    if not isinstance(info, dict):
        info = {}
    if rank is None:
        rank = info.get("rank")
        if not isinstance(rank, int) or rank < 0:
            named = _RANK_IN_NAME.search(p.name)
            rank = int(named.group(1)) if named else None
        if rank is None:
            raise ImportProblem(f"{p}: the trace does not say its rank (no distributedInfo.rank); "
                                "name the file rank<N>.json")
    base = doc.get("baseTimeNanoseconds")
    trace = RankTrace(path=p, rank=rank, base_ns=base if isinstance(base, int) else None)
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        name, ts, dur = e.get("name"), e.get("ts"), e.get("dur")
        if not isinstance(name, str) or not _finite(ts) or not _finite(dur) or dur < 0:
            raise ImportProblem(f"{p}: event {i} ({name!r}) has no valid ts/dur; the trace is damaged")
        cat = e.get("cat", "")
        args = e.get("args")
        if not isinstance(args, dict):
            args = {}
        span = Span(name, e.get("tid"), float(ts), float(dur), args)
        if cat == "user_annotation" and (m := _STEP.match(name)):
            trace.steps.append((int(m.group(1)), span))
        elif name.startswith(_COMM_PREFIXES) and cat in ("cpu_op", "user_annotation", ""):
            trace.comm.append(span)
        elif cat == "user_annotation":
            trace.annotations.append(span)
        elif cat == "cpu_op" and name.startswith("autograd::engine::evaluate_function"):
            trace.backward_ops.append(span)
    if not trace.steps:
        raise ImportProblem(f"{p}: no ProfilerStep#N spans: profile with a schedule and call prof.step() "
                            "once per training step")
    trace.steps.sort(key=lambda s: s[1].ts_us)
    return trace


def _finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- spans -> chunks and communication ---------------------------------------------------------


_PP_ACTION = re.compile(r"^PP:(\d+)(F|B|I|W)(\d+)$")  # torch.distributed.pipelining runtime schedules
_GPIPE = re.compile(r"^(Forward|Backward) (\d+)$")  # ScheduleGPipe / Schedule1F1B


@dataclass(frozen=True)
class ChunkSpan:
    kind: ChunkKind
    microbatch: int
    virtual_stage: int
    span: Span


def chunk_spans(annotations: Iterable[Span], num_stages: int) -> list[ChunkSpan]:
    out = []
    for s in annotations:
        if m := _PP_ACTION.match(s.name):
            stage, letter, mb = int(m.group(1)), m.group(2), int(m.group(3))
            kind = {"F": ChunkKind.FORWARD, "B": ChunkKind.BACKWARD, "I": ChunkKind.BACKWARD,
                    "W": ChunkKind.WEIGHT}[letter]
            out.append(ChunkSpan(kind, mb, stage // max(1, num_stages), s))
        elif m := _GPIPE.match(s.name):
            kind = ChunkKind.FORWARD if m.group(1) == "Forward" else ChunkKind.BACKWARD
            out.append(ChunkSpan(kind, int(m.group(2)), 0, s))
    return sorted(out, key=lambda c: c.span.ts_us)


def _comm_op(name: str) -> CommOp | None:
    n = name.split(":")[-1].lower()
    if "send" in n and "recv" in n:
        return CommOp.PP_SENDRECV
    if "allreduce" in n or "all_reduce" in n:
        return CommOp.DP_ALLREDUCE
    if "allgather" in n or "all_gather" in n:
        return CommOp.ALL_GATHER
    if "reduce_scatter" in n:
        return CommOp.REDUCE_SCATTER
    if "send" in n:
        return CommOp.PP_SEND
    if "recv" in n:
        return CommOp.PP_RECV
    return None  # broadcast, barrier, ...: not what the detector judges


@dataclass(frozen=True)
class CommSpan:
    op: CommOp
    ts_us: float
    end_us: float
    args: dict


def merged_comm(comm: Sequence[Span], tid: Any) -> list[CommSpan]:
    """Communication on the step's thread: a ``c10d::`` call and the backend span that does its work
    (which starts inside the call and may outlast it) become one op spanning both; a backend span
    on its own (an async op's work) counts too."""
    out: list[CommSpan] = []
    for s in sorted((s for s in comm if s.tid == tid), key=lambda s: s.ts_us):
        op = _comm_op(s.name)
        if op is None:
            continue
        last = out[-1] if out else None
        if (last is not None and not s.name.startswith("c10d::") and s.ts_us <= last.end_us
                and last.op is op):
            out[-1] = CommSpan(op, last.ts_us, max(last.end_us, s.end_us), {**last.args, **s.args})
        else:
            out.append(CommSpan(op, s.ts_us, s.end_us, dict(s.args)))
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _peer_from_args(args: dict, op: CommOp) -> int | None:
    keys = ("dst rank", "Dst Rank", "dst_rank") if op is CommOp.PP_SEND else ("src rank", "Src Rank", "src_rank")
    for k in keys:
        v = args.get(k)
        if isinstance(v, int) and v >= 0:
            return v
    return None


@dataclass(frozen=True)
class Neighbours:
    """The ranks one rank exchanges activations with: same replica, CP and TP rank, adjacent stage."""

    previous: int | None
    next: int | None


def neighbours(layout: Layout) -> dict[int, Neighbours]:
    at = {(r.dp, r.pp, r.cp, r.tp): r.rank for r in layout.ranks}
    return {r.rank: Neighbours(at.get((r.dp, r.pp - 1, r.cp, r.tp)), at.get((r.dp, r.pp + 1, r.cp, r.tp)))
            for r in layout.ranks}


def rank_iterations(trace: RankTrace, layout: Layout, *, epoch: int = 0) -> list[tuple[float | None, RankIteration]]:
    """One ``RankIteration`` per profiled step of ``trace``, each with the step's end as Unix time
    (None when the trace has no base time)."""
    me = layout.by_rank().get(trace.rank)
    if me is None:
        raise ImportProblem(f"{trace.path}: rank {trace.rank} is not in the layout "
                            f"(it lists {sorted(layout.by_rank())})")
    num_stages = len({r.pp for r in layout.ranks if r.dp == me.dp})
    near = neighbours(layout)[trace.rank]
    tp_size = sum(1 for r in layout.ranks if (r.dp, r.pp, r.cp) == (me.dp, me.pp, me.cp))
    dp_size = len({r.dp for r in layout.ranks})
    tokens = layout.tokens_per_microbatch
    out = []
    for number, step in trace.steps:
        t0, t1 = step.ts_us, step.end_us
        inside = [s for s in trace.annotations if s.tid == step.tid and s.ts_us >= t0 and s.end_us <= t1]
        comm = [c for c in merged_comm(trace.comm, step.tid) if c.ts_us >= t0 and c.end_us <= t1 + 1e-3]
        chunks = chunk_spans(inside, num_stages)
        if not chunks:
            chunks = _whole_step_chunks(trace, step)
        starts = [c.span.ts_us for c in chunks]
        built_chunks, waits = [], []
        for c in chunks:
            in_comm = sum(_overlap(c.span.ts_us, c.span.end_us, w.ts_us, w.end_us) for w in comm)
            built_chunks.append(Chunk(
                kind=c.kind, microbatch=c.microbatch, virtual_stage=c.virtual_stage, tokens=tokens,
                start_s=(c.span.ts_us - t0) / 1e6, duration_s=max(0.0, c.span.dur_us - in_comm) / 1e6))
        for w in comm:
            i = bisect_right(starts, w.ts_us) - 1
            around = chunks[i] if i >= 0 and w.ts_us < chunks[i].span.end_us else None
            op, peer, mb = w.op, None, None
            if around is not None:
                mb = around.microbatch
            if op in (CommOp.PP_SEND, CommOp.PP_RECV):
                peer = _peer_from_args(w.args, op)
                if peer is None and around is not None:
                    downstream = (around.kind is ChunkKind.FORWARD) == (op is CommOp.PP_SEND)
                    peer = near.next if downstream else near.previous
            elif op is CommOp.DP_ALLREDUCE and _is_tp_allreduce(w.args, around, tp_size, dp_size):
                op = CommOp.TP_ALLREDUCE
            waits.append(CommWait(
                op=op, peer=peer, microbatch=mb, start_s=(w.ts_us - t0) / 1e6,
                duration_s=(w.end_us - w.ts_us) / 1e6, includes_wait=True,
                group="pp" if op in (CommOp.PP_SEND, CommOp.PP_RECV) else None))
        end_unix = (trace.base_ns / 1e9 + t1 / 1e6) if trace.base_ns is not None else None
        out.append((end_unix, RankIteration(
            epoch=epoch, iteration=number, rank=trace.rank, node=me.node,
            coords=Coords(tp=me.tp, pp=me.pp, dp=me.dp, cp=me.cp), wall_s=step.dur_us / 1e6,
            chunks=built_chunks, comm=waits)))
    return out


def _is_tp_allreduce(args: dict, around: ChunkSpan | None, tp_size: int, dp_size: int) -> bool:
    """An all-reduce is tensor-parallel when the trace's group size says so (NCCL traces record it);
    without one, when it runs inside a chunk of a stage with TP > 1 (DDP's gradient all-reduces
    also run inside backward chunks, so with TP 1 an all-reduce is data-parallel)."""
    size = args.get("Group size")
    if isinstance(size, int) and tp_size != dp_size:
        return size == tp_size
    return around is not None and tp_size > 1


def _whole_step_chunks(trace: RankTrace, step: Span) -> list[ChunkSpan]:
    """No micro-batch annotations: forward until the first autograd backward op, then backward
    until the last one (a step without autograd ops is all forward)."""
    bw = [s for s in trace.backward_ops if s.tid == step.tid and step.ts_us <= s.ts_us and s.end_us <= step.end_us]
    if not bw:
        return [ChunkSpan(ChunkKind.FORWARD, 0, 0, step)]
    b0, b1 = min(s.ts_us for s in bw), max(s.end_us for s in bw)
    return [ChunkSpan(ChunkKind.FORWARD, 0, 0, Span("forward", step.tid, step.ts_us, b0 - step.ts_us, {})),
            ChunkSpan(ChunkKind.BACKWARD, 0, 0, Span("backward", step.tid, b0, b1 - b0, {}))]


# ---- the whole import --------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportResult:
    events: list[Envelope]
    ranks: list[int]
    steps: list[int]
    notes: list[str]


def trace_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The trace files named, folders expanded to their ``*.json`` and ``*.json.gz`` files."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
            if not found:
                raise ImportProblem(f"{p}: the folder holds no .json or .json.gz trace")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise ImportProblem(f"{p}: no such file or folder")
    return files


def import_traces(files: Sequence[str | Path], layout: Layout, *, job: str,
                  max_bytes: int = MAX_TRACE_BYTES) -> ImportResult:
    """Every event the job would have published, in the order a consumer should see them: the plan
    and the tracing declaration, then iteration by iteration, rank by rank. A gzip trace may
    decompress to at most ``max_bytes``."""
    # A rank may have several files (tensorboard_trace_handler writes one per profiling cycle); each
    # is read on its own, and a step is taken once.
    traces: dict[int, list[RankTrace]] = defaultdict(list)
    per_rank: dict[int, list[tuple[float | None, RankIteration]]] = defaultdict(list)
    seen: dict[tuple[int, int], Path] = {}
    for f in files:
        t = read_kineto(f, max_bytes=max_bytes)
        traces[t.rank].append(t)
        for end, it in rank_iterations(t, layout):
            if (t.rank, it.iteration) in seen:
                raise ImportProblem(f"{f}: rank {t.rank} step {it.iteration} again (also in "
                                    f"{seen[t.rank, it.iteration]}); give each rank's steps once")
            seen[t.rank, it.iteration] = t.path
            per_rank[t.rank].append((end, it))
    plan = layout.plan()
    steps = sorted({it.iteration for items in per_rank.values() for _, it in items})
    notes = []
    every, offset = _step_pattern(steps)
    if every == 1 and steps != list(range(steps[0], steps[-1] + 1)):
        notes.append(f"profiled steps {steps} follow no i % n pattern; declared as every step")
    missing = sorted(set(plan.devices) - set(traces))
    if missing:
        notes.append(f"no trace for ranks {missing}: declared not traced")
    times = [t for items in per_rank.values() for t, _ in items if t is not None]
    t_first = min(times) if times else 0.0
    declared = TracingDeclared(
        epoch=plan.epoch, dialect="profiler", traced_ranks=sorted(traces) if missing else None,
        step_every=every, step_offset=offset, seq_lens=False, tokens=layout.tokens_per_microbatch is not None,
        fused_p2p=True)  # blocking p2p timers hold the wait for the peer
    # signed as the executor's, as a live trainer's plan.current is: readers plan and judge on it
    control = Signer(EventFactory(job, "import"), "executor")
    events: list[Envelope] = [
        control.make(PlanCurrent(plan=plan, gpus_per_node=layout.gpus_per_node,
                                 tokens_per_microbatch=layout.tokens_per_microbatch or 0,
                                 run=f"import-{uuid.uuid5(_NS, f'{job}/import/run').hex[:16]}"),  # same on re-import
                     time_s=t_first, event_id=uuid.uuid5(_NS, f"{job}/import/0").hex),
        control.make(declared, time_s=t_first, event_id=uuid.uuid5(_NS, f"{job}/import/1").hex),
    ]
    factories = {r: EventFactory(job, f"rank-{r}") for r in traces}
    by_step: dict[int, list[tuple[int, float | None, RankIteration]]] = defaultdict(list)
    for r, items in per_rank.items():
        for time_s, it in items:
            by_step[it.iteration].append((r, time_s, it))
    for step in steps:
        for r, time_s, it in sorted(by_step[step], key=lambda x: x[0]):
            events.append(factories[r].make(it, time_s=time_s if time_s is not None else float(step),
                                            event_id=uuid.uuid5(_NS, f"{job}/rank-{r}/{step}").hex))
    return ImportResult(events=events, ranks=sorted(traces), steps=steps, notes=notes)


def _step_pattern(steps: Sequence[int]) -> tuple[int, int]:
    """(step_every, step_offset) for the profiled steps: the gcd of their gaps."""
    every = 0
    for a, b in zip(steps, steps[1:]):
        every = math.gcd(every, b - a)
    every = max(1, every)
    return every, steps[0] % every if steps else 0
