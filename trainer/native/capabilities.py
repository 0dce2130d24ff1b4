"""What the native executor can run, declared, so a planner proposes only plans the job can apply.

The declaration is data (``NATIVE_CAPABILITIES``, JSON-ready through ``as_dict``) and one check
(``refusal``), which is the same check the executor's ``agree`` step runs — a plan the planner was
told is fine cannot be refused later for another reason. docs/native.md says how the planner
should read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from collector.plan import Plan
from trainer.native.layout import NativeLayout, PlanRefused
from trainer.native.model import LlamaConfig


@dataclass(frozen=True)
class Capabilities:
    executor: str
    tp_shrink: str
    tp_exclusion: str
    pp_repartition: str
    dp_drop: str
    dp_microbatch_migration: str
    spares: str
    schedules: tuple[str, ...]
    state_transfer: str

    def as_dict(self) -> dict:
        return asdict(self)


NATIVE_CAPABILITIES = Capabilities(
    executor="native",
    tp_shrink="yes, uniform: every stage of every replica moves to the same TP degree (a DeviceMesh is a grid)",
    tp_exclusion="no: one stage at a smaller TP degree than the rest is refused; shrink TP job-wide instead",
    pp_repartition="yes, at layer granularity, the same layer ranges in every replica",
    dp_drop="yes",
    dp_microbatch_migration="yes: per-replica micro-batch counts may differ; the global batch and loss scaling stay",
    spares="no: every device of the world holds a role; a device left out of the plan is released",
    schedules=("1f1b",),
    state_transfer="live (DTensor gather on the old mesh, point to point from a live holder, re-shard on load); "
                   "DCP checkpoint when a key has no live holder",
)


def refusal(plan: Plan, cfg: LlamaConfig, running_epoch: int | None = None) -> str | None:
    """Why the native executor would refuse ``plan`` (None: it can run it). Pure: the planner, the
    executor's agree step and every rank give the same answer."""
    if running_epoch is not None and plan.epoch != running_epoch + 1:
        return f"plan epoch {plan.epoch} is not the running epoch {running_epoch} + 1"
    try:
        NativeLayout.of(plan, cfg)
    except PlanRefused as exc:
        return str(exc)
    return None
