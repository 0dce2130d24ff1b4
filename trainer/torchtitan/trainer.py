"""torchtitan's Trainer with the platform's side of the contract added, and nothing of its own changed.

:class:`ResiHPTrainer` subclasses torchtitan's ``Trainer`` (how torchtitan's own experiments extend
it) and is selected by ``--module trainer.torchtitan`` (config_registry.py). Per rank it adds:

* **telemetry** (trainer/torchtitan/telemetry.py): every micro-batch's F and B chunk with its
  documents' lengths, one ``telemetry.iteration`` per step, the loss in ``telemetry.summary``,
  heartbeats; the rank id is the device id, stable across restarts;
* **the flight record** the node agent judges hangs by (trainer/agent/flight.py);
* **the stop protocol** of a restart at a new layout (trainer/agent/relayout.py): at each step
  boundary the ranks agree whether the agent asked them to stop; if so each saves the step's DCP
  checkpoint and the loop ends, and the new world resumes from it;
* **probes**: the same agreement carries the newest probe the agent posted; every rank runs the
  ones it has not run at that boundary and the asked ranks answer (trainer/torchtitan/probes.py);
* **injected faults** for demos and tests (``--resihp.faults``: the platform's fault file; a
  ``slow_compute`` on a device stretches its chunks by the factor).

On a host with no accelerator it applies trainer/torchtitan/cpu.py's adaptations first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.trainer import Trainer

from collector.settings import elastic_environment, environment
from trainer.agent.relayout import (PROBE_KEY, PROBE_REQUEST_KEY, RESUMED_KEY, STOP_KEY, STOPPED_KEY, ProbeNumber,
                                    StopOrder, devices_of)
from collector.events import ProbeRequest
from trainer.torchtitan import cpu
from trainer.torchtitan.probes import answer_probe
from trainer.torchtitan.layout import JOB_KEY, JobShape, TitanLayout
from trainer.torchtitan.telemetry import StepTelemetry


@dataclass(kw_only=True, slots=True)
class ResiHPSection:
    """``--resihp.*``: how this job joins the platform."""

    job: str = ""
    """job name on the bus (default: RESIHP_JOB, which ``resihp run --job`` sets for its ranks)"""
    telemetry: bool = True
    """publish the contract's telemetry (heartbeats, chunks, the loss)"""
    faults: str = ""
    """a fault file in the platform's vocabulary (slow_compute on a device), for demos and tests"""


class ResiHPTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        resihp: ResiHPSection = field(default_factory=ResiHPSection)

    def __init__(self, config: Config) -> None:
        cpu.adapt(config)
        super().__init__(config)
        if not cpu.has_accelerator():
            cpu.force_sum_reduction(self.model_parts)
        pd = self.parallel_dims
        self.layout = TitanLayout(pp=pd.pp, dp_replicate=pd.dp_replicate, dp_shard=pd.dp_shard, tp=pd.tp, cp=pd.cp)
        self.world_rank = dist.get_rank()
        self.device_id, self.devices = _devices(self.world_rank)
        self.plan_epoch = environment().plan_epoch
        self.telemetry = StepTelemetry.attach(self, config.resihp) if config.resihp.telemetry else None
        self._stop_records = _agent_records(self.world_rank)
        self._resumed_reported = False
        self._probes_done = 0
        if self._stop_records is not None and self.world_rank == 0:
            self._stop_records.set(JOB_KEY, self.job_shape().to_json())

    def job_shape(self) -> JobShape:
        """What this world runs, in the terms the agent announces it in (trainer/torchtitan/layout.py)."""
        config, pd = self.config, self.parallel_dims
        training = config.training
        per_microbatch = config.parallelism.pipeline_parallel_microbatch_size if pd.pp_enabled \
            else training.local_batch_size
        num_layers = len(getattr(self.model_config, "layers", None) or []) or 1
        local_params = sum(p.numel() for part in self.model_parts for p in part.parameters())
        layers_here = max(1, num_layers // self.layout.pp)
        return JobShape(layout=self.layout, devices=tuple(self.devices), epoch=self.plan_epoch, num_layers=num_layers,
                        microbatches=self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches,
                        samples_per_microbatch=per_microbatch, tokens_per_microbatch=per_microbatch * training.seq_len,
                        layer_state_bytes=16 * local_params // layers_here,  # fp32 weight, grad, Adam m and v
                        model=f"{config.model_spec.name} {config.model_spec.flavor}" if config.model_spec else "")

    # ---- the step loop's hooks -------------------------------------------------------------------

    def train_step(self, data_iterator: Any) -> None:
        if self.telemetry is None:
            super().train_step(data_iterator)
            return
        with self.telemetry.step(self.step):
            super().train_step(data_iterator)
        self._say_resumed()

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        if self.telemetry is None:
            return super().forward_backward_step(**kwargs)
        self.telemetry.begin_group()
        if self.parallel_dims.pp_enabled:
            return super().forward_backward_step(**kwargs)  # the schedule's watchers time the chunks
        with self.telemetry.fused_chunks():
            return super().forward_backward_step(**kwargs)

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        out = super().post_dataloading_process(input_dict, labels)
        if self.telemetry is not None:
            self.telemetry.microbatch(input_dict.get("positions"), labels)
        return out

    def should_continue_training(self) -> bool:
        """The step boundary: the loop's own condition, then whether every rank agrees to stop for
        a new layout (trainer/agent/relayout.py); if so the step's checkpoint is saved first."""
        if not super().should_continue_training():
            if self.telemetry is not None:
                self.telemetry.finished()  # past the last step: torchtitan's teardown is not a hang
            return False
        if self._stop_records is None or self.step == 0:
            return True
        order, probes = self._agree()
        self._run_probes(probes)
        if order is None:
            return True
        self._save_whole_state()
        if self.world_rank == 0:
            self._stop_records.set(STOPPED_KEY, {"epoch": order.epoch, "step": self.step})
        if self.telemetry is not None:
            self.telemetry.close()
        os._exit(0)  # the state is on disk; torchtitan's teardown (and rank 0's 2 s sleep) would only lengthen the pause

    def _save_whole_state(self) -> None:
        """This step's checkpoint with everything a resumed run needs (model, optimizer, scheduler,
        data position, step), whatever the job says to keep at its last step."""
        ckpt = self.checkpointer
        if not getattr(ckpt, "enable", False):
            raise RuntimeError("a restart at a new layout needs --checkpoint.enable (resihp run adds it)")
        kept = ckpt.last_save_model_only, ckpt.last_save_in_hf
        ckpt.last_save_model_only = ckpt.last_save_in_hf = False
        try:
            ckpt.save(curr_step=self.step, last_step=True)
        finally:
            ckpt.last_save_model_only, ckpt.last_save_in_hf = kept

    def _agree(self) -> tuple[StopOrder | None, int]:
        """Rank 0 reads the agent's stop order and newest probe number; the ranks take the max of
        what it found (0: none), so all of them stop, and probe, after the same step."""
        assert self._stop_records is not None
        found, probes = 0, 0
        order: StopOrder | None = None
        if self.world_rank == 0:
            if self._stop_records.has(STOP_KEY):
                order = self._stop_records.read(STOP_KEY, StopOrder.parse)
                found = order.epoch if order is not None and order.epoch > self.plan_epoch else 0
            if self._stop_records.has(PROBE_KEY):
                newest = self._stop_records.read(PROBE_KEY, ProbeNumber.parse)
                probes = newest.number if newest is not None else 0
        agreed = torch.tensor([found, self.step, probes], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if int(agreed[0]) == 0:
            return None, int(agreed[2])
        return order or StopOrder(int(agreed[0]), ""), int(agreed[2])

    def _run_probes(self, newest: int) -> None:
        """Every probe posted since the last boundary, run by every rank together (the world's
        median is the healthy reference); the asked ranks publish their answers. A probe whose
        record is missing or refused is skipped by every rank alike (each reads the same store)."""
        assert self._stop_records is not None
        while self._probes_done < newest:
            self._probes_done += 1
            request = self._stop_records.read(PROBE_REQUEST_KEY.format(number=self._probes_done),
                                              ProbeRequest.model_validate)
            if request is None:
                continue
            result = answer_probe(request, self.device_id, self.telemetry.injector if self.telemetry else None,
                                  self.device)
            if result is not None and self.telemetry is not None:
                self.telemetry.reporter.answer_probe(result)

    def _say_resumed(self) -> None:
        """After the new world's first step: rank 0 tells the agent (the pause ends here)."""
        if self._resumed_reported or self._stop_records is None or self.plan_epoch == 0:
            return
        self._resumed_reported = True
        if self.world_rank == 0:
            self._stop_records.set(RESUMED_KEY, {"epoch": self.plan_epoch, "step": self.step})

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        super().close()


def _devices(world_rank: int) -> tuple[int, list[int]]:
    """This rank's device and every world rank's. The agent names the devices of its own node's
    ranks (``RESIHP_DEVICES``, by local rank: it knows no other node's), so when it does the world's
    list is gathered; otherwise a job owns devices 0..N-1 and world rank r runs on device r."""
    env = elastic_environment()
    named = environment().devices
    local = devices_of(named, env.LOCAL_WORLD_SIZE, first_rank=world_rank - env.LOCAL_RANK)
    if not named:
        return local[env.LOCAL_RANK], list(range(dist.get_world_size()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local[env.LOCAL_RANK])
    return local[env.LOCAL_RANK], [int(d) for d in everyone]


def _agent_records(rank: int) -> Any:
    """The ranks' bootstrap store of this round, signed as a rank, when the node agent runs the job
    (``resihp run`` sets the scope); None under a plain ``torchrun``."""
    if not environment().store_scope:
        return None
    from trainer.agent.shrink import rank_records

    env = elastic_environment()
    store = dist.TCPStore(env.MASTER_ADDR, env.MASTER_PORT, is_master=False, timeout=timedelta(seconds=30))
    return rank_records(store, rank)
