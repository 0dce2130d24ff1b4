"""torchtitan's torchft trainer with the platform's side of the contract, and a group that can step out.

:class:`ResiHPFTTrainer` is torchtitan's ``FaultTolerantTrainer`` (torchtitan/experiments/torchft:
one torchft ``Manager`` per replica group, HSDP gradients averaged over the groups in the quorum,
``torchft.Optimizer`` starting a quorum at ``zero_grad`` and committing at ``step``) with
:class:`~trainer.torchtitan.trainer.ResiHPTrainer`'s additions: the CPU adaptations, the telemetry of
every rank, the flight record. Each group is its own torch world; in the job's terms its ranks are
world ranks ``replica_id × group size + group rank`` (torchft's own global rank), on the devices the
supervisor names, so every group's telemetry lands in one job with distinct ranks and replicas.

What it adds to torchft: at each step boundary the group's rank 0 reads the supervisor's signed
standing order (trainer/torchft/membership.py) in the group's store. **Out**: the group stops
calling quorum — it finishes the step it is in, says where it stopped (``left``), and waits at the
boundary with its manager still heartbeating; the lighthouse forms the next quorum without it and
the other groups go on. **In**: it steps again; its first ``zero_grad`` joins the quorum, and
torchft heals it from a peer (model, optimizer, scheduler and step over the checkpoint transport)
because its step is behind; it says so (``joined``) after that step commits.

Every step the group's rank 0 also writes what torchft decided (``progress``: the step, the quorum
id, how many groups took part, whether the step was committed): the supervisor's evidence that a
quorum shrank and grew back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

from collector.events import Coords
from collector.settings import environment
from trainer.agent.relayout import devices_of
from trainer.torchft.membership import (JOINED_KEY, LEFT_KEY, ORDER_KEY, PROGRESS_KEY, GroupProgress,
                                        StandingOrder)
from trainer.torchtitan.layout import TitanLayout
from trainer.torchtitan.telemetry import StepTelemetry
from trainer.torchtitan.trainer import ResiHPSection, ResiHPTrainer

ORDER_POLL_S = 0.2  # how often a group that is out reads its order again


class ResiHPFTTrainer(ResiHPTrainer, FaultTolerantTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):
        resihp: ResiHPSection = field(default_factory=ResiHPSection)

    def __init__(self, config: Config) -> None:
        publish = config.resihp.telemetry
        config.resihp.telemetry = False  # attached below, once the rank knows its place in the job
        super().__init__(config)
        config.resihp.telemetry = publish
        self._wire_chunked_loss()
        ft = config.fault_tolerance
        group_world = dist.get_world_size()
        self.group_rank = dist.get_rank()
        self.layout = TitanLayout(pp=1, dp_replicate=ft.group_size, dp_shard=group_world, tp=1, cp=1)
        self.world_rank = ft.replica_id * group_world + self.group_rank
        self.devices = devices_of(environment().devices, ft.group_size * group_world)
        self.device_id = self.devices[self.world_rank]
        self.telemetry = StepTelemetry.attach(self, config.resihp) if publish else None
        self._standing: StandingOrder | None = None  # the last order this group obeyed
        self._joined_pending: StandingOrder | None = None

    def _wire_chunked_loss(self) -> None:
        """What torchtitan's ``Trainer.__init__`` does after building the model and 0.3.0's
        ``FaultTolerantTrainer.__init__`` (its own copy of it) leaves out: the chunked loss computes
        the output layer itself, so it is handed ``lm_head`` and the model stops before it
        (without this the first step fails: "Set lm_head before calling ChunkedLossWrapper")."""
        from torchtitan.components.loss import ChunkedLossWrapper

        if not isinstance(self.loss_fn, ChunkedLossWrapper) or self.loss_fn.lm_head is not None:
            return
        if self.parallel_dims.pp_enabled:
            raise ValueError("a torchft group here runs without pipelining (--parallelism.pipeline_parallel_degree 1)")
        self.loss_fn.set_lm_head(self.model_parts[0].lm_head)
        self.model_parts[0]._skip_lm_head = True

    def init_distributed(self) -> ParallelDims:
        """torchtitan's torchft ``init_distributed`` without its guess of the group's global ranks
        (``replica_id × group_size`` onward, where ``group_size`` counts groups, not ranks): torch
        names this world's own ranks, and the manager gets this group's replica id."""
        config = self.config
        dist_utils.init_distributed(config.comm, enable_cpu_backend=config.training.enable_cpu_offload,
                                    base_folder=config.dump_folder)
        self.ft_manager = config.fault_tolerance.build()
        if self.ft_manager.enabled:
            # The quorum, and a heal's transfer of this group's state to a peer, run before the
            # forward rather than beside it: torchft reads the state (FSDP2's state_dict) from its
            # quorum thread, and read during this group's own forward it turns the unsharded
            # parameters back into DTensors ("aten.mm.default got mixed torch.Tensor and DTensor").
            # torchtitan keeps its all-reduce hook, which needs the manager's asynchronous mode on
            # its side only; on one host the quorum costs milliseconds.
            self.ft_manager.manager._use_async_quorum = False
        return ParallelDims.from_config(config.parallelism, dist.get_world_size())

    # ---- the step loop's hooks -------------------------------------------------------------------

    def train_step(self, data_iterator: Any) -> None:
        if self._joined_pending is None:
            super().train_step(data_iterator)
        else:
            # The step that heals: torchft loads a peer's step number into it, so it is not
            # reported under the number it began with (an iteration its peers finished long ago).
            FaultTolerantTrainer.train_step(self, data_iterator)
            self.dataloader.batches = self.step * self.gradient_accumulation_steps  # the peers' data position
        self._report_progress()

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        if self.telemetry is not None and self.telemetry.injector is not None:
            self.telemetry.injector.iteration = self.step  # a healed step's number is the peers' (see train_step)
        return super().forward_backward_step(**kwargs)

    def should_continue_training(self) -> bool:
        if not super().should_continue_training():
            return False
        order = self._agreed_order()
        if order is not None and order.out:
            self._step_out(order)
        elif order is not None:
            self._obey(order)
        return True

    # ---- membership --------------------------------------------------------------------------------

    def _agreed_order(self) -> StandingOrder | None:
        """The supervisor's newest order if this group has not obeyed it yet; read by the group's
        rank 0 and broadcast to its ranks, so every rank of a group stays in or steps out together."""
        found = self._read_order() if self.group_rank == 0 else None
        shared = torch.tensor(found.as_ints() if found else [-1, 0, 0, 0, 0], dtype=torch.int64)
        if dist.get_world_size() > 1:
            dist.broadcast(shared, src=0)
        if int(shared[0]) < 0 or (self._standing is not None and int(shared[0]) <= self._standing.serial):
            return None
        return found or StandingOrder.from_ints(shared.tolist())

    def _read_order(self) -> StandingOrder | None:
        if self._stop_records is None or not self._stop_records.has(ORDER_KEY):
            return None
        return self._stop_records.read(ORDER_KEY, StandingOrder.parse)

    def _obey(self, order: StandingOrder) -> None:
        """Take the group's place in plan ``order.epoch``: its replica index, the job's replica
        count (the batch its summary reports) and the epoch its telemetry carries."""
        self._standing = order
        self.plan_epoch = order.epoch
        self.layout = TitanLayout(pp=1, dp_replicate=order.replicas, dp_shard=self.layout.dp_shard, tp=1, cp=1)
        if self.telemetry is not None:
            self.telemetry.reporter.set_role(order.epoch, Coords(tp=0, pp=0, dp=order.replica))
            self.telemetry.reports_summary = order.replica == 0 and self.group_rank == 0

    def _step_out(self, order: StandingOrder) -> None:
        """Leave the quorum at this boundary: say where, then wait for an order that puts the group
        back in. The manager keeps heartbeating, so the lighthouse counts the group alive."""
        self._standing = order
        if self.group_rank == 0 and self._stop_records is not None:
            self._stop_records.set(LEFT_KEY, {"epoch": order.epoch, "step": self.step})
        while True:
            time.sleep(ORDER_POLL_S)
            back = self._agreed_order()
            if back is not None and not back.out:
                break
            if back is not None:
                self._standing = back
        self._obey(back)
        self._joined_pending = back

    def _report_progress(self) -> None:
        """After each step: what torchft decided (rank 0 of the group writes it)."""
        if self.group_rank != 0 or self._stop_records is None or not self.ft_manager.enabled:
            return
        manager = self.ft_manager.manager
        progress = GroupProgress(step=self.step, ft_step=manager.current_step(), quorum_id=manager._quorum_id,
                                 participants=manager.num_participants(),
                                 committed=manager._commit_failures == 0,  # reset by a commit, counted by a refusal
                                 at_s=time.time())
        self._stop_records.set(PROGRESS_KEY, progress.to_json())
        if self._joined_pending is not None:
            self._stop_records.set(JOINED_KEY, {"epoch": self._joined_pending.epoch, "step": self.step})
            self._joined_pending = None
