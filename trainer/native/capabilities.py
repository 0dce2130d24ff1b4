"""What the native executor can run, declared on the bus, so a planner proposes only plans the job can apply.

The declaration is the contract's ``plan.capabilities`` payload (``NATIVE_CAPABILITIES``), which
the native launcher publishes, signed as the executor, at start (trainer/native/intake.py); the
engine reads it and searches only DP changes for this job (remediation/capability_fit.py).
``refusal`` is the executor's own check, the one its ``agree`` step and its command intake run:
the contract's judgement of the declaration (collector/capabilities.py) plus what only the
executor knows (its model's dimensions, the mesh rules of ``NativeLayout``).
"""

from __future__ import annotations

from collector.capabilities import capability_refusal
from collector.events import ExecutorCapabilities
from collector.plan import Plan
from trainer.native.layout import NativeLayout, MeshRuleBroken
from trainer.native.model import LlamaConfig

NATIVE_CAPABILITIES = ExecutorCapabilities(
    executor="native",
    tp_shrink="per_stage",
    tp_exclusion=True,
    pp_repartition="uniform",
    dp_drop=True,
    dp_microbatch_migration=True,
    spares=False,
    schedules=["1f1b"],
    notes={
        "tp_shrink": "per stage: each stage of each replica runs at its own TP degree (one DeviceMesh per stage), any "
                     "degree that gives every rank whole attention heads; the FFN width and vocabulary may divide "
                     "unevenly",
        "tp_exclusion": "yes: a stage re-forms its TP group around the healthy devices (TP 4 → 3) while every other "
                        "stage keeps its degree; its replicas then sum full gradients instead of FSDP's shards",
        "pp_repartition": "at layer granularity, the same layer ranges in every replica",
        "dp_drop": "yes",
        "dp_microbatch_migration": "per-replica micro-batch counts may differ; the global batch and loss scaling stay",
        "spares": "every device of the world holds a role; a device left out of the plan is released",
        "state_transfer": "live: each rank's local shards sent raw point to point from live holders, each rank "
                          "taking its own new shard (no gather on the old mesh); DCP checkpoint only when a key "
                          "has no live holder",
    },
)


def refusal(plan: Plan, cfg: LlamaConfig, running_epoch: int | None = None, running: Plan | None = None) -> str | None:
    """Why the native executor would refuse ``plan`` (None: it can run it). Pure: the planner, the
    executor's agree step, its command intake and every rank give the same answer."""
    if running_epoch is not None and plan.epoch != running_epoch + 1:
        return f"plan epoch {plan.epoch} is not the running epoch {running_epoch} + 1"
    try:
        NativeLayout.of(plan, cfg)
    except MeshRuleBroken as exc:
        return str(exc)
    return capability_refusal(plan, running, NATIVE_CAPABILITIES)
