"""The reference trainer runs a TP degree that is not a power of two, on real gloo processes.

A TP3 replica (devices 0-2) beside a TP1 replica (device 3) of a 12-head model: their DP buckets
cannot reduce shard by shard, so each unit's gradient is gathered to full size inside the TP3
group and one copy per owner group enters the all-reduce ("full" mode). Losses and final
parameters (with AdamW state) must equal one rank training the same global batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from collector.plan import PipelinePlan, Plan, StagePlan
from tests.test_trainer_reshape import _final_state, _losses, _spec
from trainer.reference.launcher import launch

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

MODEL = dict(vocab_size=64, n_layer=2, n_head=12, n_embd=48, block_size=32, dtype="float64")
ITERATIONS = 3


def _train(tmp: Path, plan: Plan, ranks: int) -> tuple[dict, dict]:
    result = launch(_spec(tmp, model=MODEL, iterations=ITERATIONS), plan, ranks)
    assert result.exit_codes == {d: 0 for d in range(ranks)}
    return _losses(tmp), _final_state(tmp)


def test_a_tp3_replica_beside_a_tp1_replica_trains_like_one_rank(tmp_path: Path) -> None:
    one = Plan.uniform(tp=1, pp=1, dp=1, num_layers=2, microbatches_per_replica=4)
    mixed = Plan(epoch=0, num_layers=2, pipelines=(
        PipelinePlan(replica=0, microbatches=3, stages=(StagePlan(devices=(0, 1, 2), first_layer=0, end_layer=2),)),
        PipelinePlan(replica=1, microbatches=1, stages=(StagePlan(devices=(3,), first_layer=0, end_layer=2),)),
    ))
    ref_losses, ref_state = _train(tmp_path / "one", one, 1)
    losses, state = _train(tmp_path / "mixed", mixed, 4)

    assert sorted(losses) == sorted(ref_losses) == list(range(ITERATIONS))
    for i in range(ITERATIONS):
        assert losses[i][1] == pytest.approx(ref_losses[i][1], rel=1e-10, abs=1e-12), f"iteration {i}"
    assert sorted(state) == sorted(ref_state)
    for name, kinds in ref_state.items():
        for kind, tensor in kinds.items():
            torch.testing.assert_close(state[name][kind], tensor, rtol=1e-9, atol=1e-12, msg=f"{name} {kind}")
