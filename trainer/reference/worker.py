"""One rank process: build its part of the model for the current plan, train, reshape on command.

The loop, per iteration: inject faults due now; run this rank's pipeline
schedule (1F1B, interleaved or zero-bubble, as the plan names); reduce gradients
across replicas; *commit* — one small all-reduce over the whole world that carries each replica's
loss and the number of the newest plan post any rank has seen in the store; only then step the
optimizer. If anything in the iteration raises (a peer died: its neighbours at once, the rest as soon
as the launcher counts the loss, trainer/agent/wake.py), no rank has stepped, gradients are dropped, and the executor recovers
from the last committed state. After a commit that saw a newer post, every rank reshapes at this
same boundary. With ``checkpoint_every`` K, every K committed iterations all ranks also write a
periodic disk checkpoint (trainer/reference/checkpoint.py), the fallback when no live copy survives.

The store keys the launcher and the ranks share are in trainer/reference/rendezvous.py (the launcher's node
agent hosts the TCPStore, so any rank may die).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from collector import logs
from collector.events import Coords, FaultInjected, IterationSummary, Location, RankIteration
from collector.plan import RankRole
from collector.settings import environment
from trainer.reference.chunks import role_chunks
from trainer.data import global_targets, microbatch, replica_microbatch_ids
from trainer.faults import FaultInjector
from trainer.reference.model import GPTStage, init_stage
from trainer.reference.optim import AdamW
from trainer.reference.parallel import (GradReducer, Groups, PlanWorld, apply_dp, apply_pp, apply_tp, build_groups,
                              build_world_group)
from trainer.reference.schedule import PipelineSchedule
from trainer.reference.spec import RunSpec
from trainer.reference.checkpoint import load_checkpoint, periodic_dir, prune_periodic, save_checkpoint
from trainer.reference.probe import run_probe
from collector.auth import load_keyring
from trainer.agent.signed_store import SignedStore, rank_role
from trainer.agent import wake
from trainer.reference.rendezvous import (PROGRESS, Post, await_arrivals, await_first_post, newest_post_and_probe, pg_prefix,
                                read_probe)
from trainer.reference.state import import_state, make_optimizer
from trainer.telemetry import IterationRecorder, TelemetryPublisher

log = logging.getLogger("resihp.trainer")
WAKE_POLL_S = 0.005  # between two reads of the loss count while a wait on a peer lasts


@dataclass
class StageWork:
    """What a device with a place in the plan trains: its coordinates, its stage of the model, the
    stage's optimizer, the DP reducer and the pipeline schedule. A spare has none of them."""

    role: RankRole
    stage: GPTStage
    opt: AdamW
    reducer: GradReducer
    schedule: PipelineSchedule


@dataclass
class Role:
    """Everything this device runs under one epoch's plan (``work`` is None for a spare, which
    still takes part in the world's commit all-reduce)."""

    layout: PlanWorld
    groups: Groups
    train_group: dist.ProcessGroup
    work: StageWork | None = None


