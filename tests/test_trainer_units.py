"""Fast single-process tests of the trainer's pieces: data, per-document attention, TP sharding,
the DP bucket layout, the command intake's epoch fencing, the drop-replica policy, fault lists."""

from __future__ import annotations

from dataclasses import asdict
from typing import cast

import pytest
import torch
import torch.distributed as dist

from collector.events import AckStatus, ReconfigureCommand
from collector.plan import PipelinePlan, Plan, StagePlan
from trainer.agent.signed_store import SignedStore
from trainer.data import IGNORE, global_targets, microbatch, replica_microbatch_ids
from trainer.fault_spec import FaultList
from trainer.reference.intake import CommandIntake
from trainer.reference.launcher import check_launchable, drop_replicas, on_death_plan
from trainer.reference.rendezvous import (CONTROL_POST, PostAborted, abort_key, arrive_key, await_arrivals, done_key, failed_key,
                                newest_post, read_post)
from trainer.reference.model import GPTConfig, GPTStage, init_full, init_stage, shard, shard_rule, unshard
from trainer.native.model import LlamaConfig
from trainer.reference.optim import AdamW
from trainer.reference.parallel import PlanWorld, keeps_groups
from trainer.reference.schedule import paced_chunk_s

CFG = GPTConfig(vocab_size=64, n_layer=4, n_head=4, n_embd=32, block_size=64, dtype="float64")


def test_microbatches_are_deterministic_packed_and_never_cross_documents() -> None:
    a = microbatch(7, 3, 5, 64, 64)
    b = microbatch(7, 3, 5, 64, 64)
    assert torch.equal(a.tokens, b.tokens) and a.seq_lens == b.seq_lens
    assert sum(a.seq_lens) == 64 and len(a.seq_lens) > 1
    ends = torch.tensor(a.seq_lens).cumsum(0) - 1
    assert (a.targets[ends] == IGNORE).all(), "the last token of a document has no target"
    assert int((a.targets != IGNORE).sum()) == a.num_targets
    assert int((a.positions == 0).sum()) == len(a.seq_lens), "positions restart at every document"
    assert global_targets(7, 3, 8, 64) == sum(microbatch(7, 3, m, 64, 64).num_targets for m in range(8))


@pytest.mark.parametrize("build", [GPTConfig, LlamaConfig])
@pytest.mark.parametrize("dtype", ["float33", "int64"])
def test_either_model_config_refuses_a_dtype_that_is_not_a_torch_float(build, dtype) -> None:
    with pytest.raises(ValueError, match=f"unknown dtype '{dtype}'"):
        build(dtype=dtype)
    assert build(dtype="float64").torch_dtype is torch.float64


def test_replicas_get_contiguous_microbatch_ranges_by_their_counts() -> None:
    plan = Plan.uniform(tp=1, pp=1, dp=3, num_layers=2, microbatches_per_replica=1)
    plan = plan.model_copy(update={"pipelines": tuple(
        p.model_copy(update={"microbatches": m}) for p, m in zip(plan.pipelines, [3, 1, 4]))})
    assert [list(replica_microbatch_ids(plan, r)) for r in range(3)] == [[0, 1, 2], [3], [4, 5, 6, 7]]


def test_attention_is_per_document() -> None:
    stage = GPTStage(CFG, [(0, 4)])
    init_stage(stage, 0)
    mb = microbatch(0, 0, 0, 64, 64)
    out = stage(mb.tokens, mb.positions, mb.seq_lens)
    first = mb.seq_lens[0]
    changed = mb.tokens.clone()
    changed[first:] = (changed[first:] + 1) % 64  # every later document differs
    out2 = stage(changed, mb.positions, mb.seq_lens)
    torch.testing.assert_close(out[:first], out2[:first], rtol=0, atol=0)
    assert not torch.allclose(out[first:], out2[first:])


def test_tp_shards_reassemble_to_the_full_parameter() -> None:
    for name in ["layers.1.attn.q.weight", "layers.1.mlp.out.weight", "layers.1.ln1.weight", "wte.weight"]:
        full = init_full(CFG, name, 0)
        pieces = [shard(full, shard_rule(name), 4, r) for r in range(4)]
        assert torch.equal(unshard(pieces, shard_rule(name)), full)


