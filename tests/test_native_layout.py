"""Which plans the native executor runs, and the reason it gives for the ones it refuses."""

from __future__ import annotations

import pytest

from collector.plan import PipelinePlan, Plan, StagePlan
from trainer.native.capabilities import NATIVE_CAPABILITIES, refusal
from trainer.native.layout import NativeLayout, MeshRuleBroken
from trainer.native.model import LlamaConfig

CFG = LlamaConfig(n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256)


def _pipe(r: int, mbs: int, *stages: tuple[tuple[int, ...], int, int]) -> PipelinePlan:
    return PipelinePlan(replica=r, microbatches=mbs,
                        stages=tuple(StagePlan(devices=d, first_layer=a, end_layer=b) for d, a, b in stages))


def test_a_uniform_plan_maps_devices_onto_a_dp_pp_tp_mesh():
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    layout = NativeLayout.of(plan, CFG)
    assert (layout.dp, layout.pp, layout.tp) == (2, 2, 2)
    assert layout.mesh_ranks().tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_replicas_may_run_different_microbatch_counts():
    plan = Plan(epoch=0, num_layers=4, pipelines=(_pipe(0, 3, ((0,), 0, 4)), _pipe(1, 1, ((5,), 0, 4))))
    assert refusal(plan, CFG) is None
    assert NativeLayout.of(plan, CFG).mesh_ranks().tolist() == [[[0]], [[1]]]


@pytest.mark.parametrize("plan, reason", [
    (Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 1), 0, 4)), _pipe(1, 2, ((2,), 0, 4)))),
     "mixes TP degrees"),
    (Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0,), 0, 1), ((1,), 1, 4)),
                                            _pipe(1, 2, ((2,), 0, 2), ((3,), 2, 4)))),
     "different stage layer ranges"),
    (Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=1, epoch=1), "fewer micro-batches"),
    (Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1, schedule="zero_bubble"),
     "not run by the native executor"),
    (Plan.uniform(tp=8, pp=1, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1), "does not divide"),
])
def test_a_plan_the_mesh_cannot_express_is_refused_with_the_rule_it_breaks(plan, reason):
    assert reason in (refusal(plan, CFG) or "")
    with pytest.raises(MeshRuleBroken, match=reason):
        NativeLayout.of(plan, CFG)


def test_a_uniform_tp_shrink_to_any_degree_that_divides_the_model_is_run():
    # TP4 → TP3 on devices 0, 2, 3 (device 1 excluded): a regular mesh again, so a 12-head model
    # runs it; the 4-head one cannot be cut in three and is refused with the dimension that fails.
    twelve = LlamaConfig(dim=48, n_layers=4, n_heads=12, ffn_hidden=96, vocab_size=96)
    running = Plan.uniform(tp=4, pp=1, dp=1, num_layers=4, microbatches_per_replica=2)
    tp3 = Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 2, 3), 0, 4)),))
    assert refusal(tp3, twelve, running_epoch=0, running=running) is None
    assert NativeLayout.of(tp3, twelve).mesh_ranks().tolist() == [[[0, 1, 2]]]
    assert refusal(tp3, CFG, running_epoch=0, running=running) == (
        "TP 3 does not divide the model's attention heads (4); choose a TP degree that divides the heads, "
        "FFN width and vocabulary ([1, 2, 4])")


def test_only_the_next_epoch_is_accepted():
    plan = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2, epoch=3)
    assert "not the running epoch 1 + 1" in (refusal(plan, CFG, running_epoch=1) or "")
    assert refusal(plan, CFG, running_epoch=2) is None


def test_the_declaration_names_every_remediation_kind():
    caps = NATIVE_CAPABILITIES
    assert not caps.tp_exclusion and caps.tp_shrink == "uniform" and caps.pp_repartition == "uniform"
    assert caps.dp_drop and caps.dp_microbatch_migration and caps.schedules == ["1f1b"]
    assert {"tp_shrink", "tp_exclusion", "pp_repartition", "dp_drop", "dp_microbatch_migration"} <= set(caps.notes)
