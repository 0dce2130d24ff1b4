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

Before the fence, an order must be for this run and still fresh (:func:`order_refusal`): a signed
command copied from another run of the same job name, or one kept and republished long after it
was issued, verifies like the day it was signed, so the signature alone cannot stop it. Each
command names the run incarnation it is for (the executor announces it in ``plan.current``:
:func:`new_run`) and an expiry (its issue time + :data:`COMMAND_TTL_S`, at most
:data:`COMMAND_TTL_MAX_S`). An executor refuses one without either, for another run, or past its
expiry by more than :data:`CLOCK_SKEW_S`, and reports it (``control.rejected``): such a command is
history, not an order, so it gets no acknowledgement. The simulator judges expiry on its
simulated clock, every other executor on its host's clock.

The fence's memory outlives the process: a listener restarted for the same run rebuilds it from
its own acknowledgements on the log (:meth:`EpochFence.recall`), so it never obeys an epoch it
already applied, or an older one, or a command id it already answered.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from collector.events import AckStatus, CommandAck, NodeCommand, PlanCurrent, ReconfigureCommand
from collector.plan import Plan

COMMAND_TTL_S = 600.0  # a command is obeyed within 10 minutes of its issue, or never
COMMAND_TTL_MAX_S = 3600.0  # no writer may ask for longer: a longer expiry is refused as if absent
CLOCK_SKEW_S = 60.0  # how far an executor's clock may trail the issuer's before a fresh command reads as expired
_RUN_CHARS = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def new_run() -> str:
    """A fresh run incarnation: 128 random bits, so no earlier run's orders can name it."""
    return uuid.uuid4().hex


def run_of(name: str) -> str:
    """The run id of a run known by a name (a node agent's ``--rdzv-id``): the name itself when it fits
    a run id, else a digest of it, so the agent and ``resihp node`` derive the same one."""
    return name if _RUN_CHARS.fullmatch(name) else "h" + hashlib.sha256(name.encode()).hexdigest()[:32]


def order_refusal(order: ReconfigureCommand | NodeCommand, run: str, issued_s: float, now_s: float) -> str | None:
    """Why an executor of ``run`` whose clock reads ``now_s`` must not obey ``order`` issued (its
    envelope's time) at ``issued_s``; None when it may. The fence comes after this."""
    what = f"{order.KIND} {order.command_id}"
    if order.run is None:
        return (f"{what} names no run (written before commands named one, or by an old writer); it cannot be told "
                f"from a replay of another run: issue it again for run {run}")
    if order.run != run:
        return f"{what} is for run {order.run}, but this executor runs {run}: a command of another run is history"
    if order.expires_at_s is None:
        return f"{what} carries no expiry; issue it again (commands are obeyed within {COMMAND_TTL_S:g} s)"
    if order.expires_at_s - issued_s > COMMAND_TTL_MAX_S:
        return (f"{what} asks to stay valid {order.expires_at_s - issued_s:,.0f} s after its issue; at most "
                f"{COMMAND_TTL_MAX_S:g} s is obeyed")
    if now_s > order.expires_at_s + CLOCK_SKEW_S:
        return (f"{what} expired {now_s - order.expires_at_s:,.0f} s ago (at {order.expires_at_s:.0f}, allowing "
                f"{CLOCK_SKEW_S:g} s of clock skew); issue it again if it still applies")
    return None


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
    if command.round < running_round:
        return AckStatus.IGNORED_STALE, (f"decided in rendezvous round {command.round}, but the job re-formed since "
                                         f"(round {running_round}) and may number its nodes otherwise; decide again")
    if command.round > running_round:
        return AckStatus.IGNORED_STALE, (f"names rendezvous round {command.round}, but the job is in round "
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

    def recall(self, payload: CommandAck | PlanCurrent, run: str) -> None:
        """Fold one of this executor's own earlier events of ``run`` (read back from the log after
        a restart, signature already checked): an answered command id is seen, and the fence never
        goes below an epoch the run applied or announced. Events of other runs change nothing."""
        if payload.run != run:
            return
        if isinstance(payload, CommandAck):
            self.seen.add(payload.command_id)
            if payload.status == AckStatus.APPLIED:
                self.running_epoch = max(self.running_epoch, payload.running_epoch)
        else:
            self.running_epoch = max(self.running_epoch, payload.plan.epoch)

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


__all__ = ["fence_verdict", "node_fence_verdict", "order_refusal", "new_run", "run_of", "EpochFence",
           "COMMAND_TTL_S", "COMMAND_TTL_MAX_S", "CLOCK_SKEW_S"]
