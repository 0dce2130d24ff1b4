"""After a reshape that moves layers or changes a TP degree, the cost model keys work by the stage's
layer range and TP degree, so new-layout chunks are never compared with old-layout fits: no false
incident follows a reshape, and a real slowdown under the new layout is still found."""

from __future__ import annotations

import numpy as np

from analytics.detection.detector import Detector
from collector.events import (
    Chunk, CommWait, Coords, CostModelFitted, EventFactory, Heartbeat, IncidentOpened, PlanCurrent, RankIteration,
)
from collector.plan import PipelinePlan, Plan, StagePlan

ALPHA, BETA, GAMMA = 2e-6, 4e-11, 1e-3  # per layer, TP 1


def plan_events(phases: list[tuple[Plan, int]], *, slow: dict[int, float] | None = None, slow_from: int = 0,
                M: int = 6, noise: float = 0.02, seed: int = 0, scale_after: tuple[int, float] | None = None):
    """Telemetry of a job running ``phases`` = [(plan, iterations), ...] in turn, announcing each plan
    (plan.current) as the trainer does. A chunk costs layers/tp × (α·N + β·Σl² + γ) (B twice F),
    with log-normal noise; TP ranks run in lock-step and report their TP waits."""
    rng = np.random.default_rng(seed)
    slow = slow or {}
    facs: dict[str, EventFactory] = {}

    def make(source, payload, t):
        f = facs.setdefault(source, EventFactory("j", source))
        return f.make(payload, time_s=t)

    events, it = [], 0
    for plan, n in phases:
        events.append(make("trainer", PlanCurrent(plan=plan, reason="start" if plan.epoch == 0 else "reshape"),
                           100.0 + it - 0.5))
        for _ in range(n):
            scale = scale_after[1] if scale_after and it >= scale_after[0] else 1.0
            for pipe in plan.pipelines:
                mbs = [[int(x) for x in rng.integers(64, 2048, size=rng.integers(2, 12))] for _ in range(pipe.microbatches)]
                for s, stage in enumerate(pipe.stages):
                    chunks: dict[int, list[Chunk]] = {d: [] for d in stage.devices}
                    comm: dict[int, list[CommWait]] = {d: [] for d in stage.devices}
                    t0 = 0.0
                    for m, lens in enumerate(mbs):
                        n_tok, s2 = sum(lens), float(sum(x * x for x in lens))
                        for kind, mult in (("F", 1.0), ("B", 2.0)):
                            base = scale * mult * stage.num_layers / stage.tp * (ALPHA * n_tok + BETA * s2 + GAMMA)
                            own = {d: base * (slow.get(d, 1.0) if it >= slow_from else 1.0)
                                   * float(np.exp(rng.normal(0, noise))) for d in stage.devices}
                            dur = max(own.values()) + 2e-4
                            for d in stage.devices:
                                chunks[d].append(Chunk(kind=kind, microbatch=m, tokens=n_tok, seq_lens=lens,
                                                       start_s=t0, duration_s=dur))
                                comm[d].append(CommWait(op="tp_allreduce", start_s=t0 + own[d], duration_s=dur - own[d]))
                            t0 += dur
                    for t, d in enumerate(stage.devices):
                        events.append(make(f"rank-{d}", RankIteration(
                            epoch=plan.epoch, iteration=it, rank=d, node=d // 8, coords=Coords(tp=t, pp=s, dp=pipe.replica),
                            wall_s=t0 * 1.2, chunks=chunks[d], comm=comm[d]), 100.0 + it))
                        events.append(make(f"rank-{d}", Heartbeat(rank=d, epoch=plan.epoch, iteration=it + 1,
                                                                   interval_s=1.0), 100.0 + it))
            it += 1
    return events


def reshaped(base: Plan) -> Plan:
    """Epoch 1: replica 0 re-splits its layers 3/1/2 (was 2/2/2); replica 2's middle stage lost a GPU
    and runs at TP 1 (still 2 layers). Replica 1 is unchanged."""
    p0, p1, p2 = base.pipelines
    r0 = PipelinePlan(replica=0, microbatches=p0.microbatches, stages=(
        StagePlan(devices=p0.stages[0].devices, first_layer=0, end_layer=3),
        StagePlan(devices=p0.stages[1].devices, first_layer=3, end_layer=4),
        StagePlan(devices=p0.stages[2].devices, first_layer=4, end_layer=6)))
    mid = p2.stages[1]
    r2 = PipelinePlan(replica=2, microbatches=p2.microbatches, stages=(
        p2.stages[0], StagePlan(devices=mid.devices[:1], first_layer=2, end_layer=4), p2.stages[2]))
    return Plan(epoch=1, num_layers=6, pipelines=(r0, p1, r2))


BASE = Plan.uniform(tp=2, pp=3, dp=3, num_layers=6, microbatches_per_replica=6)


def run(events):
    det = Detector("j")
    out = [p for e in events for p in det.on_event(e)] + det.flush()
    return det, out


def test_no_false_incident_after_a_reshape_that_moves_layers_and_changes_a_tp_degree() -> None:
    det, out = run(plan_events([(BASE, 12), (reshaped(BASE), 14)]))
    assert [p.summary for p in out if isinstance(p, IncidentOpened)] == []
    keys = {k for k in det.model.fits if k[0] == "layers"}
    assert ("layers", 0, 3, 0, 0, 2) in keys and ("layers", 0, 2, 0, 0, 2) in keys  # re-split stage 0 apart
    assert ("layers", 2, 4, 0, 0, 1) in keys and ("layers", 2, 4, 0, 0, 2) in keys  # TP 1 apart from TP 2
    epochs = [p.epoch for p in out if isinstance(p, CostModelFitted)]
    assert 0 in epochs and 1 in epochs  # the planner gets fits of the new layout too


def test_a_slow_rank_under_the_new_layout_is_still_found() -> None:
    # device 8 is replica 1's middle stage (unchanged layout); slow from iteration 16, after the reshape
    _, out = run(plan_events([(BASE, 12), (reshaped(BASE), 14)], slow={8: 1.4}, slow_from=16))
    (inc,) = [p for p in out if isinstance(p, IncidentOpened)]
    assert inc.locations[0].rank == 8 and 16 <= inc.iteration <= 18
