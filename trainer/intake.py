"""Launcher-side command intake: fence commands by epoch, post one reshape at a time, acknowledge.

Only the launcher reads the control topic, so eight ranks never race to judge one command and one
acknowledgement is published per command. The rules (the contract's): epoch e+1 is applied only on
top of e; a command seen before (same command id) is ``ignored_duplicate``; any other command whose
epoch is not running+1 is ``ignored_stale`` (its detail says why: old, or skipping epochs); a plan
the job cannot run (wrong layer count, global batch, a device not alive, a TP degree that does not
divide the heads) is ``failed`` without touching the ranks. Commands are handled in arrival order,
one in flight at a time; a command queued behind an in-flight reshape is judged against the epoch
that reshape leaves running.

Posting a plan writes ``plan/E``, ``world/E`` (the live devices) and finally ``control/epoch`` —
ranks read that last key at every commit, so they see a plan only once all of it is there. The
acknowledgement waits until every device of the world has written ``done/E/D`` (or one wrote
``failed/E/D``, or died) and states the largest pause.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass

from collector.events import AckStatus, CommandAck, ReconfigureCommand
from collector.plan import Plan


@dataclass
class InFlight:
    command: ReconfigureCommand
    world: tuple[int, ...]
    posted_s: float


class CommandIntake:
    def __init__(self, store, plan: Plan, *, n_layer: int, n_head: int, global_microbatches: int) -> None:
        self.store = store
        self.running = plan
        self.n_layer, self.n_head, self.global_microbatches = n_layer, n_head, global_microbatches
        self.seen: set[str] = set()
        self.queue: deque[ReconfigureCommand] = deque()
        self.in_flight: InFlight | None = None
        self.applied_at_iteration = -1
        self.death_pending = False
        self.applied: list[Plan] = []

    def offer(self, command: ReconfigureCommand) -> None:
        self.queue.append(command)

    def note_death(self) -> None:
        """A rank died: the next command may be applied without waiting for training progress."""
        self.death_pending = True

    # ---- pure judgement ----------------------------------------------------------------------------

    def judge(self, command: ReconfigureCommand, alive: set[int]) -> tuple[AckStatus | None, str]:
        """None when the command should be applied; otherwise its status and why."""
        epoch, running = command.plan.epoch, self.running.epoch
        if command.command_id in self.seen:
            return AckStatus.IGNORED_DUPLICATE, f"command {command.command_id} was already handled"
        if epoch <= running:
            return AckStatus.IGNORED_STALE, f"epoch {epoch} is not newer than the running epoch {running}"
        if epoch > running + 1:
            return AckStatus.IGNORED_STALE, (f"epoch {epoch} skips epochs: only {running + 1} applies on top of "
                                             f"{running}; re-plan from the running epoch")
        plan = command.plan
        if plan.num_layers != self.n_layer:
            return AckStatus.FAILED, f"plan has {plan.num_layers} layers but the model has {self.n_layer}"
        if plan.global_microbatches != self.global_microbatches:
            return AckStatus.FAILED, (f"plan runs {plan.global_microbatches} micro-batches per iteration but the "
                                      f"job's global batch is {self.global_microbatches}; keep the total fixed")
        missing = sorted(set(plan.devices) - alive)
        if missing:
            return AckStatus.FAILED, f"plan uses devices {missing} that are not alive (alive: {sorted(alive)})"
        bad_tp = sorted({s.tp for p in plan.pipelines for s in p.stages if self.n_head % s.tp})
        if bad_tp:
            return AckStatus.FAILED, f"TP degrees {bad_tp} do not divide the {self.n_head} attention heads"
        return None, ""

    # ---- driving ---------------------------------------------------------------------------------------

    def poll(self, alive: set[int], progress_iteration: int) -> list[CommandAck]:
        """Advance: finish the in-flight reshape if all ranks reported, else take the next command."""
        acks: list[CommandAck] = []
        if self.in_flight is not None:
            ack = self._check_in_flight(alive, progress_iteration)
            if ack is None:
                return acks
            acks.append(ack)
        while self.queue and self.in_flight is None:
            command = self.queue[0]
            status, detail = self.judge(command, alive)
            if status is None and not self.death_pending and progress_iteration <= self.applied_at_iteration:
                break  # let at least one iteration run on the current epoch first
            self.queue.popleft()
            self.seen.add(command.command_id)
            if status is not None:
                acks.append(self._ack(command, status, detail))
                continue
            self._post(command, alive)
        return acks

    def _post(self, command: ReconfigureCommand, alive: set[int]) -> None:
        epoch = command.plan.epoch
        world = tuple(sorted(alive))
        self.store.set(f"plan/{epoch}", command.plan.model_dump_json())
        self.store.set(f"world/{epoch}", json.dumps(list(world)))
        self.store.set("control/epoch", str(epoch))
        self.in_flight = InFlight(command, world, time.monotonic())

    def _check_in_flight(self, alive: set[int], progress_iteration: int) -> CommandAck | None:
        fl = self.in_flight
        epoch = fl.command.plan.epoch
        failed = [d for d in fl.world if self.store.check([f"failed/{epoch}/{d}"])]
        died = [d for d in fl.world if d not in alive]
        if failed or died:
            reasons = [f"device {d}: {self.store.get(f'failed/{epoch}/{d}').decode()}" for d in failed]
            reasons += [f"device {d} died during the reshape" for d in died]
            self.in_flight = None
            return self._ack(fl.command, AckStatus.FAILED, "; ".join(reasons)[:2000])
        if not self.store.check([f"done/{epoch}/{d}" for d in fl.world]):
            return None
        reports = [json.loads(self.store.get(f"done/{epoch}/{d}")) for d in fl.world]
        pause_s = max(r["pause_s"] for r in reports)
        pause_iterations = max(r["pause_iterations"] for r in reports)
        waited = max(r["failure_wait_s"] for r in reports)
        self.running = fl.command.plan
        self.applied.append(self.running)
        self.applied_at_iteration = max(progress_iteration, max(r["iteration"] for r in reports) - 1)
        self.death_pending = False
        self.in_flight = None
        detail = f"now {self.running.shape()} on devices {list(self.running.devices)}"
        if waited > 0:
            detail += f"; survivors waited {waited:.2f} s for this plan after the failure"
        return self._ack(fl.command, AckStatus.APPLIED, detail, pause_s, pause_iterations)

    def finish(self) -> list[CommandAck]:
        """The job ended: whatever is still queued or in flight was not applied."""
        acks = []
        if self.in_flight is not None:
            acks.append(self._ack(self.in_flight.command, AckStatus.FAILED, "the job ended before the reshape finished"))
            self.in_flight = None
        while self.queue:
            command = self.queue.popleft()
            status, detail = self.judge(command, set(self.running.devices))
            if status in (AckStatus.IGNORED_DUPLICATE, AckStatus.IGNORED_STALE):
                acks.append(self._ack(command, status, detail))
            else:
                acks.append(self._ack(command, AckStatus.FAILED, "the job ended before the command could be applied"))
            self.seen.add(command.command_id)
        return acks

    def _ack(self, command: ReconfigureCommand, status: AckStatus, detail: str, pause_s: float = 0.0,
             pause_iterations: int = 0) -> CommandAck:
        return CommandAck(command_id=command.command_id, plan_id=command.plan_id, epoch=command.plan.epoch,
                          status=status, running_epoch=self.running.epoch, pause_s=pause_s,
                          pause_iterations=pause_iterations, detail=detail)
