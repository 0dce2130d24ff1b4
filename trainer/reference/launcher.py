"""The reference trainer's launcher: its job runs under the node agent, with a controller for the rest.

One launcher. :func:`launch` runs the job through the node agent (trainer/agent/node.py, torch's
``LocalElasticAgent``) in standalone mode on loopback (trainer/agent/standalone.py, which the native
executor's ranks run under too): the agent hosts the rendezvous store, forks one
rank per device from a fork server that imported trainer.reference.worker once (trainer/agent/pcontext.py),
and stops them on every way out; each rank dies with it (trainer/agent/child.py). The store the
agent hosts is also where the ranks find the trainer's keys (trainer/reference/rendezvous.py): any rank may
die and the survivors can still meet.

What is the reference trainer's own is :class:`TrainerController`, which the agent runs in its
monitor loop (``AgentSettings.controller``); a rank that dies leaves torch's watch and is the
controller's, so torch neither stops its peers nor restarts it. The controller is the single reader
of the control topic (trainer/reference/intake.py fences and posts the commands; probe requests are posted
for the ranks to run, trainer/reference/probe.py), publishes the acknowledgements and ``plan.current``, and
handles deaths. With ``on_death="drop-replica"`` it publishes a command that drops the dead
device's replica and gives its micro-batches to the others, or — when no replica would survive —
puts spare devices in the dead ones' places (state then comes from the newest disk checkpoint); a
minimal policy so the job survives on its own; the remediation engine's commands take the same
path through the bus. With ``"wait"`` the survivors wait for a command from the bus.

A dead spare (a rank the plan leaves out, still in the world's commit all-reduce) needs no planner:
during a reshape whose world still waits at the arrival barrier, the intake posts the in-flight
command again without it; otherwise, once nothing is in flight and the running world still holds
it, the controller posts the running plan again as the next epoch.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from collector import topics
from collector.auth import Signer
from collector.epoch_fence import COMMAND_TTL_S, new_run, run_of
from collector.events import (AckStatus, CommandAck, EventFactory, FaultCategory, FaultInjected, Location, PlanCurrent,
                              PlanCurrentReason, ProbeRequest, ReconfigureCommand)
from collector.plan import Plan
from collector.replica_drop import drop_replicas
from collector.settings import elastic_environment
from collector.stream import EventStream
from trainer.agent.shrink import mark_lost
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.agent.standalone import standalone_node
from trainer.reference.chunks import schedule_problem
from trainer.faults import KILL_EXIT_CODE
from trainer.reference.intake import CommandIntake
from trainer.reference.rendezvous import CONTROL_PROBE, PROGRESS, write_probe
from trainer.reference.spec import RunSpec


@dataclass
class LaunchResult:
    exit_codes: dict[int, int]
    acks: list[CommandAck] = field(default_factory=list)
    final_plan: Plan | None = None
    dead: list[int] = field(default_factory=list)


def replace_with_spares(plan: Plan, dead: set[int], spares: list[int]) -> Plan:
    """The next epoch with each dead device's place taken by a spare (in order), layout unchanged.
    Raises ValueError when there are fewer spares than dead devices in the plan."""
    lost = [d for d in plan.devices if d in dead]
    if len(spares) < len(lost):
        raise ValueError(f"devices {lost} died but only spares {spares} are left; publish a smaller plan")
    swap = dict(zip(lost, spares))
    pipelines = tuple(p.model_copy(update={"stages": tuple(
        st.model_copy(update={"devices": tuple(swap.get(d, d) for d in st.devices)}) for st in p.stages)})
        for p in plan.pipelines)
    return plan.model_copy(update={"epoch": plan.epoch + 1, "pipelines": pipelines})


def on_death_plan(plan: Plan, dead: set[int], alive: set[int]) -> tuple[Plan | None, str]:
    """The launcher's own ``drop-replica`` policy: drop every replica that lost a device (state
    comes from the surviving replicas, live); if that leaves none, put spares (live devices the
    plan does not use) in the dead devices' places — their layers then have no live copy and the
    ranks fall back to the newest disk checkpoint (--checkpoint-every). None: neither is possible."""
    try:
        return drop_replicas(plan, dead), "dropped the dead device's replica"
    except ValueError:
        pass
    spares = sorted(alive - set(plan.devices) - dead)
    try:
        how = f"no replica survives; spares {spares} take the dead devices' places"
        return replace_with_spares(plan, dead, spares), how
    except ValueError as exc:
        return None, f"{exc}; waiting for a command"


def launch(spec: RunSpec, plan: Plan, ranks: int, *, on_death: str = "wait", commands_from: str = "end",
           poll_s: float = 0.05, echo: Callable[[str], None] | None = None) -> LaunchResult:
    """Run the job to its end under the node agent; returns exit codes, the acknowledgements
    published, the final plan. Fails before any rank starts when the plan cannot run here, the
    store cannot bind or the bus cannot be opened."""
    check_launchable(spec, plan, ranks)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(spec.threads))
    run_id = spec.run_id or uuid.uuid4().hex
    with standalone_node(spec.store_host, run_id, spec.rendezvous_timeout_s) as node:
        spec = spec.model_copy(update={"store_port": node.port, "run_id": run_id})
        controller = TrainerController(spec, plan, ranks, node.store, on_death=on_death, commands_from=commands_from,
                                       echo=echo or (lambda line: None))
        try:
            exits = node.run(job=spec.job, role="trainer", ranks=ranks, entrypoint=_rank_main,
                             args=(spec.model_dump_json(),), preload=("trainer.reference.worker", __name__),
                             controller=controller, poll_s=poll_s)
            controller.finish(exits)
            controller.result.final_plan = controller.intake.running
            return controller.result
        finally:
            controller.close()


def check_launchable(spec: RunSpec, plan: Plan, ranks: int) -> None:
    """Refuse, before anything starts, a plan the launched ranks could not run."""
    if max(plan.devices) >= ranks:
        raise ValueError(f"plan uses devices up to {max(plan.devices)} but only {ranks} ranks are launched; "
                         f"pass --ranks {max(plan.devices) + 1}")
    if plan.num_layers != spec.config.n_layer:
        raise ValueError(f"plan has {plan.num_layers} layers but the model has {spec.config.n_layer}; "
                         "build the plan with the model's layer count")
    if problem := plan.tp_split_problem(spec.config.n_head) or schedule_problem(plan):
        raise ValueError(problem)


class TrainerController:
    """The reference trainer's part of the agent's monitor loop, in parts that each read on their
    own: the constructor announces the plan, subscribes to the bus and posts the starting plan;
    :meth:`watch` is one pass (deaths, commands, probes, acks); :meth:`on_rank_death` is the death
    handling; :meth:`finish` settles what the bus still holds once the ranks are gone."""

    def __init__(self, spec: RunSpec, plan: Plan, ranks: int, store: dist.Store, *, on_death: str, commands_from: str,
                 echo: Callable[[str], None]) -> None:
        """Announce the plan, subscribe to the trainer's topics (from their end, or from the
        beginning with ``commands_from="beginning"``) and post the starting plan (post 0) in
        ``store``, where the ranks look. Fails when the bus cannot be opened."""
        self.spec, self.ranks = spec, ranks
        self.on_death, self.echo = on_death, echo
        self.bus = spec.bus.open()
        self.factory = Signer(EventFactory(spec.job, "trainer"), "executor")  # acks and its own on-death commands
        # The posts it writes and the ranks' answers it reads, signed for this run: what a stranger
        # writes in the store is refused and reported on the bus (trainer/agent/signed_store.py).
        self.store = SignedStore(store, spec.run_id or "", reader="trainer", keyring=self.factory.keyring,
                                 report=lambda refused: self.bus.publish([self.factory.make(refused)]))
        self.run = run_of(spec.run_id) if spec.run_id else new_run()  # commands must name it (collector/epoch_fence.py)
        self.bus.publish([self.factory.make(_plan_current(spec, plan, "start", self.run))])
        self.stream = EventStream(self.bus, f"trainer:{spec.job}", list(topics.TRAINER_TOPICS), job=spec.job,
                                  on_assign=None if commands_from == "beginning"
                                  else (lambda tps: self.bus.end_offsets([tp.topic for tp in tps])))
        cfg = spec.config
        self.intake = CommandIntake(self.store, plan, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                    global_microbatches=plan.global_microbatches, run=self.run)
        self.intake.start(tuple(range(ranks)))
        self.probes = 0
        self.store.set(CONTROL_PROBE, {"newest": 0})
        self.result = LaunchResult(exit_codes={})
        self.last_echoed = -1
        self.spare_reposts: set[int] = set()  # running epochs already re-posted without their dead spares

    # ---- one pass ------------------------------------------------------------------------------

    def watch(self, exits: dict[int, int]) -> None:
        """One pass of the agent's monitor loop (every ``poll_s``): note the ranks that exited,
        relay the bus's commands and probes to the ranks, publish what the ranks finished, and
        re-post the running plan if a spare died.

        It never waits (the agent's monitor interval paces the passes): the intake judges an
        in-flight reshape by who is alive, and ``exits`` must still be true then — a rank that died
        unseen while ranks report the failed transfer it caused would fail a command that only
        needed posting again without a dead spare."""
        self.note_exits(exits)
        alive = set(range(self.ranks)) - set(exits)
        self.relay_commands()
        progress = _progress(self.store)
        if progress["iteration"] > self.last_echoed:
            self.last_echoed = progress["iteration"]
            self.echo(f"iteration {self.last_echoed} epoch {progress['epoch']} loss {progress['loss']:.4f}")
        if alive:
            self.publish_acks(self.intake.poll(alive, progress["iteration"]))
            if self.intake.in_flight is None and self.intake.running.epoch not in self.spare_reposts:
                self.repost_without_dead_spares()

    def relay_commands(self) -> None:
        """Offer this job's reconfigure commands to the intake (it fences them by epoch and posts
        them for the ranks) and post its admitted probe requests; publish what the intake refused."""
        for delivery in self.stream.poll(timeout_s=0):
            ev = delivery.event
            if delivery.topic != topics.obeyed_from(ev.kind):
                continue  # the control topic's copy of a command is the lifecycle's record, not an order
            if ev.job == self.spec.job and isinstance(ev.payload, ReconfigureCommand):
                self.intake.offer_event(ev)
            elif ev.job == self.spec.job and isinstance(ev.payload, ProbeRequest):
                request = self.intake.admit_probe(ev)
                if request is not None:
                    self.probes += 1
                    write_probe(self.store, self.probes, request)
        if rejected := self.intake.rejections():
            self.bus.publish(rejected)
        self.stream.commit()

    def publish_acks(self, acks: list[CommandAck]) -> None:
        """Publish the acknowledgements of the commands the ranks finished and, when one applied,
        the plan that now runs."""
        for ack in acks:
            self.echo(f"command {ack.command_id[:8]} epoch {ack.epoch}: {ack.status.value} "
                      f"(pause {ack.pause_s:.3f} s) {ack.detail}")
        if acks:
            applied = [_plan_current(self.spec, self.intake.running, "reshape", self.run)] if any(
                a.status is AckStatus.APPLIED for a in acks) else []
            self.bus.publish([self.factory.make(a) for a in [*acks, *applied]])
            self.result.acks += acks

    def repost_without_dead_spares(self) -> None:
        """A spare died (a device the plan leaves out, such as a slow GPU an earlier plan excluded)
        and the running world still holds it: it sat in the commit all-reduce, so the survivors wait
        for a plan, and a planner asked has nothing to propose. Re-post the running plan as the next
        epoch: the world re-forms without it. Once per running epoch."""
        running = self.intake.running
        dead_spares = sorted(set(self.result.dead) & set(self.intake.running_world) - set(running.devices))
        if dead_spares:
            self.spare_reposts.add(running.epoch)
            self.echo(f"spare devices {dead_spares} died: the running plan goes on without them")
            self.bus.publish([self.factory.make(ReconfigureCommand(
                command_id=uuid.uuid4().hex, plan_id=f"launcher-spare-{dead_spares[0]}",
                plan=running.model_copy(update={"epoch": running.epoch + 1}), run=self.run,
                expires_at_s=time.time() + COMMAND_TTL_S))])

    # ---- the death handling --------------------------------------------------------------------

    def note_exits(self, exits: dict[int, int]) -> None:
        """Record the exit code of every rank that exited since the last pass; one that exited
        with an error is dead."""
        for d, code in sorted(exits.items()):
            if d in self.result.exit_codes:
                continue
            self.result.exit_codes[d] = code
            if code != 0:
                self.on_rank_death(d, code, alive=set(range(self.ranks)) - set(exits))

    def on_rank_death(self, d: int, exitcode: int, alive: set[int]) -> None:
        """Count the loss where the ranks wait (``resihp/lost-count``: survivors blocked on a peer
        that gave up wake now, not at their collective timeout), tell the intake (an in-flight
        reshape that needs ``d`` fails), publish the death as a
        fail-stop fault and, with ``on_death="drop-replica"``, publish the launcher's own plan
        around it (:func:`on_death_plan`); with ``"wait"`` the survivors wait for the bus."""
        self.result.dead.append(d)
        mark_lost(self.store, d, exitcode)  # first: every survivor's wait on a peer ends now (trainer/agent/wake.py)
        self.intake.note_death()
        self.echo(f"device {d} exited with {exitcode}")
        self.bus.publish([self.factory.make(FaultInjected(
            fault_id=f"{self.spec.job}/death/{d}", category=FaultCategory.FAIL_STOP,
            location=Location(target="compute", rank=d, factor=1e9),
            start_iteration=_progress(self.store)["iteration"] + 1))])
        # The in-flight reshape fails if its plan names d: plan on top of what runs.
        # If it only held d as a spare, it goes on without d (trainer/reference/intake.py).
        in_flight = self.intake.in_flight
        target = in_flight.command.plan if in_flight and not self.intake.doomed(d) else self.intake.running
        if self.on_death == "drop-replica" and d in target.devices and alive:
            new_plan, how = on_death_plan(target, set(self.result.dead), alive)
            self.echo(f"on-death policy: {how}")
            if new_plan is not None:
                self.bus.publish([self.factory.make(ReconfigureCommand(
                    command_id=uuid.uuid4().hex, plan_id=f"launcher-drop-{d}", plan=new_plan, run=self.run,
                    expires_at_s=time.time() + COMMAND_TTL_S))])

    # ---- the end -------------------------------------------------------------------------------

    def finish(self, exits: dict[int, int]) -> None:
        """Every rank has exited: record the last exits, offer the commands still on the bus, so
        each gets its acknowledgement (the intake refuses what can no longer run), and publish them."""
        self.note_exits(exits)
        for delivery in self.stream.poll(timeout_s=0):
            if (delivery.topic == topics.COMMANDS and delivery.event.job == self.spec.job
                    and isinstance(delivery.event.payload, ReconfigureCommand)):
                self.intake.offer_event(delivery.event)
        if rejected := self.intake.rejections():
            self.bus.publish(rejected)
        self.stream.commit()
        acks = self.intake.finish()
        for ack in acks:
            self.echo(f"command {ack.command_id[:8]} epoch {ack.epoch}: {ack.status.value} {ack.detail}")
        if acks:
            self.bus.publish([self.factory.make(a) for a in acks])
            self.result.acks += acks

    def close(self) -> None:
        self.stream.close()
        self.bus.close()


def _plan_current(spec: RunSpec, plan: Plan, reason: PlanCurrentReason, run: str) -> PlanCurrent:
    """What the platform should know of the running job: its plan and the model's size."""
    d = spec.config.n_embd
    params_per_layer = 12 * d * d + 13 * d  # attention 4d², MLP 8d², biases and norms
    bytes_per_param = 4 * spec.config.torch_dtype.itemsize  # parameter, gradient, two AdamW moments
    return PlanCurrent(plan=plan, reason=reason, gpus_per_node=8, model_name=spec.job,
                       layer_state_bytes=params_per_layer * bytes_per_param,
                       tokens_per_microbatch=spec.config.block_size, run=run)


def _rank_main(spec_json: str) -> None:
    """A rank the agent forked (its server imported trainer.reference.worker and this module): its device is
    its global rank, torch elastic's ``RANK``."""
    from trainer.reference.worker import process_main

    process_main(elastic_environment().RANK, spec_json)


def _progress(records: SignedStore) -> dict:
    """The ranks' last committed iteration; none yet (or a forged one, refused) reads as -1."""
    return records.read(PROGRESS, _progress_record, RANK_WRITERS) or {"iteration": -1, "epoch": -1}


def _progress_record(body: Any) -> dict:
    if not isinstance(body, dict) or type(body.get("iteration")) is not int or type(body.get("epoch")) is not int \
            or not isinstance(body.get("loss"), int | float):
        raise ValueError("progress holds an iteration, an epoch and a loss")
    return body


__all__ = ["launch", "LaunchResult", "drop_replicas", "replace_with_spares", "on_death_plan", "KILL_EXIT_CODE"]
