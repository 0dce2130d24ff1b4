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
from dataclasses import dataclass, field
from datetime import timedelta

from collector import topics
from collector.auth import Signer
from collector.events import (AckStatus, CommandAck, EventFactory, FaultCategory, FaultInjected, Location, PlanCurrent,
                              ProbeRequest, ReconfigureCommand)
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
           poll_s: float = 0.05, echo=None) -> LaunchResult:
    """Run the job to its end; returns exit codes, the acknowledgements published, the final plan."""
    import torch.distributed as dist

    if max(plan.devices) >= ranks:
        raise ValueError(f"plan uses devices up to {max(plan.devices)} but only {ranks} ranks are launched; "
                         f"pass --ranks {max(plan.devices) + 1}")
    if plan.num_layers != spec.config.n_layer:
        raise ValueError(f"plan has {plan.num_layers} layers but the model has {spec.config.n_layer}; "
                         "build the plan with the model's layer count")
    if problem := schedule_problem(plan):
        raise ValueError(problem)
    echo = echo or (lambda line: None)
    store = dist.TCPStore(spec.store_host, 0, None, True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.rendezvous_timeout_s))
    spec = spec.model_copy(update={"store_port": store.port, "run_id": spec.run_id or uuid.uuid4().hex})

    bus = spec.bus.open()
    factory = Signer(EventFactory(spec.job, "trainer"), "executor")  # acks and its own on-death commands
    bus.publish([factory.make(_plan_current(spec, plan, "start"))])
    stream = EventStream(bus, f"trainer:{spec.job}", list(topics.TRAINER_TOPICS), job=spec.job,
                         on_assign=None if commands_from == "beginning"
                         else (lambda tps: bus.end_offsets([tp.topic for tp in tps])))
    cfg = spec.config
    intake = CommandIntake(store, plan, n_layer=cfg.n_layer, n_head=cfg.n_head,
                           global_microbatches=plan.global_microbatches)
    intake.start(tuple(range(ranks)))
    probes = 0
    store.set(CONTROL_PROBE, "0")
    procs = _start_ranks(spec, ranks)
    result = LaunchResult(exit_codes={})
    last_echoed = -1
    spare_reposts: set[int] = set()  # running epochs already re-posted without their dead spares
    try:
        while len(result.exit_codes) < ranks:
            for d, p in procs.items():
                if d in result.exit_codes or p.exitcode is None:
                    continue
                result.exit_codes[d] = p.exitcode
                if p.exitcode != 0:
                    result.dead.append(d)
                    intake.note_death()
                    echo(f"device {d} exited with {p.exitcode}")
                    bus.publish([factory.make(FaultInjected(
                        fault_id=f"{spec.job}/death/{d}", category=FaultCategory.FAIL_STOP,
                        location=Location(target="compute", rank=d, factor=1e9),
                        start_iteration=_progress(store)["iteration"] + 1))])
                    # The in-flight reshape fails if its plan names d: plan on top of what runs.
                    # If it only held d as a spare, it goes on without d (trainer/intake.py).
                    target = (intake.in_flight.command.plan if intake.in_flight and not intake.doomed(d)
                              else intake.running)
                    alive_now = {e for e, q in procs.items() if q.exitcode is None}
                    if on_death == "drop-replica" and d in target.devices and alive_now:
                        new_plan, how = on_death_plan(target, set(result.dead), alive_now)
                        echo(f"on-death policy: {how}")
                        if new_plan is not None:
                            bus.publish([factory.make(ReconfigureCommand(
                                command_id=uuid.uuid4().hex, plan_id=f"launcher-drop-{d}", plan=new_plan))])
            for delivery in stream.poll(timeout_s=poll_s):
                ev = delivery.event
                if delivery.topic != topics.obeyed_from(ev.kind):
                    continue  # the control topic's copy of a command is the lifecycle's record, not an order
                if ev.job == spec.job and isinstance(ev.payload, ReconfigureCommand):
                    intake.offer_event(ev)
                elif ev.job == spec.job and isinstance(ev.payload, ProbeRequest):
                    request = intake.admit_probe(ev)
                    if request is not None:
                        probes += 1
                        write_probe(store, probes, request)
            if rejected := intake.rejections():
                bus.publish(rejected)
            stream.commit()
            alive = {d for d, p in procs.items() if p.exitcode is None}
            progress = _progress(store)
            if progress["iteration"] > last_echoed:
                last_echoed = progress["iteration"]
                echo(f"iteration {last_echoed} epoch {progress['epoch']} loss {progress['loss']:.4f}")
            acks = intake.poll(alive, progress["iteration"]) if alive else []
            for ack in acks:
                echo(f"command {ack.command_id[:8]} epoch {ack.epoch}: {ack.status.value} "
                     f"(pause {ack.pause_s:.3f} s) {ack.detail}")
            if acks:
                applied = [_plan_current(spec, intake.running, "reshape")] if any(
                    a.status is AckStatus.APPLIED for a in acks) else []
                bus.publish([factory.make(a) for a in [*acks, *applied]])
                result.acks += acks
            if alive and intake.in_flight is None and intake.running.epoch not in spare_reposts:
                # A spare died (a device the plan leaves out, such as a slow GPU an earlier plan
                # excluded) and the running world still holds it: it sat in the commit all-reduce,
                # so the survivors wait for a plan, and a planner asked has nothing to propose.
                # Re-post the running plan as the next epoch: the world re-forms without it.
                dead_spares = sorted(set(result.dead) & set(intake.running_world) - set(intake.running.devices))
                if dead_spares:
                    spare_reposts.add(intake.running.epoch)
                    echo(f"spare devices {dead_spares} died: the running plan goes on without them")
                    bus.publish([factory.make(ReconfigureCommand(
                        command_id=uuid.uuid4().hex, plan_id=f"launcher-spare-{dead_spares[0]}",
                        plan=intake.running.model_copy(update={"epoch": intake.running.epoch + 1})))])
            if not alive:
                time.sleep(poll_s)
        for delivery in stream.poll(timeout_s=0):
            if (delivery.topic == topics.COMMANDS and delivery.event.job == spec.job
                    and isinstance(delivery.event.payload, ReconfigureCommand)):
                intake.offer_event(delivery.event)
        if rejected := intake.rejections():
            bus.publish(rejected)
        stream.commit()
        acks = intake.finish()
        for ack in acks:
            echo(f"command {ack.command_id[:8]} epoch {ack.epoch}: {ack.status.value} {ack.detail}")
        if acks:
            bus.publish([factory.make(a) for a in acks])
            result.acks += acks
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.terminate()
        for p in procs.values():
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
        stream.close()
        bus.close()
    result.final_plan = intake.running
    return result


def _plan_current(spec: RunSpec, plan: Plan, reason: str) -> PlanCurrent:
    """What the platform should know of the running job: its plan and the model's size."""
    d = spec.config.n_embd
    params_per_layer = 12 * d * d + 13 * d  # attention 4d², MLP 8d², biases and norms
    bytes_per_param = 4 * spec.config.torch_dtype.itemsize  # parameter, gradient, two AdamW moments
    return PlanCurrent(plan=plan, reason=reason, gpus_per_node=8, model_name=spec.job,
                       layer_state_bytes=params_per_layer * bytes_per_param,
                       tokens_per_microbatch=spec.config.block_size)


def _start_ranks(spec: RunSpec, ranks: int) -> dict:
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
    procs = {d: ctx.Process(target=_rank_main, args=(d, spec_json), name=f"rank-{d}") for d in range(ranks)}
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


def _progress(store) -> dict:
    if not store.check([PROGRESS]):
        return {"iteration": -1, "epoch": -1}
    return json.loads(store.get(PROGRESS))


__all__ = ["launch", "LaunchResult", "drop_replicas", "replace_with_spares", "on_death_plan", "KILL_EXIT_CODE"]
