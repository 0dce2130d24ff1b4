"""Replica drop: the next epoch without every DP replica that holds a lost device.

DP-only fault tolerance (what torchft and elastic launchers do): the surviving replicas keep
their stages unchanged, are renumbered 0…k-1 in their old order, and share the job's global
batch of micro-batches evenly (earlier replicas take the remainder), so the global batch — and
with it the optimiser's step — stays the same. One meaning for every user: the torch launcher's
``--on-death drop-replica`` policy, the ``drop_replica`` baseline planner and the simulator's
open-loop restart.
"""

from __future__ import annotations

from collections.abc import Collection

from collector.plan import PipelinePlan, Plan


def surviving_replicas(plan: Plan, lost: Collection[int]) -> list[PipelinePlan]:
    """The replicas of ``plan`` none of whose devices is in ``lost``, in order."""
    lost = set(lost)
    return [p for p in plan.pipelines if not any(d in lost for st in p.stages for d in st.devices)]


def even_split(microbatches: int, replicas: int) -> list[int]:
    """``microbatches`` shared by ``replicas``, earlier replicas taking the remainder."""
    base, extra = divmod(microbatches, replicas)
    return [base + (1 if i < extra else 0) for i in range(replicas)]


def drop_replicas(plan: Plan, lost: Collection[int]) -> Plan:
    """Epoch ``plan.epoch + 1`` without the replicas that hold a ``lost`` device.

    Raises ValueError when no replica survives, or when fewer micro-batches than surviving
    replicas are left to share (each replica needs at least one): the caller must then restart
    from a checkpoint or put spares in place instead."""
    keep = surviving_replicas(plan, lost)
    if not keep:
        raise ValueError(f"devices {sorted(set(lost))} touch every replica of epoch {plan.epoch}; nothing survives")
    total = plan.global_microbatches
    if total < len(keep):
        raise ValueError(f"{total} micro-batches cannot feed {len(keep)} surviving replicas; drop more replicas")
    pipelines = tuple(PipelinePlan(replica=i, microbatches=m, stages=p.stages)
                      for i, (p, m) in enumerate(zip(keep, even_split(total, len(keep)))))
    return Plan.model_validate({**plan.model_dump(), "epoch": plan.epoch + 1,
                                "pipelines": [p.model_dump() for p in pipelines]})


__all__ = ["drop_replicas", "even_split", "surviving_replicas"]
