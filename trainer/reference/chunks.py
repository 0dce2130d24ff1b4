"""Which layers each pipeline stage runs, split into model chunks (virtual stages).

A plan gives every stage a contiguous layer range. Under ``1f1b`` and ``zero_bubble`` a stage runs
exactly that range as one chunk. Under ``interleaved`` with ``virtual_stages = V > 1`` the plan's
range only says *how many* layers the stage holds: the model is cut into ``S·V`` consecutive
slices in Megatron's round-robin order — slice ``g = c·S + s`` is chunk ``c`` of stage ``s`` — so
data visits stage 0, 1, …, S-1 and wraps around to stage 0 for the next chunk, and the op orders of
analytics/detection/schedule.py (built on that same ``g``) are the orders the trainer runs. A stage's count
is split into V chunk sizes as evenly as possible (earlier chunks take the remainder); the slices
then follow each other in ``g`` order. Example, 8 layers, S=2, V=2, 4 layers per stage: stage 0
runs layers 0-1 (chunk 0) and 4-5 (chunk 1), stage 1 runs 2-3 and 6-7. Which layers a device
*owns* (its parameters, optimizer state, what it sends or receives in a reshape, what it writes to
a checkpoint) is the union of its chunks, so state transfer and checkpoints follow automatically.

Torch-free on purpose: the launcher's command intake judges plans with it.
"""

from __future__ import annotations

from collector.plan import Plan, RankRole

LayerRange = tuple[int, int]  # [first, end)


def units_of_stage(n_layer: int, first_layer: int, end_layer: int) -> list[str]:
    """The units a chunk holding layers [first, end) owns, in model order."""
    units = ["embed"] if first_layer == 0 else []
    units += [f"layer.{i}" for i in range(first_layer, end_layer)]
    return units + (["head"] if end_layer == n_layer else [])


def units_of_chunks(n_layer: int, chunks: tuple[LayerRange, ...]) -> list[str]:
    """The units a stage running ``chunks`` owns, in model order."""
    units = [u for a, b in chunks for u in units_of_stage(n_layer, a, b)]
    order = {u: i for i, u in enumerate(units_of_stage(n_layer, 0, n_layer))}
    return sorted(set(units), key=order.__getitem__)


def all_units(n_layer: int) -> list[str]:
    return units_of_stage(n_layer, 0, n_layer)


def virtual_stages(plan: Plan) -> int:
    """Model chunks per stage that the trainer runs (1 unless the schedule is interleaved)."""
    return plan.virtual_stages if plan.schedule == "interleaved" else 1


def _split(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (1 if c < extra else 0) for c in range(parts)]


def stage_chunks(plan: Plan, replica_index: int, stage_index: int) -> tuple[LayerRange, ...]:
    """Layer ranges of the chunks stage ``stage_index`` of ``plan.pipelines[replica_index]`` runs,
    indexed by chunk (virtual stage) c. Raises ValueError for a plan :func:`schedule_problem`
    rejects (a stage with fewer layers than chunks)."""
    pipe = plan.pipelines[replica_index]
    V = virtual_stages(plan)
    if V == 1:
        st = pipe.stages[stage_index]
        return ((st.first_layer, st.end_layer),)
    S = len(pipe.stages)
    sizes = [_split(st.num_layers, V) for st in pipe.stages]
    if any(n == 0 for row in sizes for n in row):
        raise ValueError(f"replica {pipe.replica}: a stage has fewer layers than the {V} virtual stages; "
                         "give every stage at least virtual_stages layers or lower virtual_stages")
    at, out = 0, {}
    for g in range(S * V):
        c, s = divmod(g, S)
        out[(s, c)] = (at, at + sizes[s][c])
        at += sizes[s][c]
    return tuple(out[(stage_index, c)] for c in range(V))


def role_chunks(plan: Plan, role: RankRole) -> tuple[LayerRange, ...]:
    index = next(i for i, p in enumerate(plan.pipelines) if p.replica == role.replica)
    return stage_chunks(plan, index, role.stage)


def schedule_problem(plan: Plan) -> str | None:
    """Why the trainer cannot run ``plan``'s schedule (None: it can). The interleaved schedule
    needs each replica's micro-batches to be a multiple of its stage count (as Megatron's does)
    and every stage to hold at least one layer per chunk."""
    V = virtual_stages(plan)
    if V == 1:
        return None
    for pipe in plan.pipelines:
        S = len(pipe.stages)
        if pipe.microbatches % S:
            return (f"interleaved schedule: replica {pipe.replica} runs {pipe.microbatches} micro-batches, not a "
                    f"multiple of its {S} stages; change the micro-batch split or use 1f1b")
        thin = [s for s, st in enumerate(pipe.stages) if st.num_layers < V]
        if thin:
            return (f"interleaved schedule: replica {pipe.replica} stages {thin} hold fewer layers than the {V} "
                    "virtual stages; give them more layers or lower virtual_stages")
    return None
