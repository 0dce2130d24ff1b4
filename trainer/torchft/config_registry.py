"""``--module trainer.torchft``: torchtitan's way of selecting a model and a trainer, for torchft groups.

``llama3_ft_debugmodel`` is trainer/torchtitan's ``llama3_debugmodel`` (the debug Llama sized for a
CPU, our data loader) as a :class:`~trainer.torchft.trainer.ResiHPFTTrainer` config with torchtitan's
torchft parts in place: its checkpoint manager (which registers the state a healing group receives
from a peer) and its optimizer container (torchft's ``Optimizer``: quorum at ``zero_grad``, commit at
``step``), fault tolerance on over gloo with a synchronous step (no semi-sync method).
"""

from __future__ import annotations

import dataclasses

from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

from trainer.torchft.trainer import ResiHPFTTrainer
from trainer.torchtitan.config_registry import llama3_debugmodel


def llama3_ft_debugmodel() -> ResiHPFTTrainer.Config:
    base = llama3_debugmodel()
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    values["optimizer"] = TorchFTOptimizersContainer.Config(
        **{f.name: getattr(base.optimizer, f.name) for f in dataclasses.fields(base.optimizer) if f.init})
    checkpoint = {f.name: getattr(base.checkpoint, f.name) for f in dataclasses.fields(base.checkpoint) if f.init}
    # The state a healing group receives is registered only when checkpointing is on; the per-step
    # dataloader checkpoint is left off: our loader's position follows the step (trainer/torchtitan/data.py).
    values["checkpoint"] = TorchFTCheckpointManager.Config(**{**checkpoint, "enable": True},
                                                           enable_ft_dataloader_checkpoints=False)
    values["fault_tolerance"] = FaultTolerance(enable=True, process_group="gloo", min_replica_size=1)
    return ResiHPFTTrainer.Config(**values)
