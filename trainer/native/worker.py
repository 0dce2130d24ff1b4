"""One native rank process, and the local launcher that starts them.

The run is a ``NativeRunSpec``: the model, the first plan, and the reshapes to apply (each a
plan and the iteration boundary to apply it at — from a test, the benchmark, or ``resihp train
--native --reshape``). The ranks run under the node agent as the reference trainer's do
(trainer/agent/standalone.py): it hosts the store (so any rank may die) and forks one process per
device from a fork server that imported this module once; :class:`NativeController` marks the dead
lost and relays the bus's commands. Each rank trains, reshapes through
:class:`NativeExecutor`, publishes telemetry (one ``RankIteration`` per iteration, the schedule's
own chunk timings) and writes ``rank-<device>.json`` (losses, reshape phases, refusals) to
``out_dir``; replica 0's TP rank 0 of each stage also writes its stage's final full parameters to
``params-<device>.pt`` so a run can be compared with the single-process reference.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from collector.events import (Coords, FaultInjected, IterationSummary, Location, RankIteration, ReshapePhase,
                              ReshapePhaseName)
from collector.plan import Plan
from collector.settings import elastic_environment, environment
from collector.auth import load_keyring
from trainer.agent.signed_store import SignedStore, rank_role
from trainer.agent.standalone import standalone_node
from trainer.fault_spec import FaultSpec
from trainer.native.executor import NativeExecutor
from trainer.protocol import Released, ReshapeRefused
from trainer.native.faults import ChunkPadding
from trainer.native.intake import CommandFollower, NativeCommandIntake
from trainer.native.layout import NativeLayout
from trainer.native.recovery import mark_lost, peer_failure
from trainer.native.model import LlamaConfig, ModelFactory
from trainer.native.stage import NativeRole, TrainSettings
from trainer.native.state import full_params, load_dcp, save_dcp
from trainer.spec import BusSpec
from trainer.telemetry import TelemetryPublisher

log = logging.getLogger("resihp.trainer.native")


class ScheduledReshape(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at_iteration: int = Field(ge=1, description="applied before this iteration runs")
    plan: Plan


class ReshapeFault(BaseModel):
    """A test hook: ``device`` fails at the end of ``phase`` of the first reshape to ``epoch``
    that reaches it (every rank must then roll back to the running layout and train on)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: int = Field(ge=0)
    epoch: int = Field(ge=1)
    phase: Literal["export", "new_mesh", "stages_rebuilt", "redistribute"]


class NativeRunSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str = "resihp-native"
    model: dict = Field(default_factory=dict, description="LlamaConfig fields")
    model_factory: str = Field(default="trainer.native.model:build_model", description=(
        "module:function building the full model from (LlamaConfig, seed) — a user's own torchtitan-style "
        "decoder (see examples/native_user_model.py)"))
    settings: dict = Field(default_factory=dict, description="TrainSettings fields")
    plan: Plan
    reshapes: list[ScheduledReshape] = Field(default_factory=list)
    iterations: int = Field(default=10, ge=1)
    store_host: str = "127.0.0.1"
    store_port: int = 0
    run_id: str = ""  # what the store's signed records are bound to (trainer/agent/signed_store.py)
    timeout_s: float = Field(default=120.0, gt=0, description="collective and rendezvous timeout")
    device: str = Field(default="auto", description="auto: cuda + nccl when a GPU is present, else cpu + gloo")
    threads: int = Field(default=1, ge=1)
    out_dir: str | None = None
    save_dir: str | None = Field(default=None, description=(
        "DCP checkpoint of the final state here (and of every checkpoint_every-th iteration): what the "
        "survivors of a lost rank load the pieces no survivor holds from"))
    checkpoint_every: int = Field(default=0, ge=0, description="a DCP checkpoint to save_dir every K iterations")
    resume_dir: str | None = Field(default=None, description="start from a DCP checkpoint written by any layout")
    bus: BusSpec | None = None
    heartbeat_s: float = Field(default=1.0, gt=0)
    echo: bool = Field(default=False, description="world rank 0 prints each iteration's loss")
    reshape_faults: list[ReshapeFault] = Field(default_factory=list, description="test hook: failures to inject")
    commands: bool = Field(default=False, description=(
        "obey command.reconfigure from the bus (needs bus): the launcher announces the plan and this executor's "
        "capabilities, fences and acknowledges commands (trainer/native/intake.py)"))
    faults: list[FaultSpec] = Field(default_factory=list, description="slow_compute faults (trainer/native/faults.py)")
    tokens_per_microbatch: int = Field(default=0, ge=0, description="announced in plan.current for the planner")
    pace_s_per_layer_token: float = Field(default=0.0, ge=0, description=(
        "emulated device time: each chunk padded to layers × tokens × this / TP (backward twice), so CPU ranks on "
        "a shared machine behave like devices of a set speed (0: raw CPU)"))

    @property
    def config(self) -> LlamaConfig:
        return LlamaConfig(**self.model)

    @property
    def train_settings(self) -> TrainSettings:
        return TrainSettings(**self.settings)

    def factory(self) -> ModelFactory:
        module, _, name = self.model_factory.partition(":")
        return getattr(importlib.import_module(module), name)