def test_dp_buckets_reduce_shards_when_tp_matches_and_full_tensors_when_it_does_not() -> None:
    uniform = PlanWorld(Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=1), tuple(range(8)))
    assert [(b.devices, b.full) for b in uniform.buckets] == [
        ((0, 4), (False,) * 3), ((1, 5), (False,) * 3), ((2, 6), (False,) * 3), ((3, 7), (False,) * 3)]
    mixed = Plan(epoch=0, num_layers=2, pipelines=(
        PipelinePlan(replica=0, microbatches=1, stages=(StagePlan(devices=(0, 1), first_layer=0, end_layer=2),)),
        PipelinePlan(replica=1, microbatches=1, stages=(StagePlan(devices=(2,), first_layer=0, end_layer=1),
                                                        StagePlan(devices=(3,), first_layer=1, end_layer=2)))))
    buckets = PlanWorld(mixed, (0, 1, 2, 3)).buckets
    assert [(b.devices, b.units, set(b.full)) for b in buckets] == [
        ((0, 1, 2), ("embed", "layer.0"), {True}), ((0, 1, 3), ("layer.1", "head"), {True})]


def test_adamw_steps_a_shard_exactly_like_its_slice_of_the_full_parameter() -> None:
    full = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.float64))
    part = torch.nn.Parameter(full.detach()[4:].clone())
    grad = torch.randn(8, 4, dtype=torch.float64)
    o_full, o_part = AdamW([full]), AdamW([part])
    for _ in range(3):
        full.grad, part.grad = grad.clone(), grad[4:].clone()
        o_full.step()
        o_part.step()
    assert torch.equal(full.detach()[4:], part.detach())


class _Store:
    """Just enough of a TCPStore for the intake's unit logic."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def _records() -> SignedStore:
    """The launcher's signed records over a :class:`_Store` (trainer/agent/signed_store.py)."""
    return SignedStore(cast(dist.Store, _Store()), "units", reader="trainer")  # a dict standing in for a TCPStore


def _fake_store(records: SignedStore) -> _Store:
    """The :class:`_Store` under ``records``, to look at what was written."""
    store = records.store
    assert isinstance(store, _Store)
    return store


def _cmd(plan: Plan, cid: str) -> ReconfigureCommand:
    return ReconfigureCommand(command_id=cid, plan_id="p", plan=plan)


def test_intake_applies_only_the_next_epoch_and_reports_the_rest() -> None:
    store = _records()
    p0 = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    p1 = p0.model_copy(update={"epoch": 1})
    intake = CommandIntake(store, p0, n_layer=4, n_head=4, global_microbatches=4)
    alive = {0, 1, 2, 3}
    for c in [_cmd(p1, "a"), _cmd(p1, "a"), _cmd(p0, "b"), _cmd(p0.model_copy(update={"epoch": 3}), "c")]:
        intake.offer(c)
    assert intake.poll(alive, progress_iteration=-1) == []  # nothing ran on epoch 0 yet
    assert intake.poll(alive, progress_iteration=0) == []  # posted, waiting for the ranks
    post = read_post(store, newest_post(store))
    assert (post.number, post.plan, post.world) == (1, p1, (0, 1, 2, 3))
    for d in alive:
        store.set(done_key(1, d), {"pause_s": 0.1 * d, "pause_iterations": 1, "failure_wait_s": 0,
                                   "iteration": 2, "source": "live"})
    acks = intake.poll(alive, progress_iteration=1)
    assert [(a.command_id, a.status) for a in acks] == [
        ("a", AckStatus.APPLIED), ("a", AckStatus.IGNORED_DUPLICATE), ("b", AckStatus.IGNORED_STALE),
        ("c", AckStatus.IGNORED_STALE)]
    assert acks[0].pause_s == pytest.approx(0.3) and acks[0].running_epoch == 1
    assert "state from live peers" in acks[0].detail
    assert "skips epochs" in acks[3].detail


