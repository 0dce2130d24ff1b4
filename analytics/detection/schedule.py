"""The pipeline-schedule model: the DAG of F / B / W chunks and its critical path.

One model shared by three users: the detector compares observed iterations with it, the planner
scores candidate plans with it, and the simulator runs it with faults and noise. It answers: given
per-chunk durations, when does every chunk start and end, and how long is the iteration?

The DAG (per pipeline, i.e. per DP replica), with ``g = chunk·S + s`` the global virtual stage:

* ``F(s, c, i)`` after ``F(g-1, i)`` plus the activation transfer, and after the op before it in
  stage ``s``'s schedule order;
* ``B(s, c, i)`` after ``B(g+1, i)`` plus the gradient transfer (the last virtual stage: after its
  own ``F``), and after the stage's previous op;
* ``W(s, c, i)`` (zero-bubble only) after the stage's previous op, which is at or after ``B``.

The per-stage op ORDER is what a schedule is; it is built once per (schedule, S, M, V) and cached
(:func:`op_table`). Timing is then a longest-path sweep over *levels* of the DAG (ops whose
predecessors are all in earlier levels), vectorised over a leading batch axis N of independent
pipelines — DP replicas, iterations, or candidate plans — so a 1,024-GPU job costs a few dozen numpy
operations, not a Python loop per chunk per rank.

Conventions: ``S`` stages, ``M`` micro-batches, ``V`` virtual stages (model chunks per stage, the
interleaved schedule), ``N`` batch rows. Durations in seconds. What can go wrong: the interleaved
schedule needs ``M % S == 0`` (as Megatron's does) and raises otherwise; replicas of different shape
cannot share a batch row, so :func:`predict_iteration` groups them by (S, M).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from collector.plan import Plan, StagePlan

F, B, W = 0, 1, 2  # op kinds; the contract's ChunkKind values are "F", "B", "W"
KIND_NAMES = ("F", "B", "W")


@dataclass(frozen=True)
class OpTable:
    """Every op of one pipeline's iteration, in a topological order, with its two predecessors.

    All arrays are shaped ``(n_ops,)``. ``prev_on_stage`` / ``dep`` index into the same arrays, or
    are ``n_ops`` (a sentinel column that always holds time 0) when there is none.
    """

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    kind: np.ndarray  # (n_ops,) int8: F=0, B=1, W=2
    stage: np.ndarray  # (n_ops,) int
    chunk: np.ndarray  # (n_ops,) virtual chunk c in [0, V)
    microbatch: np.ndarray  # (n_ops,)
    position: np.ndarray  # (n_ops,) index of the op in its stage's order
    prev_on_stage: np.ndarray  # (n_ops,) the stage's previous op, or n_ops
    dep: np.ndarray  # (n_ops,) the cross-stage (or F->B) dependency, or n_ops
    link: np.ndarray  # (n_ops,) link index s' of the transfer on the dep edge (s' -> (s'+1) % S), or -1
    duration_index: np.ndarray  # (n_ops,) flat index into durations stacked as (3, S, V, M)
    # The timing sweep's order: ops level by level (longest-path levels of the DAG, each in op
    # order), so that a level is one contiguous block of rows, and each op's two predecessors as
    # positions in that order (n_ops: none).
    sweep: np.ndarray  # (n_ops,) op indices
    sweep_levels: tuple[int, ...]  # where each level starts in ``sweep``, and n_ops
    sweep_prev: np.ndarray  # (n_ops,)
    sweep_dep: np.ndarray  # (n_ops,)

    @property
    def n_ops(self) -> int:
        return int(self.kind.shape[0])

    def stage_order(self, stage: int) -> list[tuple[str, int, int]]:
        """(kind, chunk, microbatch) in the order stage ``stage`` runs them (for docs and tests)."""
        idx = np.flatnonzero(self.stage == stage)
        idx = idx[np.argsort(self.position[idx])]
        return [(KIND_NAMES[self.kind[i]], int(self.chunk[i]), int(self.microbatch[i])) for i in idx]


# ---- per-stage orders ----------------------------------------------------------------------------

Op = tuple[int, int, int]  # (kind, chunk, microbatch)


def _order_1f1b(S: int, M: int) -> list[list[Op]]:
    """Stage s: min(S-s-1, M) warm-up forwards, then F/B pairs, then the remaining backwards."""
    orders = []
    for s in range(S):
        warm = min(S - s - 1, M)
        ops: list[Op] = [(F, 0, i) for i in range(warm)]
        for j in range(M - warm):
            ops += [(F, 0, warm + j), (B, 0, j)]
        ops += [(B, 0, i) for i in range(M - warm, M)]
        orders.append(ops)
    return orders


def _order_interleaved(S: int, M: int, V: int) -> list[list[Op]]:
    """Megatron's interleaved 1F1B: micro-batches in groups of S visit chunks 0..V-1 (backward
    V-1..0); stage s warms up with (S-s-1)·2 + (V-1)·S forwards."""
    if M % S:
        raise ValueError(
            f"the interleaved schedule needs micro-batches ({M}) to be a multiple of the stages ({S}); "
            "change microbatches or use 1f1b"
        )
    total = M * V

    def fwd(k: int) -> Op:
        group, r = divmod(k, S * V)
        return (F, r // S, group * S + r % S)

    def bwd(k: int) -> Op:
        group, r = divmod(k, S * V)
        return (B, V - 1 - r // S, group * S + r % S)

    orders = []
    for s in range(S):
        warm = min((S - s - 1) * 2 + (V - 1) * S, total)
        ops = [fwd(k) for k in range(warm)]
        for j in range(total - warm):
            ops += [fwd(warm + j), bwd(j)]
        ops += [bwd(k) for k in range(total - warm, total)]
        orders.append(ops)
    return orders


def _order_zero_bubble(S: int, M: int) -> list[list[Op]]:
    """Zero-bubble order found by list-scheduling once with unit costs: 1F1B's limit on
    activations in flight (at most S-s micro-batches between F and B on stage s), B before F, and
    W passes deferred to fill what would otherwise be bubbles (the cool-down tail above all).
    With m >= p it reaches ZB-H1's bubble, (p-1)·(t_f + t_b - t_w). The W backlog is not capped
    (ZB-H1 caps it to keep 1F1B's peak memory): a model of time, not of memory."""
    t = [0.0] * S
    f_end = np.full((S, M), np.inf)
    b_end = np.full((S, M), np.inf)
    next_f, next_b, next_w = [0] * S, [0] * S, [0] * S
    orders: list[list[Op]] = [[] for _ in range(S)]
    remaining = {s for s in range(S)}
    def candidates(s: int) -> list[tuple[float, int, Op]]:  # (ready time, priority, op)
        cands: list[tuple[float, int, Op]] = []
        if next_b[s] < next_f[s]:
            i = next_b[s]
            cands.append((b_end[s + 1, i] if s < S - 1 else f_end[s, i], 0, (B, 0, i)))
        if next_f[s] < M and next_f[s] - next_b[s] < S - s:
            i = next_f[s]
            cands.append((f_end[s - 1, i] if s > 0 else 0.0, 1, (F, 0, i)))
        if next_w[s] < next_b[s]:
            cands.append((t[s], 2, (W, 0, next_w[s])))
        return cands

    while remaining:
        # Always advance the stage that is furthest behind, so every op another stage could still
        # deliver to it ends after its clock (unit costs keep all events on an integer grid).
        s = min(remaining, key=lambda x: (t[x], x))
        cands = candidates(s)
        ready_now = [c for c in cands if c[0] <= t[s]]
        if not ready_now:
            upcoming = [c[0] for c in cands if np.isfinite(c[0])]
            upcoming += [t[u] + 1.0 for u in remaining if u != s]
            if not upcoming:
                raise RuntimeError(f"zero-bubble order for S={S}, M={M} deadlocked at stage {s}")
            t[s] = max(t[s] + 1.0, min(upcoming)) if not [c for c in cands if np.isfinite(c[0])] else min(upcoming)
            continue
        _, _, op = min(ready_now, key=lambda c: c[1])
        kind, _, i = op
        t[s] += 1.0
        if kind == F:
            f_end[s, i] = t[s]
            next_f[s] += 1
        elif kind == B:
            b_end[s, i] = t[s]
            next_b[s] += 1
        else:
            next_w[s] += 1
        orders[s].append(op)
        if next_w[s] == M:
            remaining.discard(s)
    return orders


@lru_cache(maxsize=256)
def op_table(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> OpTable:
    """The op DAG of one pipeline, cached per (schedule, S, M, V)."""
    S, M, V = stages, microbatches, virtual_stages
    if S < 1 or M < 1 or V < 1:
        raise ValueError(f"stages, microbatches and virtual_stages must be >= 1, got {S}, {M}, {V}")
    if schedule == "1f1b":
        V = 1
        orders = _order_1f1b(S, M)
    elif schedule == "interleaved":
        orders = _order_interleaved(S, M, V) if V > 1 else _order_1f1b(S, M)
    elif schedule == "zero_bubble":
        V = 1
        orders = _order_zero_bubble(S, M)
    else:
        raise ValueError(f"unknown schedule {schedule!r}; choose 1f1b, interleaved or zero_bubble")

    ops = [(s, pos, *op) for s in range(S) for pos, op in enumerate(orders[s])]
    n = len(ops)
    index = {(k, s, c, i): j for j, (s, _, k, c, i) in enumerate(ops)}
    kind = np.array([o[2] for o in ops], dtype=np.int8)
    stage = np.array([o[0] for o in ops])
    chunk = np.array([o[3] for o in ops])
    mb = np.array([o[4] for o in ops])
    position = np.array([o[1] for o in ops])
    prev = np.full(n, n)
    dep = np.full(n, n)
    link = np.full(n, -1)
    for j, (s, pos, k, c, i) in enumerate(ops):
        if pos > 0:
            prev[j] = j - 1  # ops are listed stage by stage, in order
        g = c * S + s
        if k == F and g > 0:
            ps, pc = (s - 1, c) if s > 0 else (S - 1, c - 1)
            dep[j], link[j] = index[(F, ps, pc, i)], ps
        elif k == B and g < S * V - 1:
            ns, nc = (s + 1, c) if s < S - 1 else (0, c + 1)
            dep[j], link[j] = index[(B, ns, nc, i)], s
        elif k == B:
            dep[j] = index[(F, s, c, i)]
        elif k == W:
            dep[j] = index[(B, s, c, i)]
    level = np.zeros(n + 1, dtype=np.int64)
    # Longest-path levels by relaxation in a topological order (Kahn's algorithm).
    indeg = (prev < n).astype(int) + (dep < n).astype(int)
    succ: list[list[int]] = [[] for _ in range(n)]
    for j in range(n):
        for p in (prev[j], dep[j]):
            if p < n:
                succ[p].append(j)
    frontier = [j for j in range(n) if indeg[j] == 0]
    seen = 0
    while frontier:
        nxt = []
        for j in frontier:
            seen += 1
            for q in succ[j]:
                level[q] = max(level[q], level[j] + 1)
                indeg[q] -= 1
                if indeg[q] == 0:
                    nxt.append(q)
        frontier = nxt
    if seen != n:
        raise RuntimeError(f"{schedule} order for S={S}, M={M}, V={V} has a dependency cycle")
    lv = level[:n]
    sweep = np.argsort(lv, kind="stable")
    at = np.empty(n + 1, np.int64)  # an op's position in the sweep; the sentinel stays n
    at[sweep], at[n] = np.arange(n), n
    levels = np.concatenate(([0], np.cumsum(np.bincount(lv)))).tolist()
    duration_index = ((kind.astype(np.int64) * S + stage) * V + chunk) * M + mb
    return OpTable(schedule, S, M, V, kind, stage, chunk, mb, position, prev, dep, link, duration_index,
                   sweep, tuple(levels), at[prev[sweep]], at[dep[sweep]])


# ---- timing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineTiming:
    """Start and end of every op of N pipelines (rows), and each pipeline's makespan."""

    table: OpTable
    start_s: np.ndarray  # (N, n_ops)
    end_s: np.ndarray  # (N, n_ops)
    makespan_s: np.ndarray  # (N,) when the pipeline's last op ends

    def stage_end_s(self) -> np.ndarray:
        """(N, S): when each stage finishes its last op (where its DP all-reduce could start)."""
        out = np.zeros((self.end_s.shape[0], self.table.stages))
        for s in range(self.table.stages):
            out[:, s] = self.end_s[:, self.table.stage == s].max(axis=1)
        return out


def _as_nsvm(x: np.ndarray | float, N: int, S: int, V: int, M: int, name: str) -> np.ndarray:
    """Durations to (N, S, V, M): (S, M) and (N, S, M) arrays are a stage's whole time, split
    evenly over its V model chunks; (N, S, V, M) is taken as is."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 4:
        return np.broadcast_to(a, (N, S, V, M))
    if a.ndim <= 3:
        a = np.broadcast_to(a, (N, S, M)) / V
        return np.broadcast_to(a[:, :, None, :], (N, S, V, M))
    raise ValueError(f"{name} has shape {a.shape}; expected (S, M), (N, S, M) or (N, S, V, M)")


def pipeline_timing(
    table: OpTable,
    f_s: np.ndarray | float,
    b_s: np.ndarray | float,
    w_s: np.ndarray | float | None = None,
    p2p_s: np.ndarray | float = 0.0,
    *,
    rows: int | None = None,
) -> PipelineTiming:
    """Critical-path start/end of every op for N independent pipelines of one shape.

    f_s, b_s, w_s: chunk durations broadcastable to (N, S, M) — or (N, S, V, M) per model chunk.
        Without W (1f1b, interleaved) ``b_s`` is the whole backward; with the zero-bubble schedule
        ``w_s`` is required and ``b_s`` is the input-gradient part only.
    p2p_s: transfer time of one micro-batch's activation (forward) or gradient (backward) over the
        link between stage s and stage (s+1) % S, broadcastable to (N, S, M); the wrap-around entry
        s = S-1 is used by the interleaved schedule only.
    rows: N when no argument carries the batch axis.
    """
    S, M, V = table.stages, table.microbatches, table.virtual_stages
    shapes = [np.shape(a) for a in (f_s, b_s, w_s, p2p_s) if a is not None]
    N = rows if rows is not None else max([sh[0] for sh in shapes if len(sh) >= 3] or [1])
    if table.schedule == "zero_bubble" and w_s is None:
        raise ValueError("the zero_bubble schedule needs w_s (weight-gradient chunk durations)")
    durs = np.empty((N, 3, S, V, M))
    durs[:, F] = _as_nsvm(f_s, N, S, V, M, "f_s")
    durs[:, B] = _as_nsvm(b_s, N, S, V, M, "b_s")
    durs[:, W] = 0.0 if w_s is None else _as_nsvm(w_s, N, S, V, M, "w_s")
    dur = durs.reshape(N, -1)[:, table.duration_index]  # (N, n_ops)
    p2p = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (N, S, M))
    has_link = table.link >= 0
    comm = np.zeros_like(dur)
    comm[:, has_link] = p2p[:, table.link[has_link], table.microbatch[has_link]]

    n = table.n_ops
    # Ops-major layout inside the sweep, rows in the sweep's order: each level reads and writes
    # one block of whole rows in place, and gathers only its predecessors' ends (``take``: a
    # quarter of fancy indexing's overhead). Per level and array, fancy indexing and copies were
    # most of a 16-stage replica's 0.4 ms.
    dur_t = dur.T[table.sweep]  # (n_ops, N)
    comm_t = comm.T[table.sweep]
    end_t = np.zeros((n + 1, N))  # row n is the "no predecessor" sentinel, always 0
    start_t = np.zeros((n, N))
    bounds, prev, dep = table.sweep_levels, table.sweep_prev, table.sweep_dep
    for a, z in zip(bounds[:-1], bounds[1:]):
        dep_end = end_t.take(dep[a:z], axis=0)
        dep_end += comm_t[a:z]
        st = np.maximum(end_t.take(prev[a:z], axis=0), dep_end, out=start_t[a:z])
        np.add(st, dur_t[a:z], out=end_t[a:z])
    start = np.empty((N, n))
    end = np.empty((N, n))
    start[:, table.sweep] = start_t.T
    end[:, table.sweep] = end_t[:n].T
    return PipelineTiming(table, start, end, end.max(axis=1))


@dataclass(frozen=True)
class PipelineDurations:
    """One DP replica's chunk durations (see :func:`pipeline_timing` for shapes, without N)."""

    f_s: np.ndarray  # (S, M) or (S, V, M)
    b_s: np.ndarray  # (S, M) or (S, V, M)
    w_s: np.ndarray | None = None  # (S, M) or (S, V, M); zero-bubble only
    p2p_s: np.ndarray | float = 0.0  # broadcastable to (S, M)

    @property
    def shape(self) -> tuple[int, int]:
        a = np.asarray(self.f_s)
        return int(a.shape[0]), int(a.shape[-1])


@dataclass(frozen=True)
class ScheduleTiming:
    """The predicted iteration: per-replica pipelines, then the DP gradient all-reduce."""

    iteration_s: float
    replica_end_s: np.ndarray  # (R,) each replica's pipeline makespan
    timings: list[tuple[list[int], PipelineTiming]]  # (replica indices, their timing rows)

    def timing_of(self, replica: int) -> tuple[PipelineTiming, int]:
        """The timing object holding ``replica`` and its row in it."""
        for members, timing in self.timings:
            if replica in members:
                return timing, members.index(replica)
        raise KeyError(f"replica {replica} not in this prediction")


def predict_iteration(
    schedule: str,
    replicas: Sequence[PipelineDurations],
    *,
    virtual_stages: int = 1,
    dp_allreduce_s: float = 0.0,
) -> ScheduleTiming:
    """Iteration time of a whole job: every replica's pipeline (grouped by shape and batched),
    then a gradient all-reduce that starts when the slowest replica ends (no overlap with the
    backward pass: a conservative model)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r, rep in enumerate(replicas):
        groups.setdefault(rep.shape, []).append(r)
    ends = np.zeros(len(replicas))
    timings = []
    for (S, M), members in groups.items():
        table = op_table(schedule, S, M, virtual_stages)
        stack = lambda get, members=members: np.stack([np.broadcast_to(np.asarray(get(replicas[r]), float), np.shape(replicas[r].f_s))  # noqa: E731
                                      for r in members])
        w = None if replicas[members[0]].w_s is None else stack(lambda p: p.w_s)
        p2p = np.stack([np.broadcast_to(np.asarray(replicas[r].p2p_s, float), (S, M)) for r in members])
        timing = pipeline_timing(table, stack(lambda p: p.f_s), stack(lambda p: p.b_s), w, p2p)
        ends[members] = timing.makespan_s
        timings.append((members, timing))
    return ScheduleTiming(float(ends.max() + dp_allreduce_s), ends, timings)


# ---- closed forms (uniform chunks, no communication) --------------------------------------------


def closed_form_1f1b_s(stages: int, microbatches: int, f_s: float, b_s: float) -> float:
    """1F1B: (p − 1 + m)·(t_f + t_b)."""
    return (stages - 1 + microbatches) * (f_s + b_s)


def closed_form_interleaved_s(stages: int, microbatches: int, virtual_stages: int, f_s: float, b_s: float) -> float:
    """Interleaved 1F1B (Megatron), f_s/b_s a stage's whole time: m·(t_f+t_b) + (p − 1)·(t_f+t_b)/v."""
    return (microbatches + (stages - 1) / virtual_stages) * (f_s + b_s)


def closed_form_zero_bubble_s(stages: int, microbatches: int, f_s: float, b_s: float, w_s: float) -> float:
    """ZB-H1: m·(t_f+t_b+t_w) + (p − 1)·(t_f + t_b − t_w); what :func:`op_table`'s zero-bubble
    order reaches when m >= p and t_w <= t_f = t_b (elsewhere the DAG, not this formula, is the truth)."""
    return microbatches * (f_s + b_s + w_s) + (stages - 1) * (f_s + b_s - w_s)


# ---- from a Plan ---------------------------------------------------------------------------------

# cost(replica, stage, stage_plan, kind "F"|"B"|"W", microbatches) -> (microbatches,) seconds or a float
ChunkCost = Callable[[int, int, StagePlan, str, int], "np.ndarray | float"]
# p2p(replica, stage, microbatches) -> seconds over the link stage -> stage+1 (wrap-around for the last)
LinkCost = Callable[[int, int, int], "np.ndarray | float"]


def durations_from_plan(plan: Plan, chunk_cost: ChunkCost, p2p_cost: LinkCost | float = 0.0) -> list[PipelineDurations]:
    """Per-replica duration arrays for ``plan`` from a cost function (the detector's fitted cost
    model, the planner's estimate, or the simulator's truth). W arrays only for zero_bubble."""
    out = []
    for pipe in plan.pipelines:
        S, M = len(pipe.stages), pipe.microbatches
        arrays: dict[str, np.ndarray] = {}
        kinds = ("F", "B", "W") if plan.schedule == "zero_bubble" else ("F", "B")
        for k in kinds:
            a = np.empty((S, M))
            for s, st in enumerate(pipe.stages):
                a[s] = chunk_cost(pipe.replica, s, st, k, M)
            arrays[k] = a
        if callable(p2p_cost):
            p2p = np.empty((S, M))
            for s in range(S):
                p2p[s] = p2p_cost(pipe.replica, s, M)
        else:
            p2p = np.full((S, M), float(p2p_cost))
        out.append(PipelineDurations(arrays["F"], arrays["B"], arrays.get("W"), p2p))
    return out


def predict_plan(plan: Plan, chunk_cost: ChunkCost, p2p_cost: LinkCost | float = 0.0,
                 dp_allreduce_s: float = 0.0) -> ScheduleTiming:
    """Shortcut: :func:`durations_from_plan` then :func:`predict_iteration` under the plan's schedule."""
    return predict_iteration(plan.schedule, durations_from_plan(plan, chunk_cost, p2p_cost),
                             virtual_stages=plan.virtual_stages, dp_allreduce_s=dp_allreduce_s)
