"""One native rank process, and the local launcher that starts them.

The run is a ``NativeRunSpec``: the model, the first plan, and the reshapes to apply (each a
plan and the iteration boundary to apply it at — from a test, the benchmark, or ``resihp train
--native --reshape``). The ranks run under the node agent as the reference trainer's do
(trainer/agent/standalone.py): it hosts the store (so any rank may die), forks one process per
device from a fork server that imported this module once and, as ``resihp run --on-failure
shrink`` does, marks a rank that dies lost; :class:`NativeController` relays the bus's commands.
The same rank runs under ``resihp run`` (trainer/native/job.py), finding its device, store and
keys the same way (:meth:`NativeRank.join`). Each rank trains, reshapes through
:class:`NativeExecutor`, publishes telemetry (one ``RankIteration`` per iteration, the schedule's
own chunk timings) and writes ``rank-<device>.json`` (losses, reshape phases, refusals) to
``out_dir``; replica 0's TP rank 0 of each stage also writes its stage's final full parameters to
``params-<device>.pt`` so a run can be compared with the single-process reference.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from collector.events import (Coords, FaultInjected, IterationSummary, Location, RankIteration, ReshapePhase,
                              ReshapePhaseName)
from collector.plan import Plan
from collector.settings import elastic_environment, environment
from trainer.agent.shrink import open_ranks_store, rank_records
from trainer.agent.standalone import standalone_node
from trainer.agent.wake import LossWatch
from trainer.fault_spec import FaultSpec
from trainer.native.executor import NativeExecutor, ReshapeReport
from trainer.protocol import Released, ReshapeRefused
from trainer.native.faults import ChunkPadding
from trainer.native.intake import CommandFollower, NativeCommandIntake
from trainer.native.layout import NativeLayout
from trainer.native.recovery import peer_failure
from trainer.native.model import LlamaConfig, ModelFactory
from trainer.native.stage import NativeRole, TrainSettings
from trainer.native.state import full_params, load_dcp, save_dcp
from trainer.spec import BusSpec
from trainer.telemetry import TelemetryPublisher

log = logging.getLogger("resihp.trainer.native")
# Between two reads of the loss count while a step lasts. Each read is a round trip to the ranks'
# store, and a native rank polls through its whole step (compute included, not only its waits on
# peers as the reference trainer does), so it reads 4x less often: 20 ms more to notice a loss, 50
# reads a second per rank on the store that every rank of the job shares.
WAKE_POLL_S = 0.02
T = TypeVar("T")


class ScheduledReshape(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at_iteration: int = Field(ge=1, description="applied before this iteration runs")
    plan: Plan


class ReshapeFault(BaseModel):
    """A test hook: ``device`` fails at the end of ``phase`` of the first reshape to ``epoch``
    that reaches it. ``raise``: an error every rank votes on (all roll back to the running layout
    and train on); ``kill``: the rank is SIGKILLed there, before the phase's vote (the survivors
    recover without it from the running layout)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: int = Field(ge=0)
    epoch: int = Field(ge=1)
    phase: Literal["export", "new_mesh", "stages_rebuilt", "redistribute"]
    action: Literal["raise", "kill"] = "raise"


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
    store_port: int = Field(default=0, description=(
        "set by launch_native when commands: its agent's store, where bus commands are posted (trainer/native/intake.py)"))
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