def test_a_post_whose_device_dies_is_failed_at_once_and_waiting_ranks_are_released() -> None:
    store = _records()
    p0 = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    intake = CommandIntake(store, p0, n_layer=4, n_head=4, global_microbatches=4)
    intake.start((0, 1, 2, 3))
    p1 = p0.model_copy(update={"epoch": 1})
    intake.offer(_cmd(p1, "a"))
    assert intake.poll({0, 1, 2, 3}, progress_iteration=0) == []  # posted as post 1
    assert intake.doomed(3) and newest_post(store) == 1
    (ack,) = intake.poll({0, 1, 2}, progress_iteration=0)  # device 3 died before the reshape finished
    assert ack.status == AckStatus.FAILED and "device 3 died" in ack.detail and "names [3]" in ack.detail
    assert ack.running_epoch == 0
    with pytest.raises(PostAborted, match="device 3"):  # a rank waiting at post 1's rendezvous returns
        await_arrivals(store, 1, (0, 1, 2, 3), device=0, timeout_s=60)
    # The same epoch can be posted again (a new command) without the dead device.
    survivors = drop_replicas(p0, {3})
    intake.offer(_cmd(survivors, "b"))
    assert intake.poll({0, 1, 2}, progress_iteration=0) == []
    assert read_post(store, 2).plan == survivors and read_post(store, 2).world == (0, 1, 2)


def _intake_with_a_spare() -> tuple[SignedStore, CommandIntake, Plan]:
    """An intake whose world is devices 0-4 under a plan that uses 0-3 (4 is a spare), with the
    command "a" for epoch 1 offered; returns the store, the intake and epoch 1's plan."""
    store = _records()
    p0 = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
    intake = CommandIntake(store, p0, n_layer=4, n_head=4, global_microbatches=4)
    intake.start((0, 1, 2, 3, 4))
    p1 = p0.model_copy(update={"epoch": 1})
    intake.offer(_cmd(p1, "a"))
    return store, intake, p1


def _report_done(store: SignedStore, post: int, devices) -> None:
    for d in devices:
        store.set(done_key(post, d), {"pause_s": 0.1, "pause_iterations": 1, "failure_wait_s": 0,
                                      "iteration": 1, "source": "live"})


def test_a_spare_that_dies_mid_reshape_gets_the_same_command_posted_again_without_it() -> None:
    # Device 4 is in the world but the plan leaves it out: its death changes nothing the plan needs.
    store, intake, p1 = _intake_with_a_spare()
    assert intake.poll({0, 1, 2, 3, 4}, progress_iteration=0) == []  # posted as post 1
    assert not intake.doomed(4) and intake.doomed(3)
    assert intake.poll({0, 1, 2, 3}, progress_iteration=0) == []  # 4 died: still in flight, posted again
    with pytest.raises(PostAborted, match=r"spare devices \[4\]"):
        await_arrivals(store, 1, (0, 1, 2, 3, 4), device=0, timeout_s=60)
    assert newest_post(store) == 2 and read_post(store, 2).plan == p1 and read_post(store, 2).world == (0, 1, 2, 3)
    _report_done(store, 2, range(4))
    (ack,) = intake.poll({0, 1, 2, 3}, progress_iteration=0)
    assert (ack.command_id, ack.status, ack.running_epoch) == ("a", AckStatus.APPLIED, 1)
    assert "spare devices [4] died mid-reshape" in ack.detail and intake.running == p1


