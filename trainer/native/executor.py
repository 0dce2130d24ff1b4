"""The native executor: reshapes a running native rank to the next plan, step by step.

The executor protocol (trainer/protocol.py) on torch's own parallelism; its steps publish finer
phases (``telemetry.reshape_phase``), rebuild as two:

    reshape(P):  agree → export → rebuild (new_mesh → stages_rebuilt) → restore (redistribute) → resume (first step)

* agree — check P against what a DeviceMesh can run (``refusal``: a plan it cannot run is
  refused *here*, on every rank alike, before anything stops) and confirm with one all-reduce
  over the running world that every rank moves to the same epoch. A plan that changes only
  micro-batch counts stops here: groups, stages and optimizer are kept, only the schedule is new.
* export — this rank's pieces of its stage's state, read locally (trainer/native/state.py).
* new_mesh — the groups of the new layout, each created once per rank set and reused
  (trainer/native/groups.py), and the new DeviceMesh over them; the old layout's groups stay alive.
* stages_rebuilt — on that mesh: stage model, TP/FSDP, PipelineStage, schedule, optimizer;
  every rank cuts its own shards, so no collective runs.
* redistribute — every key the new stage needs comes from live pieces over the union of the old
  and the new world; if some key has none, all ranks load the newest DCP checkpoint instead.

Each phase is timed (``phases_s``; the worker adds first_step) and handed to ``on_phase`` (the
worker publishes it as a ``telemetry.reshape_phase`` event).

Rollback: the old layout is only read until the very end, so any failure on any rank past
``agree`` rolls every rank back to it. A rank that failed still attends the votes — one MIN
all-reduce over the union of both worlds after export, after stages_rebuilt and after
redistribute (the commit) — so no rank is left waiting in a collective its peer skipped; on a
failed vote every rank drops what it built and ``ReshapeFailed`` says why, training going on at
the old layout. A device outside the new world sends its pieces and leaves only once the
commit vote passed. A rank that *dies* mid-reshape is not this path: its peers wake on the loss
count and recover from the old layout (below).

Recovery (``recover``): a rank died while the job trained. ``agree`` becomes the survivors'
quorum in the store (trainer/native/recovery.py: who joined, who the launcher marked lost), the
plan re-forms the dead rank's TP group around its peers (or drops its replica when that stage
cannot go on) and keeps the global batch, every cached group is abandoned,
and the same four phases run over a fresh group of the survivors; nothing to roll back to.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from collector.plan import Plan
from trainer.agent.signed_store import SignedStore
from trainer.native.capabilities import refusal
from trainer.native.groups import GroupCache
from trainer.native.layout import NativeLayout, tp_fit_problem
from trainer.native.model import LlamaConfig, ModelFactory, build_model
from trainer.native.parallelize import build_mesh, stage_group
from trainer.native.recovery import close_quorum, survivor_plan
from trainer.native.stage import NativeRole, TrainSettings
from trainer.native.state import LocalState, exchange, load_dcp, load_full, local_state, needed_keys
from trainer.protocol import Released, ReshapeExecutor, ReshapeFailed, ReshapeRefused

log = logging.getLogger("resihp.trainer.native")

T = TypeVar("T")

PHASES = ("agree", "export", "new_mesh", "stages_rebuilt", "redistribute", "first_step")


class InjectedFailure(RuntimeError):
    """Raised by the test hook ``fail_in`` at the end of a phase."""


@dataclass
class ReshapeReport:
    epoch: int
    source: str = "live"
    lost: tuple[int, ...] = ()  # devices whose death this reshape recovered from (``recover``)
    phases_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # this process's CPU per phase, its gloo threads' too

    @property
    def pause_s(self) -> float:
        return sum(self.phases_s.values())


PhaseHook = Callable[[int, str, float, bool, str], None]  # (epoch, phase, seconds, ok, detail)


class NativeExecutor(ReshapeExecutor):
    """Owns the reconfiguration protocol (trainer/protocol.py) of one native rank. ``rank_of`` maps each device of the
    job's first world to its rank in the default group, which lives as long as the job."""

    def __init__(self, device: int, cfg: LlamaConfig, settings: TrainSettings, rank_of: dict[int, int],
                 torch_device: torch.device, timeout_s: float,
                 checkpoint_dir: Callable[[], Path | None] = lambda: None,
                 model_factory: ModelFactory = build_model, on_phase: PhaseHook | None = None,
                 fail_in: tuple[tuple[int, str], ...] = (), kill_in: tuple[tuple[int, str], ...] = ()) -> None:
        self.device, self.cfg, self.settings, self.rank_of = device, cfg, settings, rank_of
        self.torch_device, self.timeout_s = torch_device, timeout_s
        self.checkpoint_dir = checkpoint_dir
        self.model_factory = model_factory
        self.on_phase = on_phase or (lambda *_: None)
        self.fail_in = set(fail_in)  # (epoch, phase): the test hook that makes this rank fail there, once
        self.kill_in = set(kill_in)  # (epoch, phase): the test hook that SIGKILLs this rank there
        self.groups = GroupCache(timeout_s)
        self.current: NativeRole | None = None
        self.reports: list[ReshapeReport] = []

    def start(self, layout: NativeLayout) -> None:
        """The first layout: its groups and stage (initial weights)."""
        self.current = NativeRole.build(layout, self.device, self.cfg, self.settings, self.torch_device, self.groups,
                                        self.rank_of, self.model_factory)

    # ---- the steps -------------------------------------------------------------------------------

    def agree(self, plan: Plan) -> NativeLayout:
        """The new layout, or ``ReshapeRefused`` (nothing stopped): the plan breaks a mesh rule,
        is not the running epoch + 1, names a device outside the job's world, or the ranks do not
        all hold the same plan."""
        cur = self.current
        assert cur is not None
        running = cur.layout.plan.epoch
        if reason := refusal(plan, self.cfg, running):
            raise ReshapeRefused(reason)
        if strangers := sorted(set(plan.devices) - set(self.rank_of)):
            raise ReshapeRefused(f"plan epoch {plan.epoch} names devices {strangers} outside this job's world "
                                 f"{sorted(self.rank_of)}; devices cannot join a running native job")
        layout = NativeLayout.of(plan, self.cfg)
        crc = zlib.crc32(plan.model_dump_json().encode())
        seen = torch.tensor([plan.epoch, -plan.epoch, crc, -crc], dtype=torch.float64, device=self.torch_device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=cur.world)  # one collective: max and -min
        if not (seen[0] == -seen[1] and seen[2] == -seen[3]):
            raise ReshapeRefused(f"ranks disagree on the plan of epoch {plan.epoch}; keeping epoch {running}")
        return layout

    def _vote(self, failure: BaseException | None, group: dist.ProcessGroup, phase: str) -> None:
        """Every rank of both worlds: go on only if no rank failed so far."""
        ok = torch.tensor([0.0 if failure else 1.0])  # CPU: the union group is gloo (groups.py)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if failure is not None:
            raise ReshapeFailed(f"device {self.device} failed in {phase}: {failure}") from failure
        if float(ok) < 1:
            raise ReshapeFailed(f"a peer failed by the end of {phase}")

    def _inject(self, epoch: int, phase: str) -> None:
        if (epoch, phase) in self.kill_in:  # a death mid-reshape: no vote, no goodbye
            os.kill(os.getpid(), signal.SIGKILL)
        if (epoch, phase) in self.fail_in:
            self.fail_in.discard((epoch, phase))
            raise InjectedFailure(f"injected failure in {phase} of epoch {epoch}")

    # ---- the protocol ------------------------------------------------------------------------------

    def reshape(self, plan: Plan, on_commit: Callable[[], None] = lambda: None) -> tuple[ReshapeReport, int | None]:
        """Move to ``plan`` at this iteration boundary. Returns the report and, after a disk
        fallback, the iteration to resume from. ``ReshapeRefused`` (or ``ReshapeFailed``): still
        at the old layout. ``Released``: this device is not in the new world. ``on_commit`` is
        called once the commit vote passed (what is left is local).

        A rank that *dies* mid-reshape makes a collective raise or never end: the worker runs the
        reshape on the loss watch's pool and, on a loss before the commit, recovers from the old
        layout, which nothing changed (``recover``; groups this abandoned work would still create
        are refused it, ``GroupCache.bind``)."""
        old = self.current
        assert old is not None
        report = ReshapeReport(plan.epoch)
        lap = self._lap(report)
        try:
            layout = self.agree(plan)
        except ReshapeRefused as exc:
            lap("agree", False, str(exc))
            raise
        if old.layout.same_stages(layout):
            self.current = old.with_counts(layout, self.device)
            report.source = "groups kept"
            lap("agree", detail="micro-batch counts only: groups, stages and optimizer kept")
            self.reports.append(report)
            return report, None
        lap("agree")
        union = self.groups.get("moves", [self.rank_of[d] for d in set(old.layout.world) | set(layout.world)],
                                plan.epoch)
        try:
            rollback_to = self._move(old, layout, union, report, lap, on_commit)
        except ReshapeFailed as exc:
            lap("rollback", False, str(exc))
            log.warning("device %d: reshape to epoch %d rolled back, training on at epoch %d: %s", self.device,
                        plan.epoch, old.layout.plan.epoch, exc)
            raise
        return report, rollback_to

    def recover(self, store: SignedStore, committed: int, failure: BaseException,
                failed_after_s: float = 0.0) -> tuple[ReshapeReport, int | None]:
        """A collective of the running layout failed because a rank died: close the quorum of
        survivors (trainer/native/recovery.py), then move to ``survivor_plan`` through the same
        phases as a reshape, over groups made afresh by the survivors only. ``agree`` here is the
        quorum, not an all-reduce (the running world holds the dead rank); the state comes from
        the survivors' pieces, or from the newest DCP checkpoint when some piece died with its
        only holder. There is no layout to roll back to: a failed phase raises ``RuntimeError``.
        ``Released``: this survivor's replica was dropped (it sent its pieces first)."""
        old = self.current
        assert old is not None
        running = old.layout.plan
        report = ReshapeReport(running.epoch + 1)
        lap = self._lap(report)  # agree: from the failure to the survivors' quorum
        quorum = close_quorum(store, running.epoch + 1, old.layout.world, self.device, committed, self.timeout_s)
        plan = survivor_plan(running, quorum.lost, lambda tp: tp_fit_problem(self.cfg, tp) is None)
        if reason := refusal(plan, self.cfg, running.epoch):
            raise RuntimeError(f"devices {list(quorum.lost)} lost and the survivors' plan cannot run: {reason}")
        layout = NativeLayout.of(plan, self.cfg)
        self.groups.forget()
        report.lost = quorum.lost
        cause = str(failure).splitlines()[0][:200] if str(failure) else type(failure).__name__
        lap("agree", detail=f"devices {list(quorum.lost)} lost ({cause}; the step failed after {failed_after_s:.3f} s); "
                            f"survivors {list(quorum.survivors)} go on at {plan.shape()}")
        union = self.groups.get("moves", [self.rank_of[d] for d in quorum.survivors], plan.epoch)
        try:
            rollback_to = self._move(old, layout, union, report, lap)
        except ReshapeFailed as exc:
            lap("rollback", False, str(exc))
            raise RuntimeError(f"recovery from the loss of devices {list(quorum.lost)} failed: {exc}") from exc
        return report, rollback_to

    def _lap(self, report: ReshapeReport) -> Callable[..., None]:
        """A stopwatch: each call ends a phase, records its wall time and its CPU (process time:
        what a phase costs a shared machine, waits excluded) in ``report`` and hands it to ``on_phase``."""
        t, cpu = time.perf_counter(), time.process_time()

        def lap(name: str, ok: bool = True, detail: str = "") -> None:
            nonlocal t, cpu
            now, cpu_now = time.perf_counter(), time.process_time()
            report.phases_s[name] = now - t
            report.cpu_s[name] = cpu_now - cpu
            self.on_phase(report.epoch, name, now - t, ok, detail)
            t, cpu = now, cpu_now
        return lap

    def export(self) -> LocalState:
        """This rank's pieces of the running stage's state, read locally (cannot fail short of a bug)."""
        old = self.current
        assert old is not None
        return local_state(old.params, old.opt, old.sched)

    def new_mesh(self, layout: NativeLayout) -> DeviceMesh:
        """The first half of :meth:`rebuild`: every group the new layout needs, made now by its
        members (the stage build finds them: the stage's group across replicas when it sums full
        gradients, and the one-rank group torch's stage is built on), and the DeviceMesh over
        them. A group that never forms fails here (a member died)."""
        self.groups.get("world", [self.rank_of[d] for d in layout.world], layout.plan.epoch)
        self.groups.get("solo", [self.rank_of[self.device]], layout.plan.epoch)
        stage_group(layout, self.groups, self.rank_of, self.device)
        return build_mesh(layout, self.torch_device.type, self.groups, self.rank_of, self.device)

    def rebuild(self, layout: NativeLayout, mesh: DeviceMesh) -> NativeRole:
        """This device's stage on ``mesh``: model, TP/FSDP, PipelineStage, schedule, optimizer
        (every rank cuts its own shards: no collective)."""
        return NativeRole.build(layout, self.device, self.cfg, self.settings, self.torch_device, self.groups,
                                self.rank_of, self.model_factory, mesh)

    def restore(self, role: NativeRole | None, mine: LocalState | None, union: dist.ProcessGroup
                ) -> tuple[str, int | None]:
        """Every key ``role`` needs from the live pieces over ``union`` (a device leaving the world
        only sends), else the newest DCP checkpoint. Returns the source and, after the disk
        fallback, the iteration to resume from."""
        needed = needed_keys(role.model) if role is not None else {}
        state, missing = exchange(mine, needed, union, self.cfg.torch_dtype)
        if role is not None and not missing:
            load_full(role.model, role.opt, role.sched, state)
        elif role is not None:
            return self._from_checkpoint(role, missing)
        return "live", None

    def resume(self, layout: NativeLayout, role: NativeRole | None, report: ReshapeReport) -> None:
        """Commit ``layout`` (every vote passed): this rank trains on ``role`` from the next step,
        or leaves (``Released``) when it has no place in the new world."""
        if role is None:
            self.current = None
            raise Released(f"device {self.device} is not in the world of epoch {layout.plan.epoch}")
        self.current = role
        self.reports.append(report)
        log.info("device %d: epoch %d %s from %s in %.3f s", self.device, layout.plan.epoch, layout.plan.shape(),
                 report.source, report.pause_s)

    def _step(self, epoch: int, phase: str, run: Callable[[], T]) -> tuple[T | None, BaseException | None]:
        """Run one step on this rank, keeping its failure for the next vote rather than raising:
        every rank must attend every vote."""
        try:
            value = run()
            self._inject(epoch, phase)
            return value, None
        except Exception as exc:  # noqa: BLE001 - kept for the vote, which every rank must attend (docstring)
            return None, exc

    def _move(self, old: NativeRole, layout: NativeLayout, union: dist.ProcessGroup, report: ReshapeReport,
              lap: Callable[..., None], on_commit: Callable[[], None] = lambda: None) -> int | None:
        """export → rebuild → restore → resume over ``union`` (every rank that holds or needs
        state), with the three votes; commits ``layout`` on success. Returns the iteration to
        resume from after a disk fallback. ``ReshapeFailed``: nothing committed."""
        epoch = layout.plan.epoch
        stays = self.device in layout.world
        mine, failure = self._step(epoch, "export", self.export)
        self._vote(failure, union, "export")
        lap("export")
        mesh: DeviceMesh | None = None
        role: NativeRole | None = None
        if stays:
            mesh, failure = self._step(epoch, "new_mesh", lambda: self.new_mesh(layout))
        lap("new_mesh", failure is None)
        if stays and failure is None:
            assert mesh is not None
            built = mesh
            role, failure = self._step(epoch, "stages_rebuilt", lambda: self.rebuild(layout, built))
        self._vote(failure, union, "stages_rebuilt")
        lap("stages_rebuilt")
        restored, failure = self._step(epoch, "redistribute", lambda: self.restore(role, mine, union))
        if restored is not None:
            report.source = restored[0]
        self._vote(failure, union, "redistribute")
        on_commit()
        lap("redistribute", detail=f"state from {report.source}")
        self.resume(layout, role, report)
        return restored[1] if restored is not None else None

    def _from_checkpoint(self, role: NativeRole, missing: list[str]) -> tuple[str, int]:
        """No live piece covers ``missing``: every rank of the new world loads the newest DCP
        checkpoint (collective over the new world). Returns (source, its iteration)."""
        directory = self.checkpoint_dir()
        if directory is None:
            raise RuntimeError(f"no live copy of {', '.join(missing[:4])} survives and there is no DCP checkpoint "
                               "to fall back to; run with --save-dir and --checkpoint-every")
        iteration = load_dcp(directory, role.model, role.opt, role.sched, role.world)
        return f"DCP checkpoint {directory}", iteration
