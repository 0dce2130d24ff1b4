"""The executor: reshapes a running rank to the next plan epoch, as a sequence of protocol steps.

Read it the way torchft's manager reads: one class, one method per step, each saying what can fail.
The launcher's ``CommandIntake`` (trainer/reference/intake.py) has already fenced the command — only epoch
e+1 on top of e reaches the ranks — and posted the plan and the live world into the TCPStore as a
numbered post (trainer/reference/rendezvous.py).

    reshape(P):    agree → export → rebuild (the world) → restore (state, then the stage's groups) → resume
                   agree → rebalance → resume     (only micro-batch counts change: arrival barrier, groups kept)
                   (a failure past agree: back to the running epoch, await_plan → reshape)
    recover(exc):  await_plan → reshape(P)              (after a collective failed: a peer died)

``restore_state`` pulls every shard from live peers when some replica still holds each unit;
when none does (``units_without_live_copy``), every rank loads the newest disk checkpoint of the
run instead and the iteration rolls back to it (``restore_from_disk``). If the launcher aborts a
post while the ranks wait to rendezvous (a device of its world died), the ranks keep their state
and wait for the next post. Past that point (everyone arrived) an abort no longer reaches them; a
death in the c10d rendezvous, the transfer or the new groups fails a collective instead, and each
rank goes back to the running epoch's state — still whole in memory — and waits for the next post
the same way.

Process groups: the default group is re-created for every epoch over the live processes (a
``PrefixStore`` of ``pg/<epoch>/`` on the launcher's store gives each epoch a fresh rendezvous), so
a dead rank simply is not in the next world. ``shrink_group`` and DTensor redistribution do not
work on gloo; re-initialising is one mechanism for both a planned reshape and a failure. Training
groups (the commit group, TP groups, DP buckets) are ``new_group`` s with the short collective
timeout; the default group keeps the long rendezvous timeout so a survivor that only notices the
failure at its collective timeout still finds the others waiting for it.
"""

from __future__ import annotations

import logging
import math
import time

import torch.distributed as dist

from trainer.reference.checkpoint import latest_checkpoint, load_checkpoint
from trainer.reference.chunks import role_chunks
from trainer.reference.parallel import Groups, PlanWorld, keeps_groups
from trainer.reference.rendezvous import (GROUPS_KEPT, Post, PostAborted, PostRefused, await_arrivals, done_key, failed_key,
                                newest_post, read_post)
from trainer.agent.wake import wait
from trainer.protocol import Released, ReshapeExecutor, ReshapeFailed
from trainer.reference.state import NoLiveSource, ShardState, export_state, transfer_live, units_without_live_copy

log = logging.getLogger("resihp.trainer")


