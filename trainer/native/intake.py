"""Native command intake: bus commands in, one reshape at a time through the ranks, acknowledgements out.

Two halves over the launcher's TCPStore, like the reference trainer's (trainer/reference/intake.py):

* :class:`NativeCommandIntake` (the launcher, the job's one reader of the control topic). At start
  it announces what runs (``plan.current``) and what this executor can run (``plan.capabilities``,
  trainer/native/capabilities.py), both signed as the executor. It reads ``command.reconfigure``
  through the integration API's :class:`~trainer.integration.CommandListener` — the same signature
  gate and epoch fence (collector/epoch_fence.py) as every executor, so an unsigned command is a
  ``control.rejected`` and a stale or duplicate one an ``ignored_*`` ack. A plan this executor
  cannot run (``refusal``: the declaration's rules and the mesh's) is acknowledged ``failed`` with
  the reason **before any rank sees it**. A plan that passes is posted (``native/cmd/plan/N``,
  then the counter ``native/cmd/posts``) and acknowledged once every device of its world has
  taken its first step on it, with the largest pause and each phase of the reshape; ``failed``
  when a rank refused it at ``agree`` (it still trains at the old layout) or died.
* :class:`CommandFollower` (every rank, at each iteration boundary). One all-reduce (MAX) of the
  newest post each rank has read makes the whole world pick the same post at the same boundary,
  whatever instant the launcher wrote it: a rank that read it late learns of it from a peer.
  The rank then reshapes through :class:`~trainer.native.executor.NativeExecutor` and reports
  ``done`` (the phases) or ``refused`` (why) under the post's number; a device the plan drops
  writes ``released`` as it leaves after the commit, so its exit before the new world's first
  step is not read as a death.

What can go wrong: a rank that dies mid-reshape leaves the post without its report, and the
survivors refuse it (they recover from the running layout without the dead rank); the launcher
acks ``failed`` on the first refusal, or once the process has exited. A rank that dies while training is recovered from
by the survivors (trainer/native/recovery.py) without a command: the new world's first rank
writes their plan (``native/cmd/recovered``) and the launcher adopts it as the running plan
(``CommandListener.adopt``: the fence moves to its epoch, ``plan.current`` is re-announced).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from collector.bus import Bus
from collector.events import ReconfigureCommand
from collector.plan import Plan
from trainer.integration import CommandListener
from trainer.native.capabilities import NATIVE_CAPABILITIES, refusal
from trainer.native.model import LlamaConfig
from trainer.protocol import store_key

log = logging.getLogger("resihp.trainer.native")

POSTS = "native/cmd/posts"
RECOVERED = "native/cmd/recovered"  # the plan the survivors of a lost rank run, by the new world's first rank


plan_key = functools.partial(store_key, "native/cmd/plan")  # (post): the plan of that post
done_key = functools.partial(store_key, "native/cmd/done")  # (post, device): the device runs it
refused_key = functools.partial(store_key, "native/cmd/refused")  # (post, device): why it cannot
released_key = functools.partial(store_key, "native/cmd/released")  # (post, device): it left after the commit


class NativeCommandIntake:
    """The launcher's half: fence, refuse what the executor cannot run, post, acknowledge."""

    def __init__(self, job: str, plan: Plan, cfg: LlamaConfig, store: dist.Store, bus: Bus | Callable[[], Bus],
                 tokens_per_microbatch: int = 0) -> None:
        self.store, self.cfg = store, cfg
        self.listener = CommandListener(job, plan, bus=bus, check=self._check)
        self.posts = 0
        self.posted: tuple[int, ReconfigureCommand] | None = None
        self.tokens_per_microbatch = tokens_per_microbatch
        store.set(POSTS, "0")

    def _check(self, plan: Plan) -> str | None:
        """The executor's own judgement, before any rank sees the plan (the fence ran first)."""
        reason = refusal(plan, self.cfg, running=self.listener.running)
        return None if reason is None else f"the native executor cannot run this plan: {reason}"

    def start(self) -> None:
        """Announce what runs and what this executor can run."""
        self.listener.announce_plan(model_name="native-llama", tokens_per_microbatch=self.tokens_per_microbatch)
        self.listener.announce_capabilities(NATIVE_CAPABILITIES)

    def poll(self, alive: set[int], timeout_s: float = 0.2) -> None:
        """One step: finish the posted reshape if its world reported, else post the next command."""
        command = self.listener.poll(timeout_s=timeout_s)  # the posted one again while it is unacknowledged
        self._adopt_recovered()
        if self.posted is not None:
            self._check_posted(self.posted, alive)
            return
        if command is not None:
            self.posts += 1
            self.store.set(plan_key(self.posts), command.plan.model_dump_json())
            self.store.set(POSTS, str(self.posts))
            self.posted = (self.posts, command)
            log.info("posted %s as epoch %d (post %d)", command.plan_id, command.plan.epoch, self.posts)

    def _check_posted(self, posted: tuple[int, ReconfigureCommand], alive: set[int]) -> None:
        post, command = posted
        world = command.plan.devices
        running = self.listener.running.devices
        refused = [d for d in running if self.store.check([refused_key(post, d)])]
        if refused:
            why = self.store.get(refused_key(post, refused[0])).decode()
            self.posted = None
            self.listener.ack_failed(command, f"refused by the ranks, still at epoch {self.listener.running.epoch}: {why}")
            return
        # A device the plan drops exits once the commit vote passed, which may be before the new
        # world's first step: its exit is a death only when it left no release record.
        leaving = [d for d in running if d not in world]
        released = {d for d in leaving if self.store.check([released_key(post, d)])}
        dead = sorted(d for d in set(world) | set(leaving) if d not in alive and d not in released)
        done = [d for d in world if self.store.check([done_key(post, d)])]
        if dead and len(done) < len(world):
            self.posted = None
            self.listener.ack_failed(command, f"devices {dead} exited before the reshape to epoch "
                                              f"{command.plan.epoch} finished")
            return
        if len(done) < len(world):
            return
        reports = [json.loads(self.store.get(done_key(post, d))) for d in world]
        pause_s = max(sum(r["phases_s"].values()) for r in reports)
        slowest = max(reports, key=lambda r: sum(r["phases_s"].values()))
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in slowest["phases_s"].items())
        self.posted = None
        self.listener.ack_applied(command, pause_s, detail=(
            f"now {command.plan.shape()} on devices {world}; state from {slowest['source']}; phases: {phases}"))

    def _adopt_recovered(self) -> None:
        """The ranks recovered from a lost one without a command: their plan is the running one."""
        if self.store.check([RECOVERED]):
            plan = Plan.model_validate_json(self.store.get(RECOVERED))
            if plan.epoch > self.listener.running.epoch:
                log.info("the survivors run epoch %d %s on devices %s", plan.epoch, plan.shape(), plan.devices)
                self.listener.adopt(plan)

    def finish(self) -> None:
        """The job ended: a reshape still posted was not applied; stop reading."""
        self._adopt_recovered()
        if self.posted is not None:
            _, command = self.posted
            self.posted = None
            self.listener.ack_failed(command, "the job ended before the reshape finished")
        self.listener.close()


