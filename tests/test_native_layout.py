"""Which plans the native executor runs, and the reason it gives for the ones it refuses."""

from __future__ import annotations

import pytest

from collector.plan import PipelinePlan, Plan, StagePlan
from resihp.cli import main
from trainer.native.capabilities import NATIVE_CAPABILITIES, refusal
from trainer.native.layout import MeshRuleBroken, NativeLayout, chunk_sizes
from trainer.native.model import LlamaConfig

CFG = LlamaConfig(n_layers=4, n_heads=4, ffn_hidden=128, vocab_size=256)


def _pipe(r: int, mbs: int, *stages: tuple[tuple[int, ...], int, int]) -> PipelinePlan:
    return PipelinePlan(replica=r, microbatches=mbs,
                        stages=tuple(StagePlan(devices=d, first_layer=a, end_layer=b) for d, a, b in stages))


def test_each_stage_of_a_uniform_plan_is_a_dp_by_tp_grid():
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    layout = NativeLayout.of(plan, CFG)
    assert (layout.dp, layout.pp, layout.grid) == (2, 2, (True, True))
    assert layout.stage_groups(1) == [(2, 3), (6, 7)]


def test_replicas_may_run_different_microbatch_counts():
    plan = Plan(epoch=0, num_layers=4, pipelines=(_pipe(0, 3, ((0,), 0, 4)), _pipe(1, 1, ((5,), 0, 4))))
    assert refusal(plan, CFG) is None
    assert NativeLayout.of(plan, CFG).stage_groups(0) == [(0,), (5,)]


def test_a_stage_excluding_a_device_runs_at_its_own_tp_degree_beside_its_replicas():
    # PP2·DP2·TP2, then stage 1 of replica 0 on device 2 alone (device 3 excluded): stage 0 stays a
    # (dp, tp) grid under FSDP; stage 1 holds TP 1 and TP 2 side by side, so it is no grid (its
    # replicas sum full gradients). A width that does not divide evenly takes a stage off the grid too.
    running = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    excluded = Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 1), 0, 2), ((2,), 2, 4)),
                                                      _pipe(1, 2, ((4, 5), 0, 2), ((6, 7), 2, 4))))
    assert refusal(excluded, CFG, running_epoch=0, running=running) is None
    assert NativeLayout.of(excluded, CFG).grid == (True, False)
    uneven = LlamaConfig(dim=48, n_layers=4, n_heads=12, ffn_hidden=100, vocab_size=96)
    tp3 = Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 1, 2), 0, 4)),))
    assert refusal(tp3, uneven) is None and NativeLayout.of(tp3, uneven).grid == (False,)
    assert chunk_sizes(100, 3) == [34, 34, 32]


@pytest.mark.parametrize("plan, reason", [
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


def test_a_tp_degree_must_divide_the_heads_and_leave_every_rank_a_piece():
    # TP4 → TP3 on devices 0, 2, 3 (device 1 excluded): a 12-head model runs it; the 4-head one
    # cannot give three ranks whole heads and is refused with the dimension that fails.
    twelve = LlamaConfig(dim=48, n_layers=4, n_heads=12, ffn_hidden=96, vocab_size=96)
    running = Plan.uniform(tp=4, pp=1, dp=1, num_layers=4, microbatches_per_replica=2)
    tp3 = Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 2, 3), 0, 4)),))
    assert refusal(tp3, twelve, running_epoch=0, running=running) is None
    assert NativeLayout.of(tp3, twelve).stage_groups(0) == [(0, 2, 3)]
    assert refusal(tp3, CFG, running_epoch=0, running=running) == (
        "TP 3 does not divide the model's attention heads (4); choose a TP degree that divides the heads "
        "([1, 2, 4]); the FFN width and vocabulary may divide unevenly")
    tiny = LlamaConfig(dim=48, n_layers=4, n_heads=12, ffn_hidden=96, vocab_size=2)
    assert "without a piece of the model's vocabulary (2)" in (refusal(tp3, tiny) or "")


def test_only_the_next_epoch_is_accepted():
    plan = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2, epoch=3)
    assert "not the running epoch 1 + 1" in (refusal(plan, CFG, running_epoch=1) or "")
    assert refusal(plan, CFG, running_epoch=2) is None


def test_the_declaration_names_every_remediation_kind():
    caps = NATIVE_CAPABILITIES
    assert caps.tp_exclusion and caps.tp_shrink == "per_stage" and caps.pp_repartition == "uniform"
    assert caps.dp_drop and caps.dp_microbatch_migration and caps.schedules == ["1f1b"]
    assert {"tp_shrink", "tp_exclusion", "pp_repartition", "dp_drop", "dp_microbatch_migration"} <= set(caps.notes)


def test_resihp_train_native_refuses_a_later_plan_before_any_process_starts(tmp_path):
    # `--reshape ITERATION:PLAN.json` schedules a live change; each plan is judged against the one
    # before it, so a plan the executor cannot run stops the command with the reason, and a stage
    # at its own TP degree passes.
    start = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    excluded = Plan(epoch=1, num_layers=4, pipelines=(_pipe(0, 2, ((0, 1), 0, 2), ((2,), 2, 4)),
                                                      _pipe(1, 2, ((4, 5), 0, 2), ((6, 7), 2, 4))))
    split = Plan(epoch=2, num_layers=4, pipelines=(_pipe(0, 2, ((0, 1), 0, 1), ((2,), 1, 4)),
                                                   _pipe(1, 2, ((4, 5), 0, 2), ((6, 7), 2, 4))))
    for name, plan in (("start", start), ("excluded", excluded), ("split", split)):
        (tmp_path / f"{name}.json").write_text(plan.model_dump_json())
    argv = ["train", "--native", "--layers", "4", "--no-telemetry", "--plan", str(tmp_path / "start.json"),
            "--reshape", f"1:{tmp_path / 'excluded.json'}", "--reshape", f"2:{tmp_path / 'split.json'}"]
    with pytest.raises(SystemExit, match="cannot run .*split.json: .*different stage layer ranges"):
        main(argv)
    with pytest.raises(SystemExit, match="give ITERATION:PLAN.json"):
        main(argv[:-4] + ["--reshape", "soon"])
