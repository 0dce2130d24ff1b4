"""The contract's epoch fence, in its one home, and the executors that must agree with it."""

from __future__ import annotations

from collector.epoch_fence import EpochFence, fence_verdict, node_fence_verdict
from collector.events import AckStatus, CommandAck, NodeCommand, ReconfigureCommand
from collector.plan import Plan


def _command(command_id: str, epoch: int) -> ReconfigureCommand:
    return ReconfigureCommand(command_id=command_id, plan_id=f"p-{command_id}", plan=Plan.uniform(tp=1, pp=2, dp=1, num_layers=4,
                                                                                   microbatches_per_replica=4, epoch=epoch))


def test_next_epoch_passes_the_fence():
    assert fence_verdict(_command("a", 3), running_epoch=2, seen=set()) == (None, "")


def test_same_or_older_epoch_is_stale_and_says_not_newer():
    for epoch in (0, 2):
        status, detail = fence_verdict(_command("a", epoch), running_epoch=2, seen=set())
        assert status is AckStatus.IGNORED_STALE
        assert f"epoch {epoch} is not newer than the running epoch 2" == detail


def test_skipping_an_epoch_is_stale_and_says_skips():
    status, detail = fence_verdict(_command("a", 5), running_epoch=2, seen=set())
    assert status is AckStatus.IGNORED_STALE
    assert "skips epochs" in detail and "only 3 applies on top of 2" in detail


def test_a_seen_id_is_a_duplicate_even_at_the_right_epoch():
    status, detail = fence_verdict(_command("a", 3), running_epoch=2, seen={"a"})
    assert status is AckStatus.IGNORED_DUPLICATE
    assert detail == "command a was already handled"


def test_fence_verdict_does_not_mark_the_command_seen():
    seen: set[str] = set()
    fence_verdict(_command("a", 3), running_epoch=2, seen=seen)
    assert seen == set()


def test_a_node_command_is_obeyed_only_in_the_round_it_names_and_only_once():
    def stop(command_id: str, round_: int) -> NodeCommand:
        return NodeCommand(command_id=command_id, node=1, action="stop", round=round_)

    assert node_fence_verdict(stop("a", 2), running_round=2, seen=set()) == (None, "")
    older, newer = node_fence_verdict(stop("a", 1), 2, set()), node_fence_verdict(stop("a", 3), 2, set())
    assert older[0] is newer[0] is AckStatus.IGNORED_STALE
    assert "decided in rendezvous round 1, but the job re-formed since (round 2)" in older[1]
    assert "names rendezvous round 3, but the job is in round 2" in newer[1]
    assert node_fence_verdict(stop("a", 2), 2, {"a"}) == (AckStatus.IGNORED_DUPLICATE, "command a was already handled")


def test_epoch_fence_marks_seen_and_runs_the_extra_check_only_past_the_fence():
    calls: list[int] = []

    def check(plan: Plan) -> str | None:
        calls.append(plan.epoch)
        return "too big" if plan.epoch == 3 else None

    fence = EpochFence(running_epoch=2, check=check)
    assert fence.judge(_command("a", 3)) == (AckStatus.FAILED, "too big")
    assert fence.judge(_command("a", 3))[0] is AckStatus.IGNORED_DUPLICATE
    assert fence.judge(_command("b", 9))[0] is AckStatus.IGNORED_STALE
    assert calls == [3]


def test_simulator_acks_with_the_fence_details():
    from trainer.sim.engine import SimConfig, SimEngine
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    model = MODEL_PRESETS["tiny"]
    plan = Plan.uniform(tp=1, pp=2, dp=2, num_layers=model.layers, microbatches_per_replica=4)
    engine = SimEngine(SimConfig(model=model, cluster=ClusterSpec(gpus=8), plan=plan, job="fence"))
    running = engine.plan.epoch
    stale = ReconfigureCommand(command_id="old", plan_id="p", plan=engine.plan)
    skipping = ReconfigureCommand(command_id="skip", plan_id="p",
                                  plan=engine.plan.model_copy(update={"epoch": running + 2}))
    acks: dict[str, list[CommandAck]] = {}
    for command in (stale, skipping, stale):
        for ev in engine.reconfigure(command):
            if isinstance(ev.payload, CommandAck):
                acks.setdefault(ev.payload.command_id, []).append(ev.payload)
    expected_stale = fence_verdict(stale, running, set())
    expected_skip = fence_verdict(skipping, running, set())
    assert (acks["old"][0].status, acks["old"][0].detail) == expected_stale
    assert (acks["skip"][0].status, acks["skip"][0].detail) == expected_skip
    assert acks["old"][1].status is AckStatus.IGNORED_DUPLICATE
