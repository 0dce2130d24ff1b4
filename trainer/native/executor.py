"""The native executor: reshapes a running native rank to the next plan, step by step.

The same protocol as trainer/executor.py, on torch's own parallelism:

    reshape(P):  agree → export_state → join_world → rebuild_stages → restore_state → (first step)

* agree — check P against what a DeviceMesh can run (``NativeLayout.of``: a plan it cannot run
  is refused *here*, on every rank alike, before anything stops) and confirm with one all-reduce
  over the running world that every rank moves to the same epoch.
* export_state — DTensor-gather this stage's parameters and AdamW state to full size on the old
  mesh (trainer/native/state.py).
* join_world — destroy the old process group; a device outside P's world is released; the
  rest rendezvous a new default group (a fresh store prefix per epoch).
* rebuild_stages — the new DeviceMesh, stage model, TP/FSDP, PipelineStage, schedule, optimizer.
* restore_state — every key the new stage needs comes from a live holder over the new world; if
  some key has none (its every holder died), all ranks load the newest DCP checkpoint instead.

Each phase is timed (``phases_s``: agree, export, new_mesh, stages_rebuilt, redistribute; the
worker adds first_step), so an operator sees why a pause took N seconds.

Rollback: any failure before join_world (a refused plan, ranks that disagree) leaves the old
role untouched and training goes on at the old layout (``ReshapeRefused``). Once the old group is destroyed there is no old mesh to go back to; a failure there is reported and re-raised.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from collector.plan import Plan
from trainer.native.capabilities import refusal
from trainer.native.layout import NativeLayout
from trainer.native.model import LlamaConfig, ModelFactory, build_model
from trainer.native.parallelize import forget_old_meshes
from trainer.native.stage import NativeRole, TrainSettings
from trainer.native.state import FullState, exchange, export_full, load_dcp, load_full, needed_keys

log = logging.getLogger("resihp.trainer.native")

PHASES = ("agree", "export", "new_mesh", "stages_rebuilt", "redistribute", "first_step")


class Released(Exception):
    """This device is not in the next plan's world: exit cleanly."""


class ReshapeRefused(RuntimeError):
    """The plan was refused before anything stopped; training goes on at the running layout."""


@dataclass
class ReshapeReport:
    epoch: int
    source: str = "live"
    phases_s: dict[str, float] = field(default_factory=dict)

    @property
    def pause_s(self) -> float:
        return sum(self.phases_s.values())


class NativeExecutor:
    """Owns the reconfiguration protocol of one native rank."""

    def __init__(self, device: int, cfg: LlamaConfig, settings: TrainSettings, store: dist.Store,
                 torch_device: torch.device, backend: str, timeout_s: float,
                 checkpoint_dir: Callable[[], Path | None] = lambda: None,
                 model_factory: ModelFactory = build_model) -> None:
        self.device, self.cfg, self.settings, self.store = device, cfg, settings, store
        self.torch_device, self.backend, self.timeout_s = torch_device, backend, timeout_s
        self.checkpoint_dir = checkpoint_dir
        self.model_factory = model_factory
        self.current: NativeRole | None = None
        self.reports: list[ReshapeReport] = []

    # ---- the steps -------------------------------------------------------------------------------

    def agree(self, plan: Plan) -> NativeLayout:
        """The new layout, or ``ReshapeRefused`` (nothing stopped): the plan breaks a mesh rule,
        is not the running epoch + 1, or the ranks do not all hold the same plan."""
        running = self.current.layout.plan.epoch if self.current else -1
        if reason := refusal(plan, self.cfg, running):
            raise ReshapeRefused(reason)
        layout = NativeLayout.of(plan, self.cfg)
        seen = torch.tensor([plan.epoch, -plan.epoch, zlib.crc32(plan.model_dump_json().encode())], dtype=torch.float64,
                            device=self.torch_device)
        low = seen.clone()
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        if not torch.equal(seen, low):
            raise ReshapeRefused(f"ranks disagree on the plan of epoch {plan.epoch}; keeping epoch {running}")
        return layout

    def export_state(self) -> FullState:
        """This stage's full state, gathered on the old mesh (a collective over the old world)."""
        cur = self.current
        assert cur is not None
        return export_full(cur.model, cur.opt, cur.sched)

    def join_world(self, layout: NativeLayout) -> None:
        """(Re)create the default group over ``layout.world``; ``Released`` if this device is not in it."""
        if dist.is_initialized():
            dist.destroy_process_group()
            forget_old_meshes()
        if self.device not in layout.world:
            raise Released(f"device {self.device} is not in the world of epoch {layout.plan.epoch}")
        prefixed = dist.PrefixStore(f"native/pg/{layout.plan.epoch}/", self.store)
        dist.init_process_group(self.backend, store=prefixed, rank=layout.rank(self.device),
                                world_size=len(layout.world), timeout=timedelta(seconds=self.timeout_s))

    def rebuild_stages(self, layout: NativeLayout) -> NativeRole:
        """The new mesh and this device's stage, schedule, optimizer (initial weights, replaced by
        :meth:`restore_state`)."""
        return NativeRole.build(layout, self.device, self.cfg, self.settings, self.torch_device, self.model_factory)

    def restore_state(self, role: NativeRole, mine: FullState | None) -> tuple[str, int | None]:
        """Load the state the new stage needs from live holders; with a key nobody holds, every
        rank loads the newest DCP checkpoint instead. Returns (source, the checkpoint's iteration
        or None)."""
        state, missing = exchange(mine, needed_keys(role.model), dist.get_rank(), dist.get_world_size())
        if not missing:
            load_full(role.model, role.opt, role.sched, state)
            return "live", None
        directory = self.checkpoint_dir()
        if directory is None:
            raise RuntimeError(f"no live copy of {', '.join(missing[:4])} survives and there is no DCP checkpoint "
                               "to fall back to; run with --save-dir and --checkpoint-every")
        iteration = load_dcp(directory, role.model, role.opt, role.sched)
        return f"DCP checkpoint {directory}", iteration

    # ---- the protocol ------------------------------------------------------------------------------

    def reshape(self, plan: Plan) -> tuple[ReshapeReport, int | None]:
        """Move to ``plan`` at this iteration boundary. Returns the report and, after a disk
        fallback, the iteration to resume from. ``ReshapeRefused``: still at the old layout."""
        report = ReshapeReport(plan.epoch)
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            report.phases_s[name] = now - t
            t = now

        layout = self.agree(plan)
        lap("agree")
        mine = self.export_state() if self.current is not None else None
        lap("export")
        self.current = None
        self.join_world(layout)
        lap("new_mesh")
        role = self.rebuild_stages(layout)
        lap("stages_rebuilt")
        source, rollback_to = self.restore_state(role, mine)
        report.source = source
        dist.barrier()
        self.current = role
        lap("redistribute")
        self.reports.append(report)
        log.info("device %d: epoch %d %s from %s in %.3f s", self.device, plan.epoch,
                 plan.shape(), source, report.pause_s)
        return report, rollback_to