class Executor(ReshapeExecutor):
    """Owns the reconfiguration protocol (trainer/protocol.py) of one rank (``trainer`` is its worker.Trainer)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.recent_walls_s: list[float] = []
        self.failure_wait_s = 0.0
        self.lost_iterations = 0
        # Groups of a world left after a failure, kept for the process's life: a survivor woken by
        # the loss count (trainer/agent/wake.py) left its collective pending on them, and dropping
        # a gloo group joins its threads, so the next step would wait out that collective's timeout.
        self.abandoned: list[tuple[Groups, dist.ProcessGroup]] = []
        self._failed = False

    # ---- the steps -------------------------------------------------------------------------------

    def agree(self, number: int) -> Post:
        """Read post ``number``, which every rank agreed on (the commit all-reduce, or the store's
        newest post after a failure). Fails if its epoch is not the running epoch + 1: the intake
        never posts such a plan, so seeing one means two launchers share a store."""
        post = read_post(self.trainer.records, number)
        running = self.trainer.epoch()
        if post.plan.epoch != running + 1:
            raise ReshapeFailed(f"post {number} moves from epoch {running} to {post.plan.epoch}; "
                                "only e+1 is applied on top of e")
        return post

    def rebalance(self, post: Post) -> None:
        """The post only moves micro-batches between replicas (``keeps_groups``): wait at the
        arrival barrier (``PostAborted`` if a device of the world died first, as in
        :meth:`rebuild`), then switch the running role to its plan. No rendezvous and no
        transfer: the groups, the stages and their optimizer state stay as they are."""
        t = self.trainer
        t.faults.begin_reshape(t.iteration)
        await_arrivals(t.records, post.number, post.world, t.device, t.spec.rendezvous_timeout_s)
        t.current = t.reassign(PlanWorld(post.plan, post.world))

    def export(self) -> ShardState | None:
        """This device's shards of parameters and optimizer state under the running plan (from
        memory; cannot fail short of a bug). None for a device without a role."""
        cur = self.trainer.current
        if cur is None or cur.work is None:
            return None
        return export_state(cur.work.stage, cur.work.opt)

    def rebuild(self, post: Post) -> PlanWorld:
        """Wait for the post's whole world, then destroy the old default group and rendezvous a new one.

        ``PostAborted`` if the launcher gives up on the post first (a device of the world died);
        a collective error or timeout if a device dies after everyone arrived; ``Released`` if
        this device is not in the world."""
        if self.trainer.device in post.world:
            self.trainer.faults.begin_reshape(self.trainer.iteration)
        layout = self.trainer.join_world(post)
        if layout is None:
            raise Released(f"device {self.trainer.device} is not in the world of post {post.number}")
        return layout

    def restore(self, old, layout: PlanWorld, mine: ShardState | None) -> str:
        """This device's state under the new plan, loaded into its new stage (:meth:`rebuild_groups`:
        the stage is built with its state); returns where the state came from ("live", or the checkpoint).

        From live holders when every unit still has one (see trainer/reference/state.py; a sender that dies
        mid-way fails the receive, see :meth:`reshape`), else from disk (:meth:`restore_from_disk`).
        Every rank takes the same branch: the choice is a pure function of the two plans and the world."""
        self.trainer.faults.begin_transfer(self.trainer.iteration)
        missing = units_without_live_copy(old, layout)
        if missing:
            state, source = self.restore_from_disk(layout, missing)
        else:
            state, source = transfer_live(self.trainer.cfg, old, layout, self.trainer.device, mine), "live"
        self.rebuild_groups(layout, state)
        return source

    def restore_from_disk(self, layout: PlanWorld, missing: list[str]) -> tuple[ShardState | None, str]:
        """No replica kept a live copy of ``missing``: load the newest checkpoint of this run (or
        its --resume-dir) on every rank and roll the iteration back to it. World rank 0 picks the
        checkpoint and tells the others, so all load the same one. ``NoLiveSource`` when there is
        no checkpoint to fall back to."""
        t = self.trainer
        found = latest_checkpoint(t.spec.save_dir, t.spec.resume_dir, t.spec.run_id)
        choice = [None if found is None else (str(found[0]), found[1])]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            raise NoLiveSource(f"no live copy of {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''} survives "
                               "and there is no disk checkpoint to fall back to; run with --save-dir DIR "
                               "--checkpoint-every K")
        directory, iteration = choice[0]
        self.lost_iterations += max(0, t.iteration - iteration)
        log.warning("device %d: no live copy of %s; rolling back from iteration %d to checkpoint %s",
                    t.device, missing, t.iteration, directory)
        t.iteration = iteration
        state = None
        role = layout.plan.roles.get(t.device)
        if role is not None:
            state, _ = load_checkpoint(directory, t.cfg, role_chunks(layout.plan, role), role.tp_degree, role.tp_rank)
        return state, f"disk checkpoint {directory} (iteration {iteration})"

    def rebuild_groups(self, layout: PlanWorld, state: ShardState | None) -> None:
        """Create the epoch's training groups, build this device's stage (TP, PP, DP steps) and
        load the restored state into it and its optimizer."""
        old = self.trainer.current
        if self._failed and old is not None:
            self.abandoned.append((old.groups, old.train_group))
            self._failed = False
        self.trainer.current = self.trainer.build(layout, state if self.trainer.device in layout.plan.roles else None)

    def resume(self, number: int, pause_s: float, source: str) -> None:
        """Barrier over the new world, then report ``done/<post>/<device>`` with the pause and the
        state's source. After the barrier every rank trains under the new epoch."""
        wait(dist.barrier(group=self.trainer.current.train_group, async_op=True), "barrier (resume)")
        self.trainer.post = number
        wall = sum(self.recent_walls_s[-5:]) / max(1, len(self.recent_walls_s[-5:])) if self.recent_walls_s else 0.0
        iterations = (math.ceil(pause_s / wall) if wall > 0 else 0) + self.lost_iterations
        self.trainer.records.set(done_key(number, self.trainer.device), {
            "pause_s": pause_s, "pause_iterations": iterations, "failure_wait_s": self.failure_wait_s,
            "iteration": self.trainer.iteration, "source": source})
        self.failure_wait_s, self.lost_iterations = 0.0, 0

    # ---- the protocols -----------------------------------------------------------------------------

    def reshape(self, number: int) -> None:
        """Move to the plan of post ``number`` at this iteration boundary.

        If the launcher aborts the post while the world gathers, keep the state and take the next
        post. If a collective fails once this rank left the old world (a device of the new one died
        in the c10d rendezvous, during the transfer or while the groups formed: no abort reaches
        ranks past the arrival barrier, they find out from a dead socket or a group that never
        forms), report it, go back to the running epoch's state — every rank still holds what it
        exported, nothing was stepped — and reshape onto the next post, as after any failed
        collective. Any other failure is reported and re-raised."""
        start = time.perf_counter()
        previous, iteration, lost = self.trainer.current, self.trainer.iteration, self.lost_iterations
        switching = False  # from here on a collective failure sends this rank back to wait
        try:
            old = previous.layout.plan
            post = self.agree(number)
            if keeps_groups(previous.layout, post.plan, post.world):
                switching = True
                self.rebalance(post)
                source = GROUPS_KEPT
            else:
                mine = self.export()
                switching = True
                layout = self.rebuild(post)
                source = self.restore(old, layout, mine)
            self.resume(number, time.perf_counter() - start, source)
        except Released:
            raise
        except PostAborted as exc:
            if isinstance(exc, PostRefused):  # a stranger's post: the launcher learns why nobody takes it
                self.trainer.records.set(failed_key(number, self.trainer.device), str(exc)[:1000])
            log.warning("device %d: %s; waiting for the next plan", self.trainer.device, exc)
            self._wait_and_reshape(number)
            return
        except Exception as exc:
            self.trainer.records.set(failed_key(number, self.trainer.device), f"{type(exc).__name__}: {exc}"[:1000])
            failed_collective = isinstance(exc, RuntimeError | dist.DistError)  # a peer died or timed out
            hopeless = isinstance(exc, NoLiveSource | ReshapeFailed)  # would fail on any world
            if not switching or not failed_collective or hopeless:
                raise
            log.warning("device %d: the world of post %d failed mid-reshape (%s); back to epoch %d, waiting for "
                        "the next plan", self.trainer.device, number, str(exc).splitlines()[0][:200], old.epoch)
            failed_world = self.trainer.current
            if failed_world is not previous and failed_world is not None:  # its collectives may be pending
                self.abandoned.append((failed_world.groups, failed_world.train_group))
            self.trainer.current, self.trainer.iteration, self.lost_iterations = previous, iteration, lost
            self._failed = True  # the running epoch's groups too: the failure may have left work on them
            self._wait_and_reshape(number)
            return
        plan = self.trainer.current.layout.plan
        log.info("device %d: now at epoch %d (%s)", self.trainer.device, plan.epoch, plan.shape())

    def _wait_and_reshape(self, number: int) -> None:
        """Post ``number`` will not complete: wait for a newer one (counted as failure wait) and
        reshape onto it."""
        waited_from = time.perf_counter()
        following = self.await_plan(after=number)
        self.failure_wait_s += time.perf_counter() - waited_from
        self.reshape(following)

    def await_plan(self, after: int) -> int:
        """Wait until the launcher posts a plan newer than post ``after`` (from a command on the
        bus, or its own on-death policy); returns its number. Fails after ``recovery_timeout_s``."""
        deadline = time.monotonic() + self.trainer.spec.recovery_timeout_s
        while time.monotonic() < deadline:
            newest = newest_post(self.trainer.records, after)
            if newest > after:
                return newest
            time.sleep(0.05)
        raise ReshapeFailed(f"no plan newer than epoch {self.trainer.epoch()} within "
                            f"{self.trainer.spec.recovery_timeout_s:.0f} s after a peer failed; publish a "
                            "ReconfigureCommand or run with --on-death drop-replica")

    def recover(self, exc: BaseException) -> None:
        """A collective raised (a peer died, or timed out). Nothing was stepped this iteration, so
        the state is the last committed one; wait for a plan and reshape onto it."""
        log.warning("device %d: iteration %d failed (%s); waiting for a new plan",
                    self.trainer.device, self.trainer.iteration, str(exc).splitlines()[0][:200])
        start = time.perf_counter()
        self._failed = True
        target = self.await_plan(after=self.trainer.post)
        self.failure_wait_s = time.perf_counter() - start
        self.lost_iterations = 1
        self.reshape(target)

    def note_iteration(self, wall_s: float) -> None:
        self.recent_walls_s.append(wall_s)
        del self.recent_walls_s[:-20]
