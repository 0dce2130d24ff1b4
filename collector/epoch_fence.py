"""The contract's command fence: epoch e+1 applies only on top of e, each command id once.

Every executor (the integration API's listener, the torch launcher's intake, the cluster
simulator) judges a ``command.reconfigure`` with ``fence_verdict`` before its own checks, so the
acknowledgement statuses and their details read the same whichever executor ran the job:

- a command id seen before is ``ignored_duplicate``;
- an epoch not newer than the running one is ``ignored_stale`` ("not newer");
- an epoch past running + 1 is ``ignored_stale`` too ("skips epochs": re-plan from the running
  epoch, since the plan in between was never applied here);
- anything else passes the fence (the executor may still fail a plan it cannot run).

A node agent's ``command.node`` (``node_fence_verdict``) is fenced by the job's rendezvous round
instead: node numbers hold within one round, so a command decided in another round is
``ignored_stale`` whichever way it is off, and a command id seen before is ``ignored_duplicate``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from collector.events import AckStatus, NodeCommand, ReconfigureCommand
from collector.plan import Plan


def fence_verdict(command: ReconfigureCommand, running_epoch: int,
                  seen: Collection[str]) -> tuple[AckStatus | None, str]:
    """(None, "") when ``command`` may apply on top of ``running_epoch``; else its status and why.

    Pure: it does not mark the command seen (the caller does once it has acted on the verdict,
    so a command kept queued can be judged again)."""
    epoch = command.plan.epoch
    if command.command_id in seen:
        return _duplicate(command.command_id)
    if epoch <= running_epoch:
        return AckStatus.IGNORED_STALE, f"epoch {epoch} is not newer than the running epoch {running_epoch}"
    if epoch > running_epoch + 1:
        return AckStatus.IGNORED_STALE, (f"epoch {epoch} skips epochs: only {running_epoch + 1} applies on top of "
                                         f"{running_epoch}; re-plan from the running epoch")
    return None, ""


def node_fence_verdict(command: NodeCommand, running_round: int,
                       seen: Collection[str]) -> tuple[AckStatus | None, str]:
    """(None, "") when a node command may be obeyed in rendezvous round ``running_round``; else
    its status and why. Pure, like :func:`fence_verdict`."""
    if command.command_id in seen:
        return _duplicate(command.command_id)
    if command.epoch < running_round:
        return AckStatus.IGNORED_STALE, (f"decided in rendezvous round {command.epoch}, but the job re-formed since "
                                         f"(round {running_round}) and may number its nodes otherwise; decide again")
    if command.epoch > running_round:
        return AckStatus.IGNORED_STALE, (f"names rendezvous round {command.epoch}, but the job is in round "
                                         f"{running_round}; give the round the agents print")
    return None, ""


def _duplicate(command_id: str) -> tuple[AckStatus, str]:
    return AckStatus.IGNORED_DUPLICATE, f"command {command_id} was already handled"


@dataclass
class EpochFence:
    """The fence with its memory of command ids. ``check`` is an optional extra judge
    (plan → reason it cannot run, or None) whose reason fails the command."""

    running_epoch: int
    check: Callable[[Plan], str | None] | None = None
    seen: set[str] = field(default_factory=set)

    def judge(self, command: ReconfigureCommand) -> tuple[AckStatus | None, str]:
        """(None, "") when the command should be applied; else its status and why. Marks it seen."""
        status, detail = fence_verdict(command, self.running_epoch, self.seen)
        self.seen.add(command.command_id)
        if status is not None:
            return status, detail
        reason = self.check(command.plan) if self.check is not None else None
        if reason:
            return AckStatus.FAILED, reason
        return None, ""


__all__ = ["fence_verdict", "node_fence_verdict", "EpochFence"]
