"""The launcher: hosts the rendezvous store, starts one process per rank, relays commands.

The launcher — not rank 0 — owns the TCPStore, so any rank may die and the survivors can still
meet. It is also the single reader of the control topic (trainer/intake.py fences and posts the
commands; probe requests are posted for the ranks to run, trainer/probe.py) and it watches its
children: a rank that exits with an error is dead. With ``on_death="drop-replica"`` the launcher itself publishes a command that drops the dead device's
replica and gives its micro-batches to the others, or — when no replica would survive — puts
spare devices in the dead ones' places (state then comes from the newest disk checkpoint); a
minimal policy so the job survives on its own; the remediation engine's commands take the same
path through the bus. With ``"wait"`` the survivors wait for a command from the bus.

A dead spare (a rank the plan leaves out, still in the world's commit all-reduce) needs no planner:
during a reshape whose world still waits at the arrival barrier, the intake posts the in-flight
command again without it; otherwise, once nothing is in flight and the running world still holds
it, the launcher posts the running plan again as the next epoch.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from collector import topics
from collector.auth import Signer
from collector.events import (AckStatus, CommandAck, EventFactory, FaultCategory, FaultInjected, Location, PlanCurrent,
                              PlanCurrentReason, ProbeRequest, ReconfigureCommand)
from collector.plan import Plan
from collector.replica_drop import drop_replicas
from collector.stream import EventStream
from trainer.chunks import schedule_problem
from trainer.faults import KILL_EXIT_CODE
from trainer.intake import CommandIntake
from trainer.rendezvous import CONTROL_PROBE, PROGRESS, write_probe
from trainer.spec import RunSpec

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
    """Run the job to its end; returns exit codes, the acknowledgements published, the final plan."""
    check_launchable(spec, plan, ranks)
    job = Launch(spec, plan, ranks, on_death=on_death, commands_from=commands_from, poll_s=poll_s,
                 echo=echo or (lambda line: None))
    try:
        job.supervise()
        job.drain()
    finally:
        job.shutdown()
    job.result.final_plan = job.intake.running
    return job.result


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


class Launch:
    """One launched job, in parts that each read on their own: the constructor starts it,
    :meth:`supervise` is the command loop (one :meth:`watch` pass per ``poll_s`` until every rank
    has exited), :meth:`on_rank_death` is the death handling, :meth:`drain` settles what the
    bus still holds once the ranks are gone, and :meth:`shutdown` stops whatever is left.
    ``launch`` runs them in that order."""

    def __init__(self, spec: RunSpec, plan: Plan, ranks: int, *, on_death: str, commands_from: str, poll_s: float,
                 echo: Callable[[str], None]) -> None:
        """Start: host the store, announce the plan, subscribe to the trainer's topics (from their
        end, or from the beginning with ``commands_from="beginning"``), post the starting plan (post 0)
        and fork them. Fails when the store cannot bind or the bus cannot be opened; nothing has
        been forked then."""
        self.ranks, self.on_death, self.poll_s, self.echo = ranks, on_death, poll_s, echo
        self.store = dist.TCPStore(spec.store_host, 0, None, True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.rendezvous_timeout_s))
        self.spec = spec = spec.model_copy(update={"store_port": self.store.port,
                                                   "run_id": spec.run_id or uuid.uuid4().hex})
        self.bus = spec.bus.open()
        self.factory = Signer(EventFactory(spec.job, "trainer"), "executor")  # acks and its own on-death commands
        self.bus.publish([self.factory.make(_plan_current(spec, plan, "start"))])
        self.stream = EventStream(self.bus, f"trainer:{spec.job}", list(topics.TRAINER_TOPICS), job=spec.job,
                                  on_assign=None if commands_from == "beginning"
                                  else (lambda tps: self.bus.end_offsets([tp.topic for tp in tps])))
        cfg = spec.config
        self.intake = CommandIntake(self.store, plan, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                    global_microbatches=plan.global_microbatches)
        self.intake.start(tuple(range(ranks)))
        self.probes = 0
        self.store.set(CONTROL_PROBE, "0")
        self.procs = _start_ranks(spec, ranks)
        self.result = LaunchResult(exit_codes={})
        self.last_echoed = -1
        self.spare_reposts: set[int] = set()  # running epochs already re-posted without their dead spares

    # ---- the command loop ----------------------------------------------------------------------

    def supervise(self) -> None:
        """Watch until every rank has exited, sleeping ``poll_s`` between passes once none is alive
        (while any is, the bus poll waits instead)."""
        while len(self.result.exit_codes) < self.ranks:
            if not self.watch():
                time.sleep(self.poll_s)

    def watch(self) -> bool:
        """One pass: note the ranks that exited, relay the bus's commands and probes to the ranks,
        publish what the ranks finished, and re-post the running plan if a spare died. Returns
        whether any rank is still alive."""
        self.note_exits()
        self.relay_commands()
        alive = {d for d, p in self.procs.items() if p.exitcode is None}
        progress = _progress(self.store)
        if progress["iteration"] > self.last_echoed:
            self.last_echoed = progress["iteration"]
            self.echo(f"iteration {self.last_echoed} epoch {progress['epoch']} loss {progress['loss']:.4f}")
        if alive:
            self.publish_acks(self.intake.poll(alive, progress["iteration"]))
            if self.intake.in_flight is None and self.intake.running.epoch not in self.spare_reposts:
                self.repost_without_dead_spares()
        return bool(alive)

    def relay_commands(self) -> None:
        """Offer this job's reconfigure commands to the intake (it fences them by epoch and posts
        them for the ranks) and post its admitted probe requests; publish what the intake refused."""
        for delivery in self.stream.poll(timeout_s=self.poll_s):
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
            applied = [_plan_current(self.spec, self.intake.running, "reshape")] if any(
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
                plan=running.model_copy(update={"epoch": running.epoch + 1})))])

    # ---- the death handling --------------------------------------------------------------------

    def note_exits(self) -> None:
        """Record the exit code of every rank that exited since the last pass; one that exited
        with an error is dead."""
        for d, p in self.procs.items():
            if d in self.result.exit_codes or p.exitcode is None:
                continue
            self.result.exit_codes[d] = p.exitcode
            if p.exitcode != 0:
                self.on_rank_death(d, p.exitcode)

    def on_rank_death(self, d: int, exitcode: int) -> None:
        """Tell the intake (an in-flight reshape that needs ``d`` fails), publish the death as a
        fail-stop fault and, with ``on_death="drop-replica"``, publish the launcher's own plan
        around it (:func:`on_death_plan`); with ``"wait"`` the survivors wait for the bus."""
        self.result.dead.append(d)
        self.intake.note_death()
        self.echo(f"device {d} exited with {exitcode}")
        self.bus.publish([self.factory.make(FaultInjected(
            fault_id=f"{self.spec.job}/death/{d}", category=FaultCategory.FAIL_STOP,
            location=Location(target="compute", rank=d, factor=1e9),
            start_iteration=_progress(self.store)["iteration"] + 1))])
        # The in-flight reshape fails if its plan names d: plan on top of what runs.
        # If it only held d as a spare, it goes on without d (trainer/intake.py).
        in_flight = self.intake.in_flight
        target = in_flight.command.plan if in_flight and not self.intake.doomed(d) else self.intake.running
        alive_now = {e for e, q in self.procs.items() if q.exitcode is None}
        if self.on_death == "drop-replica" and d in target.devices and alive_now:
            new_plan, how = on_death_plan(target, set(self.result.dead), alive_now)
            self.echo(f"on-death policy: {how}")
            if new_plan is not None:
                self.bus.publish([self.factory.make(ReconfigureCommand(
                    command_id=uuid.uuid4().hex, plan_id=f"launcher-drop-{d}", plan=new_plan))])

    # ---- the end -------------------------------------------------------------------------------

    def drain(self) -> None:
        """Every rank has exited: offer the commands still on the bus, so each gets its
        acknowledgement (the intake refuses what can no longer run), and publish them."""
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

    def shutdown(self) -> None:
        """Stop every rank still running (terminate, then kill after 10 s) and close the bus; runs
        after an error too, so no rank outlives the launcher's job."""
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        for p in self.procs.values():
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
        self.stream.close()
        self.bus.close()


