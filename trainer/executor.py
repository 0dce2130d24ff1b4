"""The executor: reshapes a running rank to the next plan epoch, as a sequence of protocol steps.

Read it the way torchft's manager reads: one class, one method per step, each saying what can fail.
The launcher's ``CommandIntake`` (trainer/intake.py) has already fenced the command — only epoch
e+1 on top of e reaches the ranks — and posted the plan and the live world into the TCPStore.

    reshape(e+1):  agree → export_state → rebuild_world → transfer_state → rebuild_groups → resume
    recover(exc):  await_plan → reshape(e+1)            (after a collective failed: a peer died)

Process groups: the default group is re-created for every epoch over the live processes (a
``PrefixStore`` of ``pg/<epoch>/`` on the launcher's store gives each epoch a fresh rendezvous), so
a dead rank simply is not in the next world. ``shrink_group`` and DTensor redistribution do not
work on gloo; re-initialising is one mechanism for both a planned reshape and a failure. Training
groups (the commit group, TP groups, DP buckets) are ``new_group`` s with the short collective
timeout; the default group keeps the long rendezvous timeout so a survivor that only notices the
failure at its collective timeout still finds the others waiting for it.
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch.distributed as dist

from collector.plan import Plan
from trainer.parallel import Layout
from trainer.state import ShardState, export_state, transfer_live

log = logging.getLogger("resihp.trainer")


class Released(Exception):
    """This device is not in the next epoch's world (the launcher counted it out): exit cleanly."""


class ReshapeFailed(RuntimeError):
    pass


class Executor:
    """Owns the reconfiguration protocol of one rank (``trainer`` is its worker.Trainer)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.recent_walls_s: list[float] = []
        self.failure_wait_s = 0.0
        self.lost_iterations = 0

    # ---- the steps -------------------------------------------------------------------------------

    def agree(self, target: int) -> Plan:
        """Read the plan of ``target`` every rank agreed on (the commit all-reduce, or the store's
        newest epoch after a failure). Fails if ``target`` is not the running epoch + 1: the intake
        never posts such a plan, so seeing one means two launchers share a store."""
        running = self.trainer.epoch()
        if target != running + 1:
            raise ReshapeFailed(f"asked to move from epoch {running} to {target}; only e+1 is applied on top of e")
        return Plan.model_validate_json(self.trainer.store.get(f"plan/{target}"))

    def export_state(self) -> ShardState | None:
        """This device's shards of parameters and optimizer state under the running plan (from
        memory; cannot fail short of a bug). None for a device without a role."""
        cur = self.trainer.current
        if cur is None or cur.stage is None:
            return None
        return export_state(cur.stage, cur.opt)

    def rebuild_world(self, target: int) -> Layout:
        """Destroy the old default group and rendezvous a new one over ``world/<target>``.

        Can fail by timeout if a device in the new world never arrives (it died after the launcher
        posted the world); raises ``Released`` if this device is not in the world."""
        layout = self.trainer.join_world(target)
        if layout is None:
            raise Released(f"device {self.trainer.device} is not in the world of epoch {target}")
        return layout

    def transfer_state(self, old: Plan, layout: Layout, mine: ShardState | None) -> ShardState:
        """Pull every shard this device owns under the new plan from live holders (see
        trainer/state.py). Fails with ``NoLiveSource`` when no replica kept a complete copy of some
        unit, and by timeout if a sender dies mid-way."""
        return transfer_live(self.trainer.cfg, old, layout, self.trainer.device, mine)

    def rebuild_groups(self, layout: Layout, state: ShardState) -> None:
        """Create the epoch's training groups, build this device's stage (TP, PP, DP steps) and
        load the transferred state into it and its optimizer."""
        self.trainer.current = self.trainer.build(layout, state if self.trainer.device in layout.plan.roles else None)

    def resume(self, target: int, pause_s: float) -> None:
        """Barrier over the new world, then report ``done/<epoch>/<device>`` with the pause.
        After the barrier every rank trains under the new epoch."""
        dist.barrier(group=self.trainer.current.train_group)
        wall = sum(self.recent_walls_s[-5:]) / max(1, len(self.recent_walls_s[-5:])) if self.recent_walls_s else 0.0
        iterations = (math.ceil(pause_s / wall) if wall > 0 else 0) + self.lost_iterations
        self.trainer.store.set(f"done/{target}/{self.trainer.device}", json.dumps({
            "pause_s": pause_s, "pause_iterations": iterations, "failure_wait_s": self.failure_wait_s,
            "iteration": self.trainer.iteration}))
        self.failure_wait_s, self.lost_iterations = 0.0, 0

    # ---- the protocols -----------------------------------------------------------------------------

    def reshape(self, target: int) -> None:
        """Move to epoch ``target`` at this iteration boundary. On failure, report it and re-raise."""
        start = time.perf_counter()
        try:
            old = self.trainer.current.layout.plan
            self.agree(target)
            mine = self.export_state()
            layout = self.rebuild_world(target)
            state = self.transfer_state(old, layout, mine)
            self.rebuild_groups(layout, state)
        except Released:
            raise
        except Exception as exc:
            self.trainer.store.set(f"failed/{target}/{self.trainer.device}", f"{type(exc).__name__}: {exc}")
            raise
        self.resume(target, time.perf_counter() - start)
        log.info("device %d: now at epoch %d (%s)", self.trainer.device, target, layout.plan.shape())

    def await_plan(self) -> int:
        """After a failed collective: wait until the launcher posts a newer epoch (from a command
        on the bus, or its own drop-replica policy). Fails after ``recovery_timeout_s``."""
        running = self.trainer.epoch()
        deadline = time.monotonic() + self.trainer.spec.recovery_timeout_s
        while time.monotonic() < deadline:
            newest = int(self.trainer.store.get("control/epoch"))
            if newest > running:
                return running + 1
            time.sleep(0.05)
        raise ReshapeFailed(f"no plan newer than epoch {running} within {self.trainer.spec.recovery_timeout_s:.0f} s "
                            "after a peer failed; publish a ReconfigureCommand or run with --on-death drop-replica")

    def recover(self, exc: BaseException) -> None:
        """A collective raised (a peer died, or timed out). Nothing was stepped this iteration, so
        the state is the last committed one; wait for a plan and reshape onto it."""
        log.warning("device %d: iteration %d failed (%s); waiting for a new plan",
                    self.trainer.device, self.trainer.iteration, str(exc).splitlines()[0][:200])
        start = time.perf_counter()
        target = self.await_plan()
        self.failure_wait_s = time.perf_counter() - start
        self.lost_iterations = 1
        self.reshape(target)

    def note_iteration(self, wall_s: float) -> None:
        self.recent_walls_s.append(wall_s)
        del self.recent_walls_s[:-20]