class CommandFollower:
    """A rank's half: agree with the world on the newest post at each iteration boundary, report back."""

    def __init__(self, store: dist.Store, device: int, torch_device: torch.device) -> None:
        self.store, self.device, self.torch_device = store, device, torch_device
        self.applied = 0
        self.steps_since_reshape = 0

    def stepped(self) -> None:
        """An iteration ran on the running layout."""
        self.steps_since_reshape += 1

    def next_plan(self, world: dist.ProcessGroup | None = None) -> tuple[int, Plan] | None:
        """The post to apply now (the same on every rank of the running world), or None. A
        collective over the running world: every rank calls it at the same boundary. Like the
        reference trainer's intake, a layout runs one iteration before the next reshape (so the
        optimizer has state to move and every epoch reports telemetry)."""
        if self.steps_since_reshape == 0:
            return None
        seen = torch.tensor([int(self.store.get(POSTS))], dtype=torch.int64, device=self.torch_device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=world)  # the running world's group (groups.py)
        post = int(seen.item())
        if post <= self.applied:
            return None
        self.applied = post
        self.steps_since_reshape = 0
        return post, Plan.model_validate_json(self.store.get(plan_key(post)))

    def done(self, post: int, epoch: int, source: str, phases_s: dict[str, float]) -> None:
        self.store.set(done_key(post, self.device), json.dumps({"epoch": epoch, "source": source,
                                                                "phases_s": phases_s}))

    def recovered(self, plan: Plan) -> None:
        """The new world's first rank, after its first step past a recovery: tell the launcher."""
        self.store.set(RECOVERED, plan.model_dump_json())

    def refused(self, post: int, reason: str) -> None:
        self.store.set(refused_key(post, self.device), reason)

    def released(self, post: int) -> None:
        """This device has no place in the post's world and leaves after its commit vote passed
        (its pieces sent): the launcher must not read its exit as a death."""
        self.store.set(released_key(post, self.device), "1")


__all__ = ["NativeCommandIntake", "CommandFollower"]
