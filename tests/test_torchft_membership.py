"""Evicting a torchft replica group, as logic: which plans are evictions, what the lighthouse allows,
the records the supervisor and a group exchange, and the executor's protocol step by step.

No process: the executor (trainer/torchft/supervisor.py's ``TorchftEviction``) runs against
in-process stores (torch's ``HashStore``, signed records as in production) and the embedded bus; the
groups' side of each record is written here the way a group's rank 0 writes it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from collector import topics
from collector.auth import load_keyring
from collector.embedded import EmbeddedBus
from collector.events import AckStatus, CommandAck, ExecutorCapabilities, PlanCurrent, ReshapePhase
from collector.plan import PipelinePlan, Plan, StagePlan
from collector.stream import EventStream
from remediation.capability_fit import fit_options
from remediation.candidates import PlannerOptions
from remediation.cluster import ClusterState, DeviceState, Hardware
from remediation.model import PlannerModel
from remediation.planner import Planner
from tests.fixtures.signing import factory
from trainer.agent.signed_store import SignedStore, rank_role
from trainer.integration import new_command
from trainer.torchft.membership import (JOINED_KEY, LEFT_KEY, ORDER_KEY, PROGRESS_KEY, TORCHFT_CAPABILITIES,
                                        GroupProgress, Probation, StandingOrder, evicted_groups, eviction_refusal)
from trainer.torchft.supervisor import LighthouseSpec, TorchftEviction
from trainer.torchtitan.layout import JOB_KEY, JobShape, TitanLayout, plan_of

GROUPS: list[tuple[int, ...]] = [(0,), (1,), (2,)]


def _running(microbatches: int = 2) -> Plan:
    return plan_of(TitanLayout(dp_replicate=3), [0, 1, 2], num_layers=6, microbatches=microbatches, epoch=0)


def _replicas(devices: list[int], microbatches: int = 3, epoch: int = 1) -> Plan:
    return Plan(epoch=epoch, num_layers=6, pipelines=tuple(
        PipelinePlan(replica=r, microbatches=microbatches,
                     stages=(StagePlan(devices=(d,), first_layer=0, end_layer=6),))
        for r, d in enumerate(devices)))


# ---- plans as evictions ------------------------------------------------------------------------------


def test_a_plan_without_a_groups_devices_evicts_that_group_whatever_micro_batches_it_gives_the_rest() -> None:
    assert evicted_groups(_replicas([0, 2], microbatches=3), _running(), GROUPS) == [1]
    assert evicted_groups(_replicas([2], microbatches=6), _running(), GROUPS) == [0, 1]


@pytest.mark.parametrize(("plan", "words"), [
    (_replicas([0, 3]), "no torchft replica group"),  # a device the job has no group on
    (_replicas([0, 1, 2], epoch=1), "nothing to evict"),
    (Plan(epoch=1, num_layers=6, pipelines=(PipelinePlan(replica=0, microbatches=6, stages=(  # one pipeline, two groups
        StagePlan(devices=(0,), first_layer=0, end_layer=3), StagePlan(devices=(2,), first_layer=3, end_layer=6))),)),
     "no torchft replica group"),
])
def test_anything_but_whole_groups_left_out_is_refused_with_the_rule_it_breaks(plan: Plan, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        evicted_groups(plan, _running(), GROUPS)


def test_a_group_comes_back_by_its_probation_not_by_command() -> None:
    without_1 = _replicas([0, 2], epoch=1)
    with pytest.raises(ValueError, match="brings back group"):
        evicted_groups(_replicas([1, 2], epoch=2), without_1, GROUPS)


def test_the_lighthouse_needs_a_strict_majority_of_the_live_groups_to_stay() -> None:
    assert eviction_refusal(live_groups=3, evicted=1, min_replicas=1) is None
    assert "split brain" in (eviction_refusal(live_groups=2, evicted=1, min_replicas=1) or "")
    assert "split brain" in (eviction_refusal(live_groups=3, evicted=2, min_replicas=1) or "")
    assert "min_replicas 3" in (eviction_refusal(live_groups=5, evicted=3, min_replicas=3) or "")


def test_the_planner_answers_a_slow_group_of_a_torchft_job_with_an_eviction_it_can_run() -> None:
    """What the engine proposes within the declared capabilities is one the executor reads as an
    eviction of the slow group (the planner keeps the global batch in its plan; torchft does not)."""
    current = _running()
    model = PlannerModel(num_layers=6, layer_state_bytes=2**20, tokens_per_microbatch=256.0,
                         linear_s_per_token=1e-5, overhead_s=1e-4, grad_bytes_per_layer=2**18)
    cluster = ClusterState(3, hardware=Hardware(devices_per_node=3)).with_device(1, DeviceState(compute_factor=3.0))
    options, _ = fit_options(PlannerOptions(), TORCHFT_CAPABILITIES)
    result = Planner(model, options).plan(cluster, current)
    assert result.changed
    assert evicted_groups(result.plan, current, GROUPS) == [1]


# ---- the records ---------------------------------------------------------------------------------------


def test_orders_and_progress_round_trip_and_bad_bodies_are_refused_by_name() -> None:
    order = StandingOrder(serial=4, epoch=2, out=False, replica=1, replicas=2, command="cmd")
    assert StandingOrder.parse(order.to_json()) == order
    assert StandingOrder.from_ints(order.as_ints()) == StandingOrder(4, 2, False, 1, 2)
    with pytest.raises(ValueError, match="replica 2 of 2"):
        StandingOrder.parse({**order.to_json(), "replica": 2})
    with pytest.raises(ValueError, match="standing order is"):
        StandingOrder.parse({**order.to_json(), "out": "yes"})
    progress = GroupProgress(step=7, ft_step=7, quorum_id=3, participants=2, committed=True, at_s=1.5)
    assert GroupProgress.parse(progress.to_json()) == progress
    with pytest.raises(ValueError, match="group progress is"):
        GroupProgress.parse({**progress.to_json(), "committed": 1})


def test_probation_doubles_for_a_group_evicted_again_up_to_its_cap() -> None:
    probation = Probation(first_s=10.0, max_s=30.0)
    assert [probation.seconds(n) for n in range(4)] == [10.0, 20.0, 30.0, 30.0]
    with pytest.raises(ValueError, match="need 0 < first <= max"):
        Probation(first_s=0.0)


# ---- the executor -------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _control(path: Path) -> list:
    with EmbeddedBus(path) as bus:
        stream = EventStream(bus, "test", [topics.CONTROL, topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps})
        out = []
        while batch := stream.poll(timeout_s=0.2):
            out += [d.event.payload for d in batch]
        stream.close()
    return out


class _Telemetry:
    def __init__(self) -> None:
        self.published: list = []

    def publish(self, payload: object) -> None:
        self.published.append(payload)


def _watch_until(executor: TorchftEviction, done: object, tries: int = 50) -> None:
    for _ in range(tries):
        executor.watch()
        if done():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("the executor did not get there")


def test_the_executor_evicts_a_group_on_command_and_takes_it_back_after_its_probation(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    scope = "torchft-test"
    stores = [dist.HashStore() for _ in GROUPS]
    supervisor = [SignedStore(s, scope, reader="agent:torchft") for s in stores]
    ranks = [SignedStore(s, scope, reader="rank-0", role=rank_role(load_keyring())) for s in stores]
    shape = JobShape(layout=TitanLayout(), devices=(0,), epoch=0, num_layers=6, microbatches=2,
                     samples_per_microbatch=1, tokens_per_microbatch=256, layer_state_bytes=2**20, model="llama3 debug")
    ranks[0].set(JOB_KEY, shape.to_json())
    clock, telemetry = _Clock(), _Telemetry()
    executor = TorchftEviction("job-ft", supervisor, GROUPS, LighthouseSpec(), lambda: EmbeddedBus(path),
                               telemetry, Probation(first_s=30.0), clock=clock)  # type: ignore[arg-type]
    try:
        executor.watch()
        assert executor.listener is not None
        run = executor.listener.run
        with EmbeddedBus(path) as bus:  # the engine's command: the planner's plan without device 1
            bus.publish([factory("job-ft", "remediation").make(new_command(_replicas([0, 2]), "p1", run=run))])

        def orders() -> list[StandingOrder | None]:
            return [r.read(ORDER_KEY, StandingOrder.parse) for r in supervisor]

        _watch_until(executor, lambda: executor.flight is not None)
        out = orders()
        assert [(o.out, o.replica, o.replicas, o.epoch) for o in out if o] == [
            (False, 0, 2, 1), (True, 0, 2, 1), (False, 1, 2, 1)]

        # group 1 stops after step 10; the others commit step 11 in a quorum of two
        ranks[1].set(LEFT_KEY, {"epoch": 1, "step": 10})
        for g in (0, 2):
            ranks[g].set(PROGRESS_KEY, GroupProgress(11, 11, 2, 2, True, 0.0).to_json())
        clock.now += 4.0
        _watch_until(executor, lambda: executor.flight is None)
        control = _control(path)
        (ack,) = [e for e in control if isinstance(e, CommandAck)]
        assert ack.status is AckStatus.APPLIED and ack.pause_s == pytest.approx(4.0)
        assert "group(s) [1] left" in ack.detail
        assert [e.plan.devices for e in control if isinstance(e, PlanCurrent)][-1] == [0, 2]
        assert [e.executor for e in control if isinstance(e, ExecutorCapabilities)] == ["torchft"]
        assert [p.phase for p in telemetry.published if isinstance(p, ReshapePhase)] == ["agree", "first_step"]

        # a second eviction now would leave one of two live groups: refused, the quorum untouched
        with EmbeddedBus(path) as bus:
            bus.publish([factory("job-ft", "remediation").make(new_command(_replicas([2], epoch=2), "p2", run=run))])
        _watch_until(executor, lambda: any(isinstance(e, CommandAck) and e.status is AckStatus.FAILED
                                           for e in _control(path)))
        refused = [e for e in _control(path) if isinstance(e, CommandAck) and e.status is AckStatus.FAILED]
        assert "split brain" in refused[0].detail

        # the probation ends: group 1 is told to come back as replica 1 of 3; once it has committed
        # a step back in (healed from a peer), the full plan is announced again
        clock.now += 29.0
        executor.watch()
        assert orders()[1] is not None and orders()[1].out  # type: ignore[union-attr]
        clock.now += 2.0
        executor.watch()
        assert [(o.out, o.replica, o.replicas) for o in orders() if o] == [(False, 0, 3), (False, 1, 3), (False, 2, 3)]
        ranks[1].set(JOINED_KEY, {"epoch": 1, "step": 24})
        _watch_until(executor, lambda: not executor.out)
        assert [e.plan.devices for e in _control(path) if isinstance(e, PlanCurrent)][-1] == [0, 1, 2]
        assert [p.phase for p in telemetry.published if isinstance(p, ReshapePhase)][-1] == "redistribute"
    finally:
        executor.close()
