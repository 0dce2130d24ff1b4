"""Which events the detector's arrays can hold: the one admission rule of the single process and the shards.

The detector and a shard's replica summaries keep arrays indexed by device id and by pipeline
coordinates, so an event whose numbers no real job has (a device id or coordinate of a million or
more, more pipeline stages than a million devices hold) or that would make one iteration's arrays
exceed ``MAX_CELLS`` (replicas × stages × virtual stages × micro-batch span) is kept from them:
:func:`undetectable` says why. Any writer on the telemetry topic can send such a record, and a
schema-valid one passes the contract's ranges, so without this rule one report asks for 80 GiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from collector.events import Envelope, Heartbeat, PlanCurrent, ProbeResult, RankIteration, ReconfigureCommand
from collector.rank_columns import ArrayColumn

MAX_DEVICES = 1 << 20  # device ids, coordinates and pipeline stages (dp x pp) the detector's arrays may hold
MAX_VIRTUAL_STAGES = 1 << 8
MAX_MICROBATCH = 1 << 24
# The detector's per-iteration arrays hold replicas × stages × virtual stages × a replica's micro-batch
# span × 3 chunk kinds cells (analytics/detection/prediction.py): 2^24 is 128 MiB of doubles, some 25 times a
# 100,000-GPU job's (781 replicas × 16 stages × 16 micro-batches × 3).
MAX_CELLS = 1 << 24


@dataclass
class EpochShape:
    """What a job's reports of one epoch have admitted so far: the largest coordinates and, per
    replica, the micro-batch numbers it ran (the detector allocates by the widest span)."""

    dp: int = 0
    pp: int = 0
    vs: int = 0
    span: int = 1
    microbatches: dict[int, tuple[int, int]] = field(default_factory=dict)  # replica -> (lowest, highest)


def _extent(column: Sequence[int | None]) -> tuple[int, int] | None:
    """(lowest, highest) of one of a report's integer columns, None when it is empty. An unknown
    value (None; -1 on the wire) reads as -1, under every bound: only peers can be unknown, and
    only their highest is read. A column read from the wire answers from its record's bytes,
    with no Python value per row built for it (collector/rank_columns.py): on a shard's path
    nothing else wants them."""
    if type(column) is ArrayColumn:
        return column.extent()
    known = sorted(-1 if v is None else v for v in column)
    return (known[0], known[-1]) if known else None


def undetectable(event: Envelope, stages: dict[tuple[str, int], EpochShape]) -> str | None:
    """Why the detector must not fold ``event`` (None: it may). ``stages`` holds the shape each
    (job, epoch) has admitted so far, and is updated for an admitted report."""
    p = event.payload
    if isinstance(p, RankIteration):
        c = p.coords
        for name, value in (("rank", p.rank), ("node", p.node or 0), ("coords.tp", c.tp), ("coords.pp", c.pp),
                            ("coords.dp", c.dp), ("coords.cp", c.cp)):
            if value >= MAX_DEVICES:
                return f"{name} {value} ≥ {MAX_DEVICES:,}"
        peers = _extent(p.waits().peer)
        if peers is not None and peers[1] >= MAX_DEVICES:
            return f"a comm peer ≥ {MAX_DEVICES:,}"
        t = p.chunk_table
        stages_of, microbatches = _extent(t.virtual_stage), _extent(t.microbatch)
        if stages_of is not None and stages_of[1] >= MAX_VIRTUAL_STAGES:
            return f"virtual stage {stages_of[1]} ≥ {MAX_VIRTUAL_STAGES}"
        if microbatches is not None and microbatches[1] >= MAX_MICROBATCH:
            return f"micro-batch {microbatches[1]} ≥ {MAX_MICROBATCH:,}"
        shape = stages.get((event.job, p.epoch)) or EpochShape()
        dp, pp = max(shape.dp, c.dp), max(shape.pp, c.pp)
        if (dp + 1) * (pp + 1) > MAX_DEVICES:
            return f"{dp + 1} replicas × {pp + 1} stages in epoch {p.epoch} exceed {MAX_DEVICES:,} devices"
        vs = shape.vs if stages_of is None else max(shape.vs, stages_of[1])
        lo_hi, span = shape.microbatches.get(c.dp), shape.span
        if microbatches is not None:
            lo, hi = microbatches
            lo_hi = (lo, hi) if lo_hi is None else (min(lo, lo_hi[0]), max(hi, lo_hi[1]))
            span = max(span, lo_hi[1] - lo_hi[0] + 1)
        cells = (dp + 1) * (pp + 1) * (vs + 1) * span * 3
        if cells > MAX_CELLS:
            return (f"{dp + 1} replicas × {pp + 1} stages × {vs + 1} virtual stages × {span:,} micro-batches in epoch "
                    f"{p.epoch} exceed the detector's {MAX_CELLS:,} cells")
        shape.dp, shape.pp, shape.vs, shape.span = dp, pp, vs, span
        if lo_hi is not None:
            shape.microbatches[c.dp] = lo_hi
        stages[(event.job, p.epoch)] = shape
    elif isinstance(p, (Heartbeat, ProbeResult)):
        if p.rank >= MAX_DEVICES:  # a rank whose reports the detector never sees must not be waited for
            return f"rank {p.rank} ≥ {MAX_DEVICES:,}"
    elif isinstance(p, (PlanCurrent, ReconfigureCommand)):
        top = max(p.plan.roles)
        if top >= MAX_DEVICES:
            return f"plan device {top} ≥ {MAX_DEVICES:,}"
    return None