class Trainer:
    """The state of one rank process across epochs; the executor swaps its ``current`` role."""

    def __init__(self, spec: RunSpec, device: int, store: dist.Store) -> None:
        self.spec, self.device, self.store = spec, device, store
        self.cfg = spec.config
        self.iteration = 0
        self.faults = FaultInjector(spec.faults, device)
        self.current: Role | None = None
        self.post = -1  # the number of the post (trainer/reference/rendezvous.py) whose plan this rank runs
        self.probes_done = 0  # the newest probe request (trainer/reference/rendezvous.py) this rank answered
        self.probes_due: range = range(0)
        self.telemetry = (TelemetryPublisher(spec.bus.open, spec.job, device, spec.heartbeat_s)
                          if spec.telemetry else None)
        # What the launcher and the other ranks write in the store, signed for this run: a record a
        # stranger wrote is refused and reported (trainer/agent/signed_store.py).
        keyring = load_keyring()
        self.records = SignedStore(store, spec.run_id or "", reader=f"rank-{device}", keyring=keyring,
                                   role=rank_role(keyring),
                                   report=self.telemetry.publish if self.telemetry is not None else None)

    # ---- building a role -------------------------------------------------------------------------

    @property
    def running(self) -> Role:
        """The role under the running epoch: there is one from the first plan's build on."""
        if self.current is None:
            raise RuntimeError(f"device {self.device} has no role yet; build one for the first plan before training")
        return self.current

    def epoch(self) -> int:
        return self.current.layout.plan.epoch if self.current else -1

    def join_world(self, post: Post) -> PlanWorld | None:
        """Re-create the default process group for ``post`` (None: this device is not in its world).

        Leaves the old group first — that also wakes any peer still blocked on a receive from this
        rank — then waits until every device of the world arrived (``PostAborted`` if the launcher
        gives up on the post because one of them died) before the c10d rendezvous."""
        if self.device not in post.world:
            return None
        if dist.is_initialized():
            dist.destroy_process_group()
        await_arrivals(self.records, post.number, post.world, self.device, self.spec.rendezvous_timeout_s)
        self.faults.begin_rendezvous(self.iteration)
        prefixed = dist.PrefixStore(pg_prefix(post.number), self.store)
        dist.init_process_group("gloo", store=prefixed, rank=post.world.index(self.device), world_size=len(post.world),
                                timeout=timedelta(seconds=self.spec.rendezvous_timeout_s))
        wake.rearm()  # the new world holds no rank lost so far: only a later loss wakes its waits
        return PlanWorld(post.plan, post.world)

    def build(self, layout: PlanWorld, state=None) -> Role:
        """The TP, PP and DP steps for this device under ``layout``; loads ``state`` if given."""
        train_group = build_world_group(layout, self.spec.pg_timeout_s)
        groups = build_groups(layout, self.spec.pg_timeout_s)
        role = Role(layout, groups, train_group)
        if self.device not in layout.plan.roles:
            return role
        rr = layout.plan.role_of(self.device)
        tp = apply_tp(layout.plan, rr, groups)
        stage = apply_pp(self.cfg, layout.plan, rr, tp)
        init_stage(stage, self.spec.seed)
        opt = make_optimizer(stage, self.spec.lr, self.spec.weight_decay, self.iteration)
        if state is not None:
            import_state(stage, opt, state, self.iteration)
        role.work = self._stage_work(layout, rr, stage, opt, groups, train_group)
        return role

    def _stage_work(self, layout: PlanWorld, rr: RankRole, stage: GPTStage, opt: AdamW, groups: Groups,
                    train_group: dist.ProcessGroup) -> StageWork:
        """The DP step and the schedule around a built ``stage``: what reads the plan's counts."""
        return StageWork(rr, stage, opt, apply_dp(stage, layout, rr, groups),
                         PipelineSchedule.for_plan(stage, layout, rr, self.faults, self.spec.pace_s_per_layer_token,
                                                   group=train_group))

    def reassign(self, layout: PlanWorld) -> Role:
        """The running role under ``layout``, whose plan differs from the running one only in
        micro-batch counts (:func:`keeps_groups`): the process groups, the stage and its optimizer
        state stay as they are; only what reads the counts is rebuilt (the role, the schedule, the
        DP reducer's view of the plan)."""
        cur = self.running
        role = Role(layout, cur.groups, cur.train_group)
        if self.device not in layout.plan.roles:
            return role
        if cur.work is None:
            raise RuntimeError(f"device {self.device} is a spare and gets a stage under epoch {layout.plan.epoch}; "
                               "that needs a rebuild, not a reassignment")
        rr = layout.plan.role_of(self.device)
        role.work = self._stage_work(layout, rr, cur.work.stage, cur.work.opt, cur.groups, cur.train_group)
        return role

    # ---- one iteration ---------------------------------------------------------------------------

    def train_step(self) -> tuple[float, int, float]:
        """Run, reduce, commit, step. Returns (global loss, newest post seen by any rank, wall s)."""
        cur = self.running
        plan = cur.layout.plan
        rec = IterationRecorder()
        denom = global_targets(self.spec.seed, self.iteration, plan.global_microbatches, self.cfg.block_size)
        commit = torch.zeros(plan.dp + 3, dtype=torch.float64)
        if (work := cur.work) is not None:
            work.stage.tp.timer = rec.tp_timer
            work.reducer.timer = rec.dp_timer
            ids = replica_microbatch_ids(plan, work.role.replica)
            mbs = [microbatch(self.spec.seed, self.iteration, m, self.cfg.vocab_size, self.cfg.block_size) for m in ids]
            for p in work.stage.parameters():
                p.grad = None
            loss = work.schedule.run(mbs, denom, rec)
            work.reducer.reduce()
            if work.stage.is_last:
                commit[plan.pipelines.index(next(p for p in plan.pipelines if p.replica == work.role.replica))] = loss
        newest_post_seen, newest_probe_seen = newest_post_and_probe(self.records, self.post, self.probes_done)
        commit[-3] = float(newest_probe_seen)
        commit[-2] = -float(self.probes_done)  # MAX of the negatives: the world's fewest answered
        commit[-1] = float(newest_post_seen)
        wake.wait(dist.all_reduce(commit, op=dist.ReduceOp.MAX, group=cur.train_group, async_op=True), "commit all_reduce")
        if cur.work is not None:
            cur.work.opt.step()
        wall_s = rec.now_s()
        loss = float(commit[:-3].sum())
        self._report(rec, wall_s, loss)
        self.probes_due = range(int(-commit[-2]) + 1, int(commit[-3]) + 1)
        return loss, int(commit[-1]), wall_s

    def answer_probes(self) -> None:
        """Run the probes the last commit agreed are due (every world member, in order) and publish
        this device's answers to those it was asked and had not answered yet (trainer/reference/probe.py)."""
        cur = self.running
        for number in self.probes_due:
            request = read_probe(self.records, number)
            if request is None:  # refused (reported); every rank read the same bytes and skips it
                self.probes_done = max(self.probes_done, number)
                continue
            result = run_probe(request, self.device, cur.layout.rank(self.device), len(cur.layout.world),
                               cur.train_group, self.cfg, self.faults, self.spec.pace_s_per_layer_token)
            if result is not None and number > self.probes_done and self.telemetry is not None:
                self.telemetry.publish(result)
            self.probes_done = max(self.probes_done, number)
        self.probes_due = range(0)

    def _report(self, rec: IterationRecorder, wall_s: float, loss: float) -> None:
        cur = self.running
        plan = cur.layout.plan
        if self.telemetry is not None:
            self.telemetry.epoch, self.telemetry.iteration = plan.epoch, self.iteration
            if cur.work is not None:
                r = cur.work.role
                self.telemetry.publish(RankIteration(
                    epoch=plan.epoch, iteration=self.iteration, rank=self.device,
                    coords=Coords(tp=r.tp_rank, pp=r.stage, dp=r.replica), wall_s=wall_s,
                    chunks=rec.chunks, comm=rec.comm))
            if cur.layout.rank(self.device) == 0:
                self.telemetry.publish(IterationSummary(
                    epoch=plan.epoch, iteration=self.iteration, loss=loss,
                    tokens=plan.global_microbatches * self.cfg.block_size, wall_s=wall_s))
            for f in self.faults.started(self.iteration):
                if f.kind in ("slow_compute", "slow_send"):
                    self.telemetry.publish(FaultInjected(
                        fault_id=f"{self.spec.job}/{f.kind}/{f.device}/{self.iteration}",
                        category=f.category,
                        location=Location(target="compute" if f.kind == "slow_compute" else "link", rank=f.device,
                                          factor=f.factor),
                        start_iteration=self.iteration, end_iteration=f.end_iteration))
        if cur.layout.rank(self.device) == 0:
            self.records.set(PROGRESS, {"iteration": self.iteration, "epoch": plan.epoch, "loss": loss})

    def drop_gradients(self) -> None:
        if self.current is not None and self.current.work is not None:
            for p in self.current.work.stage.parameters():
                p.grad = None

    def save(self, directory: str | Path) -> None:
        """Every world member: write a complete checkpoint of the committed state to ``directory``."""
        cur = self.running
        work = cur.work
        stage, opt, tp_devices = None, None, None
        if work is not None:
            pipe = next(p for p in cur.layout.plan.pipelines if p.replica == work.role.replica)
            stage, opt, tp_devices = work.stage, work.opt, pipe.stages[work.role.stage].devices

        def barrier() -> None:
            dist.barrier(group=cur.train_group)

        save_checkpoint(directory, cur.layout, self.device, stage, opt, self.iteration, tp_devices, barrier=barrier,
                        run_id=self.spec.run_id)

    def checkpoint_due(self) -> bool:
        every = self.spec.checkpoint_every
        return bool(every and self.spec.save_dir and self.iteration % every == 0
                    and self.iteration < self.spec.iterations)

    def save_periodic(self) -> None:
        """The periodic checkpoint (``checkpoint_every``); world rank 0 prunes the older ones."""
        save_dir = self.spec.save_dir
        if save_dir is None:
            raise ValueError("a periodic checkpoint needs a directory; run with --save-dir DIR")
        self.save(periodic_dir(save_dir, self.iteration))
        if self.running.layout.rank(self.device) == 0:
            prune_periodic(save_dir, self.spec.run_id)


