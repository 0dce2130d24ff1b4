"""The detector across live reshapes of the real torch trainer (TP2·PP2·DP2, 8 CPU ranks, device pacing).

Recorded with the demo's torch workload (``python -m resihp.demo.torch_workload --tp 2 --pp 2 --dp 2
--microbatches 4 --iterations 30``, embedded bus) with ``slow_compute`` ×3 on rank 5 from iteration
6 and two ``command.reconfigure`` published mid-run: epoch 1 at iteration 12 drops rank 5 (replica 1's
first stage runs on rank 4 alone with layers 0-1, 3 micro-batches; replica 0 keeps its layers and
gets 5), epoch 2 at iteration 20 goes back to the original layout (rank 5, still slow, returns).

What the demo saw, and this trace reproduced before the fix: rank 5's TP peer (rank 4) waits for it
inside its chunks, so its *own* time read ≈ 2 ms against ≈ 30 ms healthy; those rows taught the
cost model's (layers 0-2, TP 2) class — shared with replica 0's first stage — a line 15× too low.
Replica 0's untouched TP group [0, 1] was then flagged ×15, its incident kept the class from
learning, the stale line survived both reshapes (classes keyed by layer range carry over) and rank 5
came back at ×64. The fit now leaves suspects' whole TP groups out and takes a unit's slowest
member, the job's centre and σ are taken over TP groups' slowest members, and a class left without
a fit is predicted from a sibling scaled by layer count (analytics/detection/scoring.py: ``fit_ranks``,
``unit_own_time``, ``tp_group_max``, ``_layer_scaled_prior``).

The second trace is the first 37 iterations of the demo itself (``resihp demo --workload torch
--short --headless``): its planner kept rank 5 and moved a layer off its stage (replica 1: layers
0-1 on ranks 4-5, 3 micro-batches; replica 0: 5). The old detector flagged [0, 1] at ×9 and rank 5
at ×51-57 there; a first version of the fix, without the prior and the group centre, resolved
rank 5 (no prediction for its new layer range: judged healthy) and then cascaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.events import IncidentOpened, IncidentResolved, PlanCurrent
from analytics.service.offline import detect_events
from collector.trace import read_trace

HERE = Path(__file__).resolve().parent
TRACE = HERE / "detect_torch_reshape_tp2.parquet"


@pytest.fixture(scope="module")
def outcome() -> tuple[list, list]:
    events = read_trace(TRACE)
    return events, list(detect_events(events))


def test_the_trace_holds_the_reshapes_and_the_fault(outcome: tuple[list, list]) -> None:
    events, _ = outcome
    truth = [e.payload for e in events if e.kind == "truth.fault"]
    assert [(f.location.rank, f.start_iteration, f.location.factor) for f in truth] == [(5, 6, 3.0)]
    plans = [e.payload.plan for e in events if e.kind == "plan.current"]
    assert [p.epoch for p in plans] == [0, 1, 2]
    assert 5 not in plans[1].devices and [p.microbatches for p in plans[1].pipelines] == [5, 3]
    assert 5 in plans[2].devices
    first_iteration: dict[int, int] = {}
    for e in events:
        if e.kind == "telemetry.iteration":
            first_iteration.setdefault(e.payload.epoch, e.payload.iteration)
    assert first_iteration == {0: 0, 1: 12, 2: 20}


def test_after_a_reshape_only_the_slow_rank_is_flagged_at_a_sane_factor(outcome: tuple[list, list]) -> None:
    _, out = outcome
    opened = [(e.payload.iteration, e.payload.locations[0]) for e in out if e.kind == "incident.opened"]
    # every incident, in every epoch, is on rank 5 alone (no TP group, no untouched replica)
    assert [(it, loc.rank, loc.replica) for it, loc in opened] == [(it, 5, 1) for it, _ in opened], opened
    assert [it for it, _ in opened] and 6 <= opened[0][0] <= 8, opened  # found at onset (iteration 6)
    # rank 5 is out of the plan in epoch 1: nothing measures it healthy, so its incident stays open
    # (resolving it would invite the slow device back); it returns at epoch 2 (iteration 20) still ×3
    assert len(opened) == 1, opened
    # every factor published for it (opened, updated, confirmed) within 2× of the truth (×3)
    factors = [loc.factor for e in out if e.kind.startswith("incident.") for loc in (getattr(e.payload, "locations", None)
                                                                                     or [])]
    assert factors and all(1.5 <= f <= 6.0 for f in factors), factors
    # ... and is not resolved through the reshape, the rollback, or after, while the rank stays slow
    assert not [e for e in out if e.kind == "incident.resolved"]


def test_the_demo_reshape_that_keeps_the_slow_rank_keeps_its_incident_open_at_its_factor() -> None:
    events = read_trace(HERE / "detect_torch_demo_reshape.parquet")
    plans = [e.payload.plan for e in events if isinstance(e.payload, PlanCurrent)]
    assert [p.epoch for p in plans] == [0, 1] and 5 in plans[1].devices
    assert plans[1].role_of(5).end_layer == 1 and [p.microbatches for p in plans[1].pipelines] == [5, 3]
    out = list(detect_events(events))
    opened = [e.payload for e in out if isinstance(e.payload, IncidentOpened)]
    assert [(p.iteration, p.locations[0].rank) for p in opened] == [(21, 5)], opened  # onset 20
    # still slow through epoch 1 (22-36)
    assert not [e for e in out if isinstance(e.payload, IncidentResolved)]
    factors = [loc.factor for e in out if e.kind.startswith("incident.") for loc in (getattr(e.payload, "locations",
                                                                                             None) or [])]
    assert all(1.5 <= f <= 6.0 for f in factors), factors
