"""The launcher's half of the native command intake: when a posted reshape is acknowledged.

A unit test of its logic over a real in-memory store, with a recording stand-in for the
bus listener: the ranks' store keys are written by hand in the orders a run can produce.
"""

from __future__ import annotations

import time
import uuid

import torch.distributed as dist

from collector.events import ReconfigureCommand
from collector.plan import Plan
from trainer.native.intake import NativeCommandIntake, done_key, released_key

DONE = '{"epoch": 1, "source": "live", "phases_s": {"export": 0.1, "first_step": 0.2}}'


class _Listener:
    """Records acknowledgements; runs ``running``."""

    def __init__(self, running: Plan) -> None:
        self.running = running
        self.acks: list[tuple[str, str]] = []

    def ack_failed(self, command: ReconfigureCommand, why: str) -> None:
        self.acks.append(("failed", why))

    def ack_applied(self, command: ReconfigureCommand, pause_s: float, detail: str) -> None:
        self.acks.append(("applied", detail))


def _intake(running: Plan, new: Plan) -> tuple[NativeCommandIntake, dist.Store, tuple[int, ReconfigureCommand]]:
    """An intake with post 1 (running → ``new``) posted, as the launcher leaves it."""
    intake = object.__new__(NativeCommandIntake)
    intake.store = dist.HashStore()
    intake.listener = _Listener(running)  # type: ignore[assignment]
    command = ReconfigureCommand(command_id=uuid.uuid4().hex, plan_id="plan-1", plan=new, run="test",
                                 expires_at_s=time.time() + 60)
    intake.posted = (1, command)
    return intake, intake.store, intake.posted


RUNNING = Plan.uniform(tp=1, pp=1, dp=2, num_layers=2, microbatches_per_replica=2)
SHRUNK = Plan.uniform(tp=1, pp=1, dp=1, num_layers=2, microbatches_per_replica=4, epoch=1)  # drops device 1


def test_a_dropped_device_that_left_after_the_commit_does_not_fail_the_reshape() -> None:
    intake, store, posted = _intake(RUNNING, SHRUNK)
    store.set(released_key(1, 1), "1")
    intake._check_posted(posted, alive={0})  # device 1 exited; device 0 has not stepped yet
    assert intake.listener.acks == []
    assert intake.posted is posted
    store.set(done_key(1, 0), DONE)
    intake._check_posted(posted, alive={0})
    assert [kind for kind, _ in intake.listener.acks] == ["applied"]
    assert intake.posted is None


def test_a_dropped_device_that_exited_without_its_release_is_a_death() -> None:
    intake, _, posted = _intake(RUNNING, SHRUNK)
    intake._check_posted(posted, alive={0})
    [(kind, why)] = intake.listener.acks
    assert kind == "failed" and "devices [1] exited" in why


def test_a_device_of_the_new_world_that_exits_is_a_death_even_if_it_wrote_a_release() -> None:
    intake, store, posted = _intake(RUNNING, SHRUNK)
    store.set(released_key(1, 0), "1")  # no such record can excuse a device the plan keeps
    intake._check_posted(posted, alive={1})
    [(kind, why)] = intake.listener.acks
    assert kind == "failed" and "devices [0] exited" in why