_progress = logging.getLogger("resihp.trace")


def _t(what: str) -> None:
    """A progress line (``RESIHP_TRACE``): where a rank is, for reading a hang or a slow reshape."""
    _progress.info(what)


def run_rank(spec: RunSpec, device: int) -> int:
    """The process body: join epoch 0, train, reshape on command, save, exit."""
    from trainer.reference.executor import Executor
    from trainer.protocol import Released

    torch.set_num_threads(spec.threads)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                          timeout=timedelta(seconds=spec.rendezvous_timeout_s))
    trainer = Trainer(spec, device, store)
    # The launcher's controller counts each death in this store within its monitor interval: every
    # wait on a peer (trainer/agent/wake.py) then ends at once instead of at --pg-timeout.
    wake.watch_losses(store, WAKE_POLL_S)
    executor = Executor(trainer)
    try:
        post = await_first_post(trainer.records, spec.rendezvous_timeout_s)
        layout = trainer.join_world(post)
        if layout is None:
            return 0
        trainer.post = post.number
        state = None
        if spec.resume_dir:
            rr = layout.plan.roles.get(device)
            if rr is not None:
                state, trainer.iteration = load_checkpoint(spec.resume_dir, trainer.cfg, role_chunks(layout.plan, rr),
                                                           rr.tp_degree, rr.tp_rank)
            else:
                trainer.iteration = json.loads((Path(spec.resume_dir) / "meta.json").read_text())["iteration"]
        _t("joined")
        trainer.current = trainer.build(layout, state)
        _t("built")
        while trainer.iteration < spec.iterations:
            trainer.faults.begin_iteration(trainer.iteration)
            try:
                _, newest, wall_s = trainer.train_step()
            except (RuntimeError, dist.DistError) as exc:  # a peer died or timed out: recover
                trainer.drop_gradients()
                executor.recover(exc)
                continue
            trainer.iteration += 1
            executor.note_iteration(wall_s)
            try:
                trainer.answer_probes()
            except (RuntimeError, dist.DistError) as exc:  # a peer died while probing: the step stands
                executor.recover(exc)
                continue
            if trainer.checkpoint_due():
                try:
                    trainer.save_periodic()
                except (RuntimeError, dist.DistError) as exc:  # a peer died while saving: the step stands
                    executor.recover(exc)
                    continue
            if newest > trainer.post and trainer.iteration < spec.iterations:
                executor.reshape(newest)
        _t("trained")
        if spec.save_dir:
            trainer.save(spec.save_dir)
        _t("saved")
        return 0
    except Released:
        return 0
    finally:
        if trainer.telemetry is not None:
            trainer.telemetry.close()
        _t("closed")


def process_main(device: int, spec_json: str) -> None:
    """Entry point of a rank process. Exits with the rank's code, skipping interpreter teardown:
    gloo pairs to a dead peer need no goodbye."""
    spec = RunSpec.model_validate_json(spec_json)
    env = environment()
    logs.configure(env.log, fmt=env.log_format, job=spec.job, rank=device)
    if env.trace:
        logging.getLogger("resihp.trace").setLevel(logging.INFO)
    code = 1
    try:
        code = run_rank(spec, device)
    except BaseException:
        logging.getLogger("resihp.trainer").exception("device %d failed", device)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