class NativeRank:
    """One rank's run as steps: :meth:`join` the job's process group, :meth:`train` (applying the
    scheduled and the bus's reshapes at iteration boundaries, and recovering with the survivors
    when a peer dies under a collective), :meth:`finish` (the final checkpoint and parameters);
    :meth:`close` writes the results file whatever happened. ``iteration`` is the next iteration
    to run: a reshape or a recovery that rolls back moves it back."""

    def __init__(self, spec: NativeRunSpec, device: int) -> None:
        torch.set_num_threads(spec.threads)
        self.spec, self.device = spec, device
        self.cfg, self.settings = spec.config, spec.train_settings
        self.torch_device, backend = select_device(spec.device, device)
        self.layout = NativeLayout.of(spec.plan, self.cfg)
        self.results: dict = {"device": device, "losses": {}, "walls": {}, "reshapes": [], "refused": [],
                              "backend": backend}
        self.backend = backend
        self.telemetry: TelemetryPublisher | None = None
        self.iteration = 0
        self.phase_iteration = 0  # the iteration a reshape's phases are published under: the one it came before
        self.first_step_of: ReshapeReport | None = None  # the reshape or recovery whose first step is next
        self.post: int | None = None  # the bus command being applied (trainer/native/intake.py)

    @property
    def in_world(self) -> bool:
        """Whether the first layout gives this device a place (a device only later plans use waits out)."""
        return self.device in self.layout.world

    def join(self) -> None:
        """One default process group for the whole job, over its first world (later layouts use
        sub-groups of it), with the executor, the bus's command follower and the compute faults.
        Fails when the store cannot be reached or the group does not form within the timeout."""
        spec, device = self.spec, self.device
        # The ranks' store, as the node agent that started this rank names it (the bootstrap store,
        # or the round's keys on etcd): where it counts and marks a dead rank lost, by global rank
        # (this device), under ``--on-failure shrink`` — the native launcher's agent runs that way too.
        store = open_ranks_store(spec.timeout_s)
        rank_of = {d: i for i, d in enumerate(self.layout.world)}
        dist.init_process_group(self.backend, store=dist.PrefixStore("native/pg/", store), rank=rank_of[device],
                                world_size=len(self.layout.world), timeout=timedelta(seconds=spec.timeout_s))
        self.telemetry = telemetry = (TelemetryPublisher(spec.bus.open, spec.job, device, spec.heartbeat_s)
                                      if spec.bus else None)
        self.records = rank_records(store, device)  # signed for the agent's rendezvous round
        self.records.report = telemetry.publish if telemetry is not None else None
        self.ex = NativeExecutor(device, self.cfg, self.settings, rank_of, self.torch_device, spec.timeout_s,
                                 checkpoint_dir=lambda: newest_checkpoint(spec), model_factory=spec.factory(),
                                 on_phase=self.on_phase,
                                 fail_in=tuple((f.epoch, f.phase) for f in spec.reshape_faults
                                               if f.device == device and f.action == "raise"),
                                 kill_in=tuple((f.epoch, f.phase) for f in spec.reshape_faults
                                               if f.device == device and f.action == "kill"))
        self.follower = CommandFollower(
            dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timedelta(seconds=spec.timeout_s)),
            device, self.torch_device) if spec.commands else None  # the launcher's intake posts in its agent's store
        # The launcher's controller counts each death in this store within its monitor interval
        # (mark_lost): a step blocked on a peer that already left ends then, not at the gloo timeout.
        self.watch = LossWatch(store, WAKE_POLL_S)
        self.padding = ChunkPadding(spec.faults, device, spec.pace_s_per_layer_token)

    def on_phase(self, epoch: int, phase: str, seconds: float, ok: bool, detail: str) -> None:
        if self.telemetry is not None:
            self.telemetry.publish(ReshapePhase(executor="native", epoch=epoch, iteration=self.phase_iteration,
                                                rank=self.device, phase=ReshapePhaseName(phase), duration_s=seconds,
                                                ok=ok, detail=detail[:2_000]))

    def train(self) -> None:
        """Start the first layout (from ``resume_dir`` when given) and run to ``spec.iterations``."""
        spec, ex = self.spec, self.ex
        ex.start(self.layout)
        assert ex.current is not None
        if spec.resume_dir:
            cur = ex.current
            self.iteration = load_dcp(spec.resume_dir, cur.model, cur.opt, cur.sched, cur.world)
        pending = {r.at_iteration: r.plan for r in spec.reshapes}
        while self.iteration < spec.iterations:
            self.phase_iteration = self.iteration
            self.reshape_if_due(pending)
            cur = ex.current
            assert cur is not None
            self.padding.begin_iteration(self.iteration, cur.stage, cur.role)
            started = time.perf_counter()
            try:
                committed = threading.Event()  # set once the step's commit all-reduce returned
                # On the loss watch's pool: the waits inside torch's pipelining and DTensor cannot be
                # sliced (trainer/agent/wake.py).
                loss = self.watch.call(functools.partial(self.on_this_device, functools.partial(
                    cur.train_step, self.iteration, self.cfg, self.settings, committed.set)), "train step",
                                       committed.is_set)
            except Exception as exc:
                if not peer_failure(exc):
                    raise
                # A peer died under this rank's collective: recover with the survivors and redo
                # this iteration, which nobody committed.
                self.recover(exc, time.perf_counter() - started)
                continue
            self.stepped(cur, loss, time.perf_counter() - started)
            self.iteration += 1
            if spec.save_dir and spec.checkpoint_every and self.iteration % spec.checkpoint_every == 0:
                save_dcp(spec.save_dir, cur.model, cur.opt, cur.sched, self.iteration, cur.world)

    def recover(self, failure: BaseException, failed_after_s: float) -> None:
        """A peer died under one of this rank's collectives (a step's, or a reshape's before its
        commit, which leaves the running layout as it was): re-form with the survivors at this
        iteration boundary. The quorum closes only once the agent marked every dead rank (after
        counting it): only a later loss should wake the watch."""
        self.resumed(*self.ex.recover(self.records, self.iteration, failure, failed_after_s))
        self.watch.rearm()

    def on_this_device(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread of the loss watch's pool, which starts on the default device: a GPU
        rank sets its own first; the thread's group creations belong to this rank's current
        generation (``GroupCache.bind``: none once a loss made the rank abandon the work)."""
        if self.torch_device.type == "cuda":
            torch.cuda.set_device(self.torch_device)
        self.ex.groups.bind()
        return fn()

    def reshape_if_due(self, pending: dict[int, Plan]) -> None:
        """Apply the plan scheduled before this iteration, else the bus's next command; a refused
        plan leaves the layout running (and is answered on the bus when it came from there)."""
        ex, follower = self.ex, self.follower
        assert ex.current is not None
        plan = pending.pop(self.iteration, None)
        if plan is None and follower is not None and (posted := follower.next_plan(ex.current.world)) is not None:
            self.post, plan = posted
        if plan is None:
            return
        started = time.perf_counter()
        committed = threading.Event()  # set once the commit vote passed: a loss after it is the next step's
        try:
            self.resumed(*self.watch.call(functools.partial(self.on_this_device, functools.partial(
                ex.reshape, plan, committed.set)), f"reshape to epoch {plan.epoch}", committed.is_set))
        except Released:
            if follower is not None and self.post is not None:
                follower.released(self.post)  # past the commit vote: its exit is not a death
            raise
        except ReshapeRefused as exc:
            log.warning("device %d: plan refused, training on at epoch %d: %s", self.device,
                        ex.current.layout.plan.epoch, exc)
            self.results["refused"].append(str(exc))
            if follower is not None and self.post is not None:
                follower.refused(self.post, str(exc))
                self.post = None
        except Exception as exc:
            if not peer_failure(exc):
                raise
            # A rank died mid-reshape, before the commit: the running layout is intact, so the
            # survivors recover from it as from a death while training; the plan is dropped.
            log.warning("device %d: a rank died during the reshape to epoch %d; recovering without it",
                        self.device, plan.epoch)
            self.results["refused"].append(f"reshape to epoch {plan.epoch}: a rank died during it ({exc})"[:500])
            if follower is not None and self.post is not None:
                follower.refused(self.post, f"a rank died during the reshape to epoch {plan.epoch}; the survivors "
                                 "recovered without it from the running layout")
                self.post = None
            self.recover(exc, time.perf_counter() - started)

    def resumed(self, report: ReshapeReport, rollback_to: int | None) -> None:
        """A reshape or recovery is done: its first step completes its report, and a roll-back
        sets the next iteration back to the one it restored."""
        self.first_step_of = report
        if rollback_to is not None:
            self.iteration = rollback_to

    def stepped(self, cur: NativeRole, loss: float, wall_s: float) -> None:
        """One iteration trained: its results, its telemetry, and the first step of a reshape."""
        spec, device, iteration = self.spec, self.device, self.iteration
        if self.first_step_of is not None:
            self.first_step_done(self.first_step_of, cur, wall_s)
        self.results["losses"][iteration] = loss
        self.results["epochs"] = {**self.results.get("epochs", {}), iteration: cur.layout.plan.epoch}
        if self.follower is not None:
            self.follower.stepped()
        self.results["walls"][iteration] = wall_s
        if spec.echo and cur.layout.rank(device) == 0:
            print(f"iteration {iteration} epoch {cur.layout.plan.epoch} loss {loss:.4f} ({wall_s:.3f} s)", flush=True)
        if self.telemetry is not None:
            _publish(self.telemetry, cur, device, iteration, wall_s, loss, self.settings)
            for f in self.padding.started(iteration):
                self.telemetry.publish(FaultInjected(
                    fault_id=f.id or f"{spec.job}/{f.kind}/{device}/{iteration}", category=f.category,
                    location=Location(target="compute", rank=device, factor=f.factor),
                    start_iteration=iteration, end_iteration=f.end_iteration))

    def first_step_done(self, report: ReshapeReport, cur: NativeRole, wall_s: float) -> None:
        """The first step after a reshape or recovery closes its report: its last phase, its
        result row, and the bus's answer (done, or recovered by world rank 0)."""
        report.phases_s["first_step"] = wall_s
        self.on_phase(report.epoch, "first_step", wall_s, True, "")
        self.results["reshapes"].append({"epoch": report.epoch, "source": report.source,
                                         "phases_s": report.phases_s, "cpu_s": report.cpu_s,
                                         "iteration": self.iteration,
                                         "groups_created": self.ex.groups.created, "lost": list(report.lost)})
        if self.follower is not None and self.post is not None:
            self.follower.done(self.post, report.epoch, report.source, report.phases_s)
        if self.follower is not None and report.lost and cur.layout.rank(self.device) == 0:
            self.follower.recovered(cur.layout.plan)
        self.first_step_of, self.post = None, None

    def finish(self) -> None:
        """The final checkpoint (``save_dir``), the stage's full parameters (replica 0's TP rank 0,
        to compare with the reference) and a barrier, so no rank leaves while a peer still saves."""
        spec, cur = self.spec, self.ex.current
        assert cur is not None
        if spec.save_dir:
            save_dcp(spec.save_dir, cur.model, cur.opt, cur.sched, self.iteration, cur.world)
        params = full_params(cur.model)
        if spec.out_dir and cur.role.replica == 0 and cur.role.tp_rank == 0:
            torch.save(params, Path(spec.out_dir) / f"params-{self.device}.pt")
        self.results["final_epoch"] = cur.layout.plan.epoch
        dist.barrier(group=cur.world)

    def close(self) -> None:
        if self.spec.out_dir:
            (Path(self.spec.out_dir) / f"rank-{self.device}.json").write_text(json.dumps(self.results))
        if self.telemetry is not None:
            self.telemetry.close()


def run_rank(spec: NativeRunSpec, device: int) -> int:
    """One rank from joining to its results file; 0 also when this device has no place in the
    first layout or the executor released it (a shrink left it out)."""
    rank = NativeRank(spec, device)
    if not rank.in_world:
        return 0
    rank.join()
    try:
        rank.train()
        rank.finish()
        return 0
    except Released:
        rank.results["released"] = True
        return 0
    except Exception as exc:
        rank.results["error"] = str(exc)
        raise
    finally:
        rank.close()


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
    The agent runs as ``resihp run --on-failure shrink`` does: it marks a rank that dies lost in
    the ranks' store and its peers recover without it (the same path as a job started with
    ``resihp run ... -m trainer.native.job``, trainer/native/job.py). Fails before any rank starts
    when commands are asked for without a bus or the store cannot bind."""
    if spec.commands and spec.bus is None:
        raise ValueError("commands from the bus need a bus: give the run spec one")
    devices = sorted(set(spec.plan.devices) | {d for r in spec.reshapes for d in r.plan.devices})
    ranks = ranks or max(devices) + 1
    if spec.out_dir:
        Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    with standalone_node(spec.store_host, uuid.uuid4().hex, spec.timeout_s) as node:
        spec = spec.model_copy(update={"store_port": node.port})
        intake = None
        if spec.commands:
            assert spec.bus is not None
            intake = NativeCommandIntake(spec.job, spec.plan, spec.config, node.store, spec.bus.open,
                                         spec.tokens_per_microbatch)
            intake.start()
        try:
            exits = node.run(job=spec.job, role="native", ranks=ranks, entrypoint=_rank_main,
                             args=(spec.model_dump_json(),), preload=(__name__,), on_failure="shrink",
                             controller=NativeController(ranks, intake) if intake is not None else None, poll_s=0.05)
        finally:
            if intake is not None:
                intake.finish()
    return {d: exits.get(d, -1) for d in range(ranks)}


class NativeController:
    """The native launcher's part of the agent's monitor loop: the bus's commands go to the ranks
    (trainer/native/intake.py). A rank that dies is the agent's to mark lost (``--on-failure
    shrink``, trainer/agent/node.py), as under ``resihp run``."""

    def __init__(self, ranks: int, intake: NativeCommandIntake) -> None:
        self.ranks, self.intake = ranks, intake

    def watch(self, exits: dict[int, int]) -> None:
        if alive := set(range(self.ranks)) - set(exits):
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
