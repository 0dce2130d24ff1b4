"""The executor protocol: how an executor moves a running job from plan epoch e to e+1.

Every executor that obeys ``command.reconfigure`` implements :class:`ReshapeExecutor` — the
reference trainer's (trainer/reference/executor.py: hand-made TP/PP/DP, plans posted in the
launcher's store) and the PyTorch-native one (trainer/native/executor.py: DeviceMesh, DTensor,
FSDP2, DCP). Read it as torchft's ``Manager`` reads: one class per executor, one method per step,
each saying what can fail::

    agree    every rank of the running world settles on the same next plan (epoch e+1 on top of e);
             a plan the executor cannot run is refused here, before anything stops: ReshapeRefused
    export   this rank's shards of parameters and optimizer state, taken from the running stage
             (memory only; cannot fail short of a bug)
    rebuild  the new world's process groups (or mesh) and this device's stage; Released when this
             device is not in the new world
    restore  the new stage's state from live peers, or from the newest checkpoint when some unit has
             no live copy left (the iteration then rolls back to it)
    resume   commit: every rank of the new world trains under the new epoch and reports its pause

A plan that only moves micro-batches between replicas (``Plan.same_stages``) stops after agree:
groups, stages and optimizer state are kept. A failure past agree leaves every rank at the running
epoch (its state is still whole in memory) and is ``ReshapeFailed``; ``recover`` is the same steps
after a peer died in a training collective, with the survivors' quorum as agree.

The intake → acknowledgement path is the same for every executor: one reader per job (the
launcher, never the ranks) admits only signed commands of its run (collector/auth.py,
collector/epoch_fence.py's ``order_refusal``), fences them by epoch (``fence_verdict``), judges the
plan against what the executor can run before any rank sees it, posts one reshape at a time, and
acknowledges each command once with :func:`acknowledgement`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from collector.events import AckStatus, CommandAck, ReconfigureCommand

STEPS = ("agree", "export", "rebuild", "restore", "resume")


class Released(Exception):
    """This device is not in the next plan's world (the plan or the launcher counted it out): exit cleanly."""


class ReshapeRefused(RuntimeError):
    """The plan was refused at agree, before anything stopped; training goes on at the running epoch."""


class ReshapeFailed(ReshapeRefused):
    """A step past agree failed (or no plan came to recover onto); the rank is back at the running epoch,
    or, where there is none to go back to, the failure is the job's."""


class ReshapeExecutor(ABC):
    """One rank's side of the reconfiguration protocol. Each executor names its own orders, layouts
    and state (a post number or a plan; a ``PlanWorld`` or a ``NativeLayout``), so the steps' arguments are
    the executor's; the step names, their order, what each may raise and the acknowledgement are
    shared."""

    @abstractmethod
    def agree(self, *args: Any, **kwargs: Any) -> Any:
        """The layout every rank moves to, or ``ReshapeRefused`` with nothing stopped."""

    @abstractmethod
    def export(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's shards of the running stage's state (None: it holds none)."""

    @abstractmethod
    def rebuild(self, *args: Any, **kwargs: Any) -> Any:
        """The new world's groups and this device's stage; ``Released`` when it has no place there."""

    @abstractmethod
    def restore(self, *args: Any, **kwargs: Any) -> Any:
        """The new stage's state from live peers, else from the newest checkpoint; says which."""

    @abstractmethod
    def resume(self, *args: Any, **kwargs: Any) -> Any:
        """Commit the new epoch on every rank of its world and report the pause."""

    @abstractmethod
    def reshape(self, *args: Any, **kwargs: Any) -> Any:
        """agree → export → rebuild → restore → resume at an iteration boundary, on command."""

    @abstractmethod
    def recover(self, *args: Any, **kwargs: Any) -> Any:
        """The same steps after a peer died in a training collective."""


def acknowledgement(command: ReconfigureCommand, status: AckStatus, detail: str, *, running_epoch: int, run: str,
                    pause_s: float = 0.0, pause_iterations: int = 0) -> CommandAck:
    """The one ``command.ack`` an executor's intake publishes for ``command``: bound to the command,
    its plan and the intake's run, with the epoch running after it and what the reshape cost."""
    return CommandAck(command_id=command.command_id, plan_id=command.plan_id, epoch=command.plan.epoch,
                      status=status, running_epoch=running_epoch, pause_s=pause_s,
                      pause_iterations=pause_iterations, detail=detail, run=run)


def store_key(what: str, *numbers: int) -> str:
    """A protocol's key in the launcher's store: what it holds, then the post's number (and the
    device's, for one device's answer), slash-separated: ``done/3/5``. Every key of the reference executor's
    posts (trainer/reference/rendezvous.py) and of the native executor's (trainer/native/intake.py) is made here."""
    return "/".join((what, *map(str, numbers)))


__all__ = ["STEPS", "Released", "ReshapeExecutor", "ReshapeFailed", "ReshapeRefused", "acknowledgement", "store_key"]