def test_a_spare_that_dies_past_the_arrival_barrier_lets_the_reshape_run_its_course() -> None:
    # Everyone arrived at post 1, so the ranks no longer heed an abort: posting the command again
    # would hand them the epoch they are already reshaping to. The intake waits for the live
    # devices instead, and the running world it reports still holds the dead spare (the launcher
    # re-posts the plan without it).
    store, intake, p1 = _intake_with_a_spare()
    assert intake.poll({0, 1, 2, 3, 4}, progress_iteration=0) == []
    for d in range(5):
        store.set(arrive_key(1, d), "1")
    assert intake.poll({0, 1, 2, 3}, progress_iteration=0) == []  # 4 died: still in flight, not posted again
    assert newest_post(store) == 1 and not store.has(abort_key(1))
    _report_done(store, 1, range(4))
    (ack,) = intake.poll({0, 1, 2, 3}, progress_iteration=0)
    assert (ack.command_id, ack.status) == ("a", AckStatus.APPLIED)
    assert intake.running == p1 and intake.running_world == (0, 1, 2, 3, 4)


def test_a_spare_whose_death_fails_the_ranks_past_the_barrier_gets_the_command_posted_again() -> None:
    # Everyone arrived at post 1, then the spare died and the ranks' transfer failed: they report it
    # and wait on the running epoch. The same command is posted again without the spare (still one
    # command, one ack), not failed.
    store, intake, p1 = _intake_with_a_spare()
    assert intake.poll({0, 1, 2, 3, 4}, progress_iteration=0) == []
    for d in range(5):
        store.set(arrive_key(1, d), "1")
    for d in range(4):
        store.set(failed_key(1, d), "DistNetworkError: Connection closed by peer")
    assert intake.poll({0, 1, 2, 3}, progress_iteration=0) == []
    assert newest_post(store) == 2 and read_post(store, 2).plan == p1 and read_post(store, 2).world == (0, 1, 2, 3)
    _report_done(store, 2, range(4))
    (ack,) = intake.poll({0, 1, 2, 3}, progress_iteration=0)
    assert (ack.command_id, ack.status) == ("a", AckStatus.APPLIED)
    assert "spare devices [4] died mid-reshape" in ack.detail and intake.running_world == (0, 1, 2, 3)


def test_intake_fails_a_plan_the_job_cannot_run_without_touching_the_ranks() -> None:
    store = _records()
    p0 = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2)
    intake = CommandIntake(store, p0, n_layer=4, n_head=4, global_microbatches=4)
    too_many = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=3, epoch=1)
    dead_device = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2, epoch=1, first_device=1)
    intake.offer(_cmd(too_many, "x"))
    intake.offer(_cmd(dead_device, "y"))
    acks = intake.poll({0, 1}, progress_iteration=5)
    assert [a.status for a in acks] == [AckStatus.FAILED, AckStatus.FAILED]
    assert "global batch" in acks[0].detail and "[2]" in acks[1].detail
    assert CONTROL_POST not in _fake_store(store).data


def test_any_tp_degree_is_a_plan_and_the_trainer_refuses_one_that_does_not_divide_the_heads() -> None:
    from trainer.reference.spec import RunSpec

    three = Plan.uniform(tp=3, pp=1, dp=1, num_layers=4, microbatches_per_replica=4)
    assert three.shape() == "TP3·PP1·DP1" and three.tp_split_problem(12) is None
    why = ("replica 0 stage 0: TP degree 3 (devices [0, 1, 2]) does not divide the model's 4 attention heads; "
           "use a degree that does ([1, 2, 4])")
    assert three.tp_split_problem(4) == why
    with pytest.raises(ValueError, match=r"^replica 0 stage 0: TP degree 3 .* \(\[1, 2, 4\]\)$"):
        check_launchable(RunSpec(model=asdict(CFG)), three, 3)
    check_launchable(RunSpec(model={**asdict(CFG), "n_head": 12, "n_embd": 48}), three, 3)

    store = _records()
    intake = CommandIntake(store, Plan.uniform(tp=4, pp=1, dp=1, num_layers=4, microbatches_per_replica=4),
                           n_layer=4, n_head=4, global_microbatches=4)
    intake.offer(_cmd(three.model_copy(update={"epoch": 1}), "tp3"))
    (ack,) = intake.poll({0, 1, 2, 3}, progress_iteration=5)
    assert (ack.status, ack.detail) == (AckStatus.FAILED, why) and CONTROL_POST not in _fake_store(store).data