def _plan_current(spec: RunSpec, plan: Plan, reason: PlanCurrentReason) -> PlanCurrent:
    """What the platform should know of the running job: its plan and the model's size."""
    d = spec.config.n_embd
    params_per_layer = 12 * d * d + 13 * d  # attention 4d², MLP 8d², biases and norms
    bytes_per_param = 4 * spec.config.torch_dtype.itemsize  # parameter, gradient, two AdamW moments
    return PlanCurrent(plan=plan, reason=reason, gpus_per_node=8, model_name=spec.job,
                       layer_state_bytes=params_per_layer * bytes_per_param,
                       tokens_per_microbatch=spec.config.block_size)


def _start_ranks(spec: RunSpec, ranks: int) -> dict[int, BaseProcess]:
    """One process per rank, forked from a fork server that has imported torch once.

    Importing torch costs ~3 CPU-seconds; eight ranks on two cores would spend most of a short
    run importing. The fork server (multiprocessing's ``forkserver``) imports trainer.worker once
    and forks every rank from that clean, compute-free process, which is fork-safe (no OpenMP
    threads exist in it yet). It is reused by later launches from the same interpreter.
    """
    import multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(spec.threads))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["trainer.worker"])
    spec_json = spec.model_dump_json()
    procs: dict[int, BaseProcess] = {d: ctx.Process(target=_rank_main, args=(d, spec_json), name=f"rank-{d}") for d in range(ranks)}
    for p in procs.values():
        p.start()
    return procs


def _rank_main(device: int, spec_json: str) -> None:
    """A rank dies with the fork server it came from, which exits with the launcher: a SIGKILLed
    launcher leaves no rank behind (the node agent's guarantee, trainer/agent/child.py)."""
    from trainer.agent.child import die_with_parent
    from trainer.worker import process_main

    die_with_parent(None)
    process_main(device, spec_json)


def _progress(store: dist.Store) -> dict:
    if not store.check([PROGRESS]):
        return {"iteration": -1, "epoch": -1}
    return json.loads(store.get(PROGRESS))


__all__ = ["launch", "LaunchResult", "drop_replicas", "replace_with_spares", "on_death_plan", "KILL_EXIT_CODE"]
