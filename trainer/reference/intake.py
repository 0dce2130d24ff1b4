"""Launcher-side command intake: fence commands by epoch, post one reshape at a time, acknowledge.

Only the launcher reads the control topic, so eight ranks never race to judge one command and one
acknowledgement is published per command. The rules (the contract's): epoch e+1 is applied only on
top of e; a command seen before (same command id) is ``ignored_duplicate``; any other command whose
epoch is not running+1 is ``ignored_stale`` (its detail says why: old, or skipping epochs); a plan
the job cannot run (wrong layer count, global batch, a device not alive, a TP degree that does not
divide the heads, an interleaved split it cannot run) is ``failed`` without touching the ranks.
Commands are handled in arrival order, one in flight at a time; a command queued behind an
in-flight reshape is judged against the epoch that reshape leaves running.

Only signed commands get this far (:meth:`CommandIntake.offer_event`): signed by the engine, or by
this executor's own on-death policy (collector/auth.py), naming this launcher's run (``run``, new
random bits per launch, announced in its ``plan.current``) and not past their expiry on the host's
clock (collector/epoch_fence.py's ``order_refusal``); a command of another run, or an old one
republished, is refused and reported, never acknowledged. Probe requests must be signed by analytics
and within trainer/integration.py's ``probe_refusal`` bounds (:meth:`CommandIntake.admit_probe`).
Whatever is refused is kept as a ``control.rejected`` event (:meth:`CommandIntake.rejections`) for
the launcher to publish, once per event id, and never touches the ranks.

Posting a plan writes a numbered post (trainer/reference/rendezvous.py: the plan and the live devices, then
``control/post``), which ranks read at every commit. The acknowledgement waits until every live
device of the world has written ``done/P/D`` (or one wrote ``failed/P/D``, or died) and states the largest
pause and where the state came from (live peers, or a disk checkpoint when no live copy was left).
A device the posted plan names that dies before the reshape is done fails the command at once —
the ack names the device — and the post is aborted so the waiting ranks do not sit out a rendezvous
timeout; the same epoch can then be posted again (a new command, e.g. the launcher's own policy).
A device of the world the plan does not name (a spare, such as a slow GPU an earlier plan left
out) that dies mid-reshape changes nothing the plan needs. While the world still waits at the
arrival barrier, the post is aborted and the same command posted again to the devices still
alive; it stays in flight — one command, one ack. Once everyone arrived the ranks no longer heed
an abort, so the reshape runs its course: it applies when every live device is done (the
running world then still holds the dead spare, ``running_world``, and the launcher re-posts the
plan without it); if the spare's death fails a transfer or a group instead, the ranks report it,
go back to the running epoch's state and wait, and the same command is posted again as above.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collector.auth import Gate
from collector.epoch_fence import fence_verdict, new_run, order_refusal
from collector.events import AckStatus, CommandAck, Envelope, ProbeRequest, ReconfigureCommand
from collector.plan import Plan
from trainer.reference.chunks import schedule_problem
from trainer.agent.signed_store import RANK_WRITERS
from trainer.integration import probe_refusal
from trainer.protocol import acknowledgement
from trainer.reference.rendezvous import GROUPS_KEPT, abort_key, arrive_key, done_key, failed_key, write_post


@dataclass
class InFlight:
    command: ReconfigureCommand
    world: tuple[int, ...]
    posted_s: float
    post: int
    reposted: tuple[int, ...] = ()  # spares that died mid-reshape, each time the command was posted again


class CommandIntake:
    def __init__(self, store, plan: Plan, *, n_layer: int, n_head: int, global_microbatches: int,
                 run: str | None = None, clock: Callable[[], float] = time.time) -> None:
        """``store``: the launcher's signed records (trainer/agent/signed_store.py's ``SignedStore``).
        ``run``: the launch's run incarnation (None: fresh random bits); ``clock``: Unix time, for
        commands' expiries."""
        self.store = store
        self.run = run or new_run()
        self.clock = clock
        self.running = plan
        self.n_layer, self.n_head, self.global_microbatches = n_layer, n_head, global_microbatches
        self.seen: set[str] = set()
        self.queue: deque[ReconfigureCommand] = deque()
        self.in_flight: InFlight | None = None
        self.applied_at_iteration = -1
        self.death_pending = False
        self.applied: list[Plan] = []
        self.posts = 0
        self.running_world: tuple[int, ...] = ()  # the world of the newest applied post
        self.gate = Gate("trainer")

    def start(self, world: tuple[int, ...]) -> None:
        """Post the plan the job starts with (post 0) to ``world``."""
        write_post(self.store, 0, self.running, world)
        self.running_world = world

    def doomed(self, device: int) -> bool:
        """The in-flight reshape's plan names ``device``, so it fails if ``device`` died (a device of
        its world the plan leaves out only makes the intake post the command again without it)."""
        return self.in_flight is not None and device in self.in_flight.command.plan.devices

    def offer(self, command: ReconfigureCommand) -> None:
        self.queue.append(command)

    def offer_event(self, event: Envelope) -> bool:
        """Queue a command read from the bus if its signature lets it act; False when refused."""
        if not isinstance(event.payload, ReconfigureCommand) or not self.gate.admit(event):
            return False
        refusal = order_refusal(event.payload, self.run, event.time_s, self.clock())
        if refusal is not None:
            self.gate.refuse(event, refusal)
            return False
        self.offer(event.payload)
        return True

    def admit_probe(self, event: Envelope) -> ProbeRequest | None:
        """The probe request to run, or None when it is refused (unsigned, or over the bounds)."""
        request = event.payload
        if not isinstance(request, ProbeRequest) or not self.gate.admit(event):
            return None
        refusal = probe_refusal(request, self.running_world or self.running.devices)
        if refusal is not None:
            self.gate.refuse(event, refusal)
            return None
        return request

    def rejections(self) -> list[Envelope]:
        """``control.rejected`` events for what was refused since the last call, for the launcher to publish."""
        return self.gate.take()

    def note_death(self) -> None:
        """A rank died: the next command may be applied without waiting for training progress."""
        self.death_pending = True

    # ---- pure judgement ----------------------------------------------------------------------------

    def judge(self, command: ReconfigureCommand, alive: set[int]) -> tuple[AckStatus | None, str]:
        """None when the command should be applied; otherwise its status and why."""
        status, detail = fence_verdict(command, self.running.epoch, self.seen)
        if status is not None:
            return status, detail
        plan = command.plan
        if plan.num_layers != self.n_layer:
            return AckStatus.FAILED, f"plan has {plan.num_layers} layers but the model has {self.n_layer}"
        if plan.global_microbatches != self.global_microbatches:
            return AckStatus.FAILED, (f"plan runs {plan.global_microbatches} micro-batches per iteration but the "
                                      f"job's global batch is {self.global_microbatches}; keep the total fixed")
        missing = sorted(set(plan.devices) - alive)
        if missing:
            return AckStatus.FAILED, f"plan uses devices {missing} that are not alive (alive: {sorted(alive)})"
        problem = plan.tp_split_problem(self.n_head) or schedule_problem(plan)
        if problem:
            return AckStatus.FAILED, problem
        return None, ""

    # ---- driving ---------------------------------------------------------------------------------------

    def poll(self, alive: set[int], progress_iteration: int) -> list[CommandAck]:
        """Advance: finish the in-flight reshape if all ranks reported, else take the next command."""
        acks: list[CommandAck] = []
        if self.in_flight is not None:
            ack = self._check_in_flight(self.in_flight, alive, progress_iteration)
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

    def _post(self, command: ReconfigureCommand, alive: set[int], reposted: tuple[int, ...] = ()) -> None:
        world = tuple(sorted(alive))
        self.posts += 1
        write_post(self.store, self.posts, command.plan, world)
        self.in_flight = InFlight(command, world, time.monotonic(), self.posts, reposted)

    def _check_in_flight(self, fl: InFlight, alive: set[int], progress_iteration: int) -> CommandAck | None:
        failed = {d: why for d in fl.world if isinstance(why := self.store.read(failed_key(fl.post, d), allowed=RANK_WRITERS), str)}
        died = [d for d in fl.world if d not in alive]
        spares_only = bool(died) and not set(died) & set(fl.command.plan.devices)
        if spares_only and (failed or not all(self.store.valid(arrive_key(fl.post, d), RANK_WRITERS) for d in fl.world)):
            # Only spares died, and the world still waits at the arrival barrier or the ranks past
            # it report a failed transfer or group (they went back to the running epoch and wait):
            # release them and post the same command to the devices still alive.
            self.store.set(abort_key(fl.post), f"spare devices {died} died before the reshape to epoch "
                                               f"{fl.command.plan.epoch} finished; posted again without them")
            self._post(fl.command, alive, fl.reposted + tuple(died))
            return None
        if failed or (died and not spares_only):
            reasons = []
            if died:
                reasons.append(f"devices {died} died before the reshape to epoch {fl.command.plan.epoch} finished"
                               if len(died) > 1 else
                               f"device {died[0]} died before the reshape to epoch {fl.command.plan.epoch} finished")
                named = sorted(set(died) & set(fl.command.plan.devices))
                reasons[-1] += (f"; the plan names {named}: re-plan without them" if named else
                                "; post the command again")
                self.store.set(abort_key(fl.post), reasons[-1])
            reasons += [f"device {d}: {why}" for d, why in failed.items()]
            self.in_flight = None
            return self._ack(fl.command, AckStatus.FAILED, "; ".join(reasons)[:2000])
        live_world = [d for d in fl.world if d in alive]  # all of it, unless a spare died past the barrier
        done = [self.store.read(done_key(fl.post, d), _done_report, RANK_WRITERS) for d in live_world]
        reports = [r for r in done if r is not None]
        if len(reports) < len(done):  # not yet (or refused, reported: only the rank's own report counts)
            return None
        pause_s = max(r["pause_s"] for r in reports)
        pause_iterations = max(r["pause_iterations"] for r in reports)
        waited = max(r["failure_wait_s"] for r in reports)
        # Every rank takes the same branch, so one source: live peers, kept groups, or a checkpoint.
        source = reports[0].get("source", "live")
        self.running = fl.command.plan
        self.running_world = fl.world
        self.applied.append(self.running)
        resumed_at = max(r["iteration"] for r in reports)
        # After a roll-back to a checkpoint the progress counter restarts lower: count from there.
        rolled_back = source not in ("live", GROUPS_KEPT)
        self.applied_at_iteration = resumed_at - 1 if rolled_back else max(progress_iteration, resumed_at - 1)
        self.death_pending = False
        self.in_flight = None
        detail = f"now {self.running.shape()} on devices {list(self.running.devices)}"
        detail += {"live": "; state from live peers", GROUPS_KEPT: "; micro-batches moved, process groups and state kept"
                   }.get(source, f"; state from {source}")
        if waited > 0:
            detail += f"; survivors waited {waited:.2f} s for this plan after the failure"
        if fl.reposted:
            detail += f"; posted again after spare devices {list(fl.reposted)} died mid-reshape"
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
        return acknowledgement(command, status, detail, running_epoch=self.running.epoch, run=self.run,
                               pause_s=pause_s, pause_iterations=pause_iterations)


def _done_report(body: Any) -> dict:
    """A rank's ``done/P/D`` report: the pause, the iterations it cost, the failure wait, the source."""
    if not isinstance(body, dict) or not {"pause_s", "pause_iterations", "failure_wait_s", "iteration"} <= set(body):
        raise ValueError("a done report holds pause_s, pause_iterations, failure_wait_s and iteration")
    return body
