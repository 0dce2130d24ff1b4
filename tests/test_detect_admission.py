"""The admission rule (analytics/detection/admission.py) reads a report's bounds from the record's
bytes when it came from the wire, and from its values in memory: the same verdicts, the same
reasons, the same shape admitted, whichever form a report takes."""

from __future__ import annotations

from analytics.detection.admission import MAX_DEVICES, MAX_MICROBATCH, MAX_VIRTUAL_STAGES, EpochShape, undetectable
from collector.codec import decode, encode
from collector.events import Chunk, ChunkKind, CommOp, CommWait, Coords, Envelope, EventFactory, RankIteration
from collector.rank_columns import ArrayColumn
from tests.fixtures.payloads import payload_as

JOB = "job-admit"


def _report(rank: int, *, dp: int = 0, microbatches: tuple[int, ...] = (0, 1), virtual_stage: int = 0,
            peers: tuple[int | None, ...] = (None, 3), iteration: int = 0) -> Envelope:
    chunks = [Chunk(kind=ChunkKind.FORWARD, microbatch=mb, virtual_stage=virtual_stage, tokens=8, start_s=0.01 * i,
                    duration_s=0.01) for i, mb in enumerate(microbatches)]
    comm = [CommWait(op=CommOp.PP_RECV if p is not None else CommOp.DP_ALLREDUCE, peer=p, start_s=0.0,
                     duration_s=0.001) for p in peers]
    return EventFactory(JOB, f"rank-{rank}").make(RankIteration(
        epoch=0, iteration=iteration, rank=rank, coords=Coords(tp=0, pp=rank % 4, dp=dp), wall_s=1.0, chunks=chunks,
        comm=comm))


def _verdicts(events: list[Envelope]) -> tuple[list[str | None], dict[tuple[str, int], EpochShape]]:
    shapes: dict[tuple[str, int], EpochShape] = {}
    return [undetectable(e, shapes) for e in events], shapes


def test_a_report_read_from_the_wire_is_admitted_or_kept_out_as_in_memory_with_the_same_reason_and_shape() -> None:
    events = [
        _report(0),
        _report(1, peers=()),  # no communications at all
        _report(2, microbatches=()),  # no chunks
        _report(3, peers=(None, None)),  # no peer known
        _report(4, peers=(MAX_DEVICES - 1,), virtual_stage=MAX_VIRTUAL_STAGES - 1),
        _report(5, peers=(7, MAX_DEVICES)),
        _report(6, virtual_stage=MAX_VIRTUAL_STAGES),
        _report(7, microbatches=(3, MAX_MICROBATCH)),
        _report(8, dp=1, microbatches=(5, 2, 9)),
        _report(9, dp=1, microbatches=(2**21,)),  # replica 1's span: 2^21 micro-batches × 256 virtual stages …
    ]
    wire = [decode(encode(e)) for e in events]
    assert isinstance(payload_as(wire[0], RankIteration).waits().peer, ArrayColumn)
    in_memory, memory_shapes = _verdicts(events)
    from_wire, wire_shapes = _verdicts(wire)
    assert from_wire == in_memory
    assert in_memory[:5] == [None] * 5 and in_memory[8] is None
    assert in_memory[5] == f"a comm peer ≥ {MAX_DEVICES:,}"
    assert in_memory[6] == f"virtual stage {MAX_VIRTUAL_STAGES} ≥ {MAX_VIRTUAL_STAGES}"
    assert in_memory[7] == f"micro-batch {MAX_MICROBATCH} ≥ {MAX_MICROBATCH:,}"
    assert in_memory[9] is not None and "exceed the detector's" in in_memory[9]  # … too many cells
    assert wire_shapes == memory_shapes
    shape = memory_shapes[(JOB, 0)]
    assert (shape.dp, shape.pp, shape.vs, shape.span) == (1, 3, MAX_VIRTUAL_STAGES - 1, 8)
    assert shape.microbatches == {0: (0, 1), 1: (2, 9)}