def test_only_a_change_of_micro_batch_counts_on_the_same_world_keeps_the_groups() -> None:
    running = PlanWorld(Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=4), (0, 1, 2, 3))
    p0 = running.plan

    def counts(*ms: int) -> Plan:
        return p0.model_copy(update={"epoch": 1, "pipelines": tuple(
            p.model_copy(update={"microbatches": m}) for p, m in zip(p0.pipelines, ms))})

    assert keeps_groups(running, counts(5, 3), (0, 1, 2, 3))
    assert not keeps_groups(running, counts(5, 3), (0, 1, 2, 3, 4)), "a world with a spare more re-forms"
    resplit = counts(5, 3).model_copy(update={"pipelines": (
        PipelinePlan(replica=0, microbatches=5, stages=(StagePlan(devices=(0,), first_layer=0, end_layer=1),
                                                        StagePlan(devices=(1,), first_layer=1, end_layer=4))),
        counts(5, 3).pipelines[1])})
    assert not keeps_groups(running, resplit, (0, 1, 2, 3)), "moving a stage boundary moves state"
    interleaved = counts(4, 4).model_copy(update={"schedule": "interleaved", "virtual_stages": 2})
    assert not keeps_groups(running, interleaved, (0, 1, 2, 3)), "another schedule re-deals the layers"


def test_drop_replicas_keeps_the_global_batch() -> None:
    plan = Plan.uniform(tp=2, pp=2, dp=3, num_layers=4, microbatches_per_replica=3)
    new = drop_replicas(plan, {5})
    assert new.epoch == 1 and new.dp == 2 and new.global_microbatches == 9
    assert 5 not in new.devices and [p.replica for p in new.pipelines] == [0, 1]


def test_on_death_policy_uses_spares_when_no_replica_survives() -> None:
    plan = Plan.uniform(tp=1, pp=2, dp=1, num_layers=4, microbatches_per_replica=4)
    new, how = on_death_plan(plan, {1}, alive={0, 2, 3})
    assert new is not None
    assert [st.devices for st in new.pipelines[0].stages] == [(0,), (2,)] and new.epoch == 1
    assert "spares" in how
    assert on_death_plan(plan, {1}, alive={0})[0] is None


def test_fault_list_reads_the_documented_yaml(tmp_path) -> None:
    path = tmp_path / "faults.yaml"
    path.write_text("faults:\n  - {kind: slow_compute, rank: 3, factor: 2.0, start_iteration: 2, end_iteration: 4}\n"
                    "  - {kind: kill, rank: 1, start_iteration: 5}\n")
    faults = FaultList.load(path, "trainer").faults
    assert [f.kind for f in faults] == ["slow_compute", "stop_device"]  # "kill": the old name, an alias
    assert [faults[0].active(i) for i in range(5)] == [False, False, True, True, False]


def test_a_rendezvous_timeout_not_above_the_collective_timeout_is_refused() -> None:
    from trainer.reference.spec import RunSpec

    assert RunSpec(pg_timeout_s=5, rendezvous_timeout_s=15).rendezvous_timeout_s == 15
    with pytest.raises(ValueError, match=r"rendezvous timeout 30 s must exceed the collective timeout 30 s.*"
                                         r"--rendezvous-timeout"):
        RunSpec(pg_timeout_s=30, rendezvous_timeout_s=30)


def test_pacing_splits_a_layers_time_over_the_stages_tp_ranks() -> None:
    """A paced rank emulates a device: a TP-2 rank does half a layer's work, so a stage that shrinks
    from TP 2 to TP 1 takes twice as long per layer. Attention's β·Σl² is α/32 per token squared."""
    one_device = paced_chunk_s(1e-3, layers=2, tp=1, tokens=64, seq_lens=[32, 32])
    assert one_device == pytest.approx(2 * (1e-3 * 64 + 1e-3 / 32 * 2048))
    assert paced_chunk_s(1e-3, layers=2, tp=2, tokens=64, seq_lens=[32, 32]) == pytest.approx(one_device / 2)
    assert paced_chunk_s(0.0, layers=2, tp=1, tokens=64, seq_lens=[64]) == 0.0
