"""The pipeline schedules' pieces in one process: how interleaved chunks deal out layers, which
plans the trainer refuses, and that interleaved and zero-bubble orders compute exactly the 1F1B
gradients (a one-rank gloo group; the 8-rank proof is in test_trainer_reshape.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from analytics.detection.schedule import op_table
from collector.events import AckStatus, ReconfigureCommand
from collector.plan import Plan, Schedule
from trainer.reference.chunks import schedule_problem, stage_chunks, units_of_chunks
from trainer.data import global_targets, microbatch
from trainer.faults import FaultInjector
from trainer.reference.intake import CommandIntake
from trainer.reference.model import GPTConfig, TPContext, init_stage
from trainer.reference.parallel import PlanWorld, apply_pp, owner_stage
from trainer.reference.schedule import PipelineSchedule
from trainer.telemetry import IterationRecorder

CFG = GPTConfig(vocab_size=64, n_layer=4, n_head=4, n_embd=32, block_size=64, dtype="float64")


def test_interleaved_stages_hold_round_robin_slices_of_their_layer_count() -> None:
    plan = Plan.uniform(tp=1, pp=2, dp=1, num_layers=8, microbatches_per_replica=4, schedule="interleaved",
                        virtual_stages=2)
    assert stage_chunks(plan, 0, 0) == ((0, 2), (4, 6)) and stage_chunks(plan, 0, 1) == ((2, 4), (6, 8))
    assert units_of_chunks(8, stage_chunks(plan, 0, 0)) == ["embed", "layer.0", "layer.1", "layer.4", "layer.5"]
    assert owner_stage(plan, 0, "head").devices == (1,) and owner_stage(plan, 0, "layer.4").devices == (0,)
    flat = Plan.uniform(tp=1, pp=2, dp=1, num_layers=8, microbatches_per_replica=4)
    assert stage_chunks(flat, 0, 0) == ((0, 4),)


def test_plans_the_interleaved_schedule_cannot_run_are_refused_by_the_intake() -> None:
    odd = Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=3, schedule="interleaved",
                       virtual_stages=2, epoch=1)
    thin = Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=4, schedule="interleaved",
                        virtual_stages=3, epoch=1)
    odd_problem, thin_problem = schedule_problem(odd), schedule_problem(thin)
    assert odd_problem is not None and "multiple of its 2 stages" in odd_problem
    assert thin_problem is not None and "fewer layers" in thin_problem

    class Store(dict):
        def set(self, k, v):
            self[k] = v

        def check(self, keys):
            return all(k in self for k in keys)

    running = Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=3)
    intake = CommandIntake(Store(), running, n_layer=4, n_head=4, global_microbatches=3)
    intake.offer(ReconfigureCommand(command_id="x", plan_id="p", plan=odd))
    (ack,) = intake.poll({0, 1}, progress_iteration=3)
    assert ack.status == AckStatus.FAILED and "interleaved" in ack.detail


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(schedule: Schedule, virtual_stages: int) -> tuple[float, dict[str, torch.Tensor], list]:
    plan = Plan.uniform(tp=1, pp=1, dp=1, num_layers=4, microbatches_per_replica=4, schedule=schedule,
                        virtual_stages=virtual_stages)
    role = plan.role_of(0)
    stage = apply_pp(CFG, plan, role, TPContext())
    init_stage(stage, 0)
    rec = IterationRecorder()
    runner = PipelineSchedule.for_plan(stage, PlanWorld(plan, (0,)), role, FaultInjector([], 0))
    mbs = [microbatch(0, 0, m, CFG.vocab_size, CFG.block_size) for m in range(4)]
    loss = runner.run(mbs, global_targets(0, 0, 4, CFG.block_size), rec)
    grads: dict[str, torch.Tensor] = {}
    for name, param in stage.named_parameters():
        assert param.grad is not None
        grads[name] = param.grad.clone()
    return loss, grads, rec.chunks


def test_interleaved_and_zero_bubble_orders_give_the_1f1b_loss_and_gradients(one_rank_group) -> None:
    ref_loss, ref_grads, ref_chunks = _run("1f1b", 1)
    orders: list[tuple[Schedule, int]] = [("interleaved", 2), ("zero_bubble", 1)]
    for schedule, v in orders:
        loss, grads, chunks = _run(schedule, v)
        assert loss == pytest.approx(ref_loss, rel=1e-13)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-15, msg=f"{schedule} {name}")
        ran = [(c.kind.value, c.virtual_stage, c.microbatch) for c in chunks]
        assert ran == op_table(schedule, 1, 4, v).stage_order(0), "the trainer runs the model's op order"
    assert {c.kind.value for c in ref_chunks} == {"F", "B"}
