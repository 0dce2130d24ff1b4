"""torchtitan under ResiHP: its own trainer and entry point, the platform's telemetry and restarts.

``python -m torchtitan.train --module trainer.torchtitan --config llama3_debugmodel …`` (or the same
after ``resihp run``) runs torchtitan unchanged with :class:`~trainer.torchtitan.trainer.ResiHPTrainer`,
selected through torchtitan's config registry (config_registry.py). The rooms:

* cpu.py — the adaptations that let torchtitan train on a host with no accelerator;
* assets.py, data.py, loader.py — the tokenizer and corpus the platform generates, and a data loader
  whose one-number state survives a change of layout;
* layout.py — torchtitan's grid in the contract's words (``Plan``), and back to its flags;
* telemetry.py, trainer.py — the rank side: chunks, steps, the loss, the stop at a step boundary;
* controller.py — the agent side: the plan announced, commands obeyed by a restart at a new layout.

docs/torchtitan.md tells a user how to run it and what it does not cover.
"""
