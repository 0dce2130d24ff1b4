"""``--module trainer.torchtitan``: torchtitan's own way of selecting a model and a trainer.

torchtitan's ``ConfigManager`` imports ``<module>.config_registry`` and calls the function named by
``--config``; each function here takes torchtitan's config of the same name and returns it as a
:class:`~trainer.torchtitan.trainer.ResiHPTrainer` config, so ``python -m torchtitan.train --module
trainer.torchtitan --config llama3_debugmodel`` runs torchtitan's entry point, model, parallelisms
and checkpointing unchanged, with the platform's telemetry and commands added
(trainer/torchtitan/trainer.py) and its data loader (trainer/torchtitan/loader.py) in place of the
Hugging Face one. Every other flag is torchtitan's (``--parallelism.tensor_parallel_degree 2``), plus
the ``--resihp.*`` section.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.torchtitan import cpu
from trainer.torchtitan.loader import PackedCorpusLoader
from trainer.torchtitan.trainer import ResiHPTrainer


def as_resihp(config: Any) -> ResiHPTrainer.Config:
    """torchtitan's ``Trainer.Config`` as ours: the same fields, our loader, the ``resihp`` section."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values["dataloader"] = PackedCorpusLoader.Config(dataset_path=getattr(config.dataloader, "dataset_path", None))
    values["validator"] = dataclasses.replace(config.validator, enable=False)  # no held-out set here
    return ResiHPTrainer.Config(**values)


def llama3_debugmodel() -> ResiHPTrainer.Config:
    """torchtitan's llama3 debug model (6 layers, dim 256, 2,048-token vocabulary), sized for a CPU:
    sequences of 256 tokens, 4 per local batch, checkpoints under ``dump_folder`` when enabled."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as titan_debugmodel

    config = as_resihp(titan_debugmodel())
    if not cpu.has_accelerator():
        cpu.disable_cuda_graphs(config)  # checked when the flags are parsed, before the trainer exists
    config.training.seq_len = 256
    config.training.local_batch_size = 4
    config.training.steps = 40
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.checkpoint.interval = 1_000_000  # saves come from the platform's stop orders and the last step
    config.activation_checkpoint = None  # nothing to save memory for at this size; recomputation would blur F and B
    return config