def select_device(preference: str, device: int) -> tuple[torch.device, str]:
    """(torch device, process-group backend): CUDA with NCCL when asked for or, with ``auto``,
    when a GPU is present (devices spread over the visible GPUs); otherwise CPU with gloo."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for but torch sees no GPU; use --device cpu")
        index = device % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    return torch.device("cpu"), "gloo"


def run_rank(spec: NativeRunSpec, device: int) -> int:
    torch.set_num_threads(spec.threads)
    cfg, settings = spec.config, spec.train_settings
    torch_device, backend = select_device(spec.device, device)
    layout = NativeLayout.of(spec.plan, cfg)
    if device not in layout.world:
        return 0
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
    # One default group for the whole job, over its first world: later layouts use sub-groups of it.
    rank_of = {d: i for i, d in enumerate(layout.world)}
    dist.init_process_group(backend, store=dist.PrefixStore("native/pg/", store), rank=rank_of[device],
                            world_size=len(layout.world), timeout=timedelta(seconds=spec.timeout_s))
    telemetry = (TelemetryPublisher(spec.bus.open, spec.job, device, spec.heartbeat_s) if spec.bus else None)
    keyring = load_keyring()
    records = SignedStore(store, spec.run_id, reader=f"rank-{device}", keyring=keyring, role=rank_role(keyring),
                          report=telemetry.publish if telemetry is not None else None)
    at = {"iteration": 0}

    def on_phase(epoch: int, phase: str, seconds: float, ok: bool, detail: str) -> None:
        if telemetry is not None:
            telemetry.publish(ReshapePhase(executor="native", epoch=epoch, iteration=at["iteration"], rank=device,
                                           phase=ReshapePhaseName(phase), duration_s=seconds, ok=ok,
                                           detail=detail[:2_000]))

    ex = NativeExecutor(device, cfg, settings, rank_of, torch_device, spec.timeout_s,
                        checkpoint_dir=lambda: newest_checkpoint(spec), model_factory=spec.factory(), on_phase=on_phase,
                        fail_in=tuple((f.epoch, f.phase) for f in spec.reshape_faults if f.device == device))
    results: dict = {"device": device, "losses": {}, "walls": {}, "reshapes": [], "refused": [], "backend": backend}
    follower = CommandFollower(store, device, torch_device) if spec.commands else None
    padding = ChunkPadding(spec.faults, device, spec.pace_s_per_layer_token)
    try:
        ex.start(layout)
        assert ex.current is not None
        iteration = 0
        if spec.resume_dir:
            cur = ex.current
            iteration = load_dcp(spec.resume_dir, cur.model, cur.opt, cur.sched, cur.world)
        pending = {r.at_iteration: r.plan for r in spec.reshapes}
        first_step_of, post = None, None
        while iteration < spec.iterations:
            at["iteration"] = iteration
            plan = pending.pop(iteration, None)
            if plan is None and follower is not None and (posted := follower.next_plan(ex.current.world)) is not None:
                post, plan = posted
            if plan is not None:
                try:
                    report, rollback_to = ex.reshape(plan)
                    first_step_of = report
                    if rollback_to is not None:
                        iteration = rollback_to
                except ReshapeRefused as exc:
                    log.warning("device %d: plan refused, training on at epoch %d: %s", device,
                                ex.current.layout.plan.epoch, exc)
                    results["refused"].append(str(exc))
                    if follower is not None and post is not None:
                        follower.refused(post, str(exc))
                        post = None
            cur = ex.current
            padding.begin_iteration(iteration, cur.stage, cur.role)
            started = time.perf_counter()
            try:
                loss = cur.train_step(iteration, cfg, settings)
            except Exception as exc:
                if not peer_failure(exc):
                    raise
                # A peer died under this rank's collective: recover with the survivors and redo
                # this iteration, which nobody committed.
                report, rollback_to = ex.recover(records, iteration, exc, time.perf_counter() - started)
                first_step_of = report
                if rollback_to is not None:
                    iteration = rollback_to
                continue
            wall_s = time.perf_counter() - started
            if first_step_of is not None:
                first_step_of.phases_s["first_step"] = wall_s
                on_phase(first_step_of.epoch, "first_step", wall_s, True, "")
                results["reshapes"].append({"epoch": first_step_of.epoch, "source": first_step_of.source,
                                            "phases_s": first_step_of.phases_s, "cpu_s": first_step_of.cpu_s,
                                            "iteration": iteration,
                                            "groups_created": ex.groups.created, "lost": list(first_step_of.lost)})
                if follower is not None and post is not None:
                    follower.done(post, first_step_of.epoch, first_step_of.source, first_step_of.phases_s)
                if follower is not None and first_step_of.lost and cur.layout.rank(device) == 0:
                    follower.recovered(cur.layout.plan)
                first_step_of, post = None, None
            results["losses"][iteration] = loss
            results["epochs"] = {**results.get("epochs", {}), iteration: cur.layout.plan.epoch}
            if follower is not None:
                follower.stepped()
            results["walls"][iteration] = wall_s
            if spec.echo and cur.layout.rank(device) == 0:
                print(f"iteration {iteration} epoch {cur.layout.plan.epoch} loss {loss:.4f} ({wall_s:.3f} s)", flush=True)
            if telemetry is not None:
                _publish(telemetry, cur, device, iteration, wall_s, loss, settings)
                for f in padding.started(iteration):
                    telemetry.publish(FaultInjected(
                        fault_id=f.id or f"{spec.job}/{f.kind}/{device}/{iteration}", category=f.category,
                        location=Location(target="compute", rank=device, factor=f.factor),
                        start_iteration=iteration, end_iteration=f.end_iteration))
            iteration += 1
            if spec.save_dir and spec.checkpoint_every and iteration % spec.checkpoint_every == 0:
                save_dcp(spec.save_dir, cur.model, cur.opt, cur.sched, iteration, cur.world)
        cur = ex.current
        if spec.save_dir:
            save_dcp(spec.save_dir, cur.model, cur.opt, cur.sched, iteration, cur.world)
        params = full_params(cur.model)
        if spec.out_dir and cur.role.replica == 0 and cur.role.tp_rank == 0:
            torch.save(params, Path(spec.out_dir) / f"params-{device}.pt")
        results["final_epoch"] = cur.layout.plan.epoch
        dist.barrier(group=cur.world)
        return 0
    except Released:
        results["released"] = True
        return 0
    except Exception as exc:
        results["error"] = str(exc)
        raise
    finally:
        if spec.out_dir:
            (Path(spec.out_dir) / f"rank-{device}.json").write_text(json.dumps(results))
        if telemetry is not None:
            telemetry.close()


def newest_checkpoint(spec: NativeRunSpec) -> Path | None:
    """Where a reshape loads the keys no live piece covers: the periodic checkpoint of this run
    once one was written, else the checkpoint it resumed from."""
    if spec.save_dir and (Path(spec.save_dir) / "meta.pt").exists():
        return Path(spec.save_dir)
    return Path(spec.resume_dir) if spec.resume_dir else None


def _publish(telemetry: TelemetryPublisher, cur: NativeRole, device: int, iteration: int, wall_s: float,
             loss: float, settings: TrainSettings) -> None:
    plan, r, rec = cur.layout.plan, cur.role, cur.last_recorder
    telemetry.epoch, telemetry.iteration = plan.epoch, iteration
    telemetry.publish(RankIteration(
        epoch=plan.epoch, iteration=iteration, rank=device, coords=Coords(tp=r.tp_rank, pp=r.stage, dp=r.replica),
        wall_s=wall_s, chunks=rec.chunks if rec else [], comm=rec.comm if rec else []))
    if cur.layout.rank(device) == 0:
        telemetry.publish(IterationSummary(epoch=plan.epoch, iteration=iteration, loss=loss,
                                           tokens=plan.global_microbatches * settings.block_size, wall_s=wall_s))


def process_main(device: int, spec_json: str) -> None:
    """Entry point of a forked rank process; exits with the rank's code."""
    spec = NativeRunSpec.model_validate_json(spec_json)
    logging.basicConfig(level=environment().log,
                        format=f'{{"rank": {device}, "level": "%(levelname)s", "msg": "%(message)s"}}')
    code = 1
    try:
        code = run_rank(spec, device)
    except BaseException:
        log.exception("device %d failed", device)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch_native(spec: NativeRunSpec, ranks: int | None = None) -> dict[int, int]:
    """Run one process per device under the node agent (trainer/agent/standalone.py, the
    reference trainer's launcher too) until all exit; returns their exit codes (-1: never exited).
    Fails before any rank starts when commands are asked for without a bus or the store cannot bind."""
    if spec.commands and spec.bus is None:
        raise ValueError("commands from the bus need a bus: give the run spec one")
    devices = sorted(set(spec.plan.devices) | {d for r in spec.reshapes for d in r.plan.devices})
    ranks = ranks or max(devices) + 1
    if spec.out_dir:
        Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    run_id = uuid.uuid4().hex
    with standalone_node(spec.store_host, run_id, spec.timeout_s) as node:
        spec = spec.model_copy(update={"store_port": node.port, "run_id": run_id})
        intake = None
        if spec.commands:
            assert spec.bus is not None
            intake = NativeCommandIntake(spec.job, spec.plan, spec.config, node.store, spec.bus.open,
                                         spec.tokens_per_microbatch)
            intake.start()
        try:
            exits = node.run(job=spec.job, role="native", ranks=ranks, entrypoint=_rank_main,
                             args=(spec.model_dump_json(),), preload=(__name__,),
                             controller=NativeController(spec.plan, ranks, SignedStore(node.store, run_id, reader="native"),
                                                         intake), poll_s=0.05)
        finally:
            if intake is not None:
                intake.finish()
    return {d: exits.get(d, -1) for d in range(ranks)}


