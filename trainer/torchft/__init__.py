"""torchtitan's torchft experiment under ResiHP: replica groups that leave a quorum and heal back.

``python -m torchtitan.train --module trainer.torchft --config llama3_ft_debugmodel
--fault_tolerance.replica_id R --fault_tolerance.group_size G …`` runs one replica group of
torchtitan's torchft trainer with the platform's telemetry; ``python -m trainer.torchft`` runs a
whole job: the lighthouse, ``G`` groups and the executor that evicts a group on command. The rooms:

* membership.py — what torchft offers (leave, heal back), as plans, orders and marks; pure;
* config_registry.py, trainer.py — one group's torchtitan side;
* supervisor.py — the lighthouse, the groups, the stores, the executor; children end with it.

docs/torchtitan.md (torchft) says why eviction works this way and what it does not cover.
"""
