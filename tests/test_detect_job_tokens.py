"""analytics.prediction reports the job's tokens: every micro-batch once, however many ranks
(TP ranks, later stages, model chunks) ran it."""

from __future__ import annotations

from analytics.detection.facts import job_tokens
from analytics.detection.frame import build_frame
from collector.events import Chunk, Coords, RankIteration
from collector.plan import Plan

PLAN = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=3)


def test_each_microbatch_counts_once_under_tp2_pp2_dp2():
    tokens = {(r, m): 1000 * (r + 1) + 10 * m for r in range(2) for m in range(3)}  # per replica, micro-batch
    reports = []
    for device, role in PLAN.roles.items():
        chunks = [Chunk(kind=k, microbatch=m, tokens=tokens[role.replica, m], seq_lens=[tokens[role.replica, m]],
                        start_s=0.0, duration_s=0.01) for m in range(3) for k in ("F", "B")]
        reports.append(RankIteration(epoch=0, iteration=0, rank=device, coords=Coords(tp=role.tp_rank, pp=role.stage,
                                     dp=role.replica), wall_s=1.0, chunks=chunks))
    assert job_tokens(build_frame(reports)) == sum(tokens.values())