class NativeController:
    """The native executor's part of the agent's monitor loop: a rank that exits with an error is
    marked lost where its peers look (``resihp/lost/<rank>`` in the agent-hosted store), so the
    survivors close their quorum without it and train on (trainer/native/recovery.py); then the
    bus's commands go to the ranks (trainer/native/intake.py) when the run obeys them."""

    def __init__(self, plan: Plan, ranks: int, store: SignedStore, intake: NativeCommandIntake | None) -> None:
        self.ranks, self.store, self.intake = ranks, store, intake
        self.rank_of = {d: i for i, d in enumerate(plan.devices)}  # the job's default-group ranks (run_rank)
        self.seen: set[int] = set()

    def watch(self, exits: dict[int, int]) -> None:
        for d in sorted(set(exits) - self.seen):
            self.seen.add(d)
            if exits[d] != 0 and d in self.rank_of:
                mark_lost(self.store, self.rank_of[d], exits[d])
                log.warning("device %d exited with %s: marked lost", d, exits[d])
        if self.intake is not None and (alive := set(range(self.ranks)) - set(exits)):
            self.intake.poll(alive)


def _rank_main(spec_json: str) -> None:
    """A rank the agent forked (its server imported this module): its device is its global rank,
    torch elastic's ``RANK``."""
    process_main(elastic_environment().RANK, spec_json)


def read_results(out_dir: str | Path) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    """The ranks' result files and the final full parameters (union over stages)."""
    out = Path(out_dir)
    ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    params: dict[str, torch.Tensor] = {}
    for p in sorted(out.glob("params-*.pt")):
        params.update(torch.load(p, weights_only=True))
    return ranks, params


__all__ = ["NativeRunSpec", "ReshapeFault", "ScheduledReshape", "launch_native", "read_results", "select_device"]
