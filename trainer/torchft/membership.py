"""Who is in a torchft job's quorum, in the contract's words: eviction as a plan, and back.

A torchft job (torchtitan's torchft experiment) is ``G`` replica groups, each its own torch world
with a torchft ``Manager``; a lighthouse forms a quorum from the groups that ask for one at each
step, and the groups in it average their gradients. What torchft 0.2 offers to take a group out
and bring it back, and what this module therefore declares and checks:

* **leave**: a group that stops asking for quorum is left out of the next one. Its manager keeps
  heartbeating, so the lighthouse (``quorum_compute``) waits up to ``--join_timeout_ms`` for it
  once, then forms the quorum of those that asked; the quorum after that is a "fast quorum" of the
  same members, with no wait. The lighthouse also refuses a quorum of half or fewer of the groups
  it hears from (split brain), so a group can be evicted only while the others are a strict
  majority of the live groups (:func:`eviction_refusal`): one of three, never one of two.
* **stay the same per-replica batch**: torchft averages over the groups that took part
  (``WorldSizeMode.DYNAMIC``); each keeps its own batch, so the job's batch shrinks by the evicted
  group's share while it is out.
* **come back**: a group that asks again joins the next quorum; its step is behind, so torchft
  heals it from a peer over the checkpoint transport (HTTP), with the model, optimizer, scheduler
  and step torchtitan's ``TorchFTCheckpointManager`` registers.

In a plan a group is a replica (one pipeline of one stage when the group is one rank). The
executor's declaration (:data:`TORCHFT_CAPABILITIES`) is **evict whole replicas, nothing else**:
no TP or PP change, no micro-batch moved. A command's plan is read as an eviction when its
pipelines are the running plan's minus some whole replicas (:func:`evicted_groups`); the
micro-batch counts the planner wrote for the kept replicas are its accounting of a global batch
torchft does not keep, and the plan the executor then announces says what runs.

The records the supervisor and a group's rank 0 exchange in the group's store (each signed,
trainer/agent/signed_store.py): the supervisor's standing order (:class:`StandingOrder`: in or
out, for which epoch), and the group's marks: ``left`` (the step it stopped after), ``joined``
(the step it committed back in, healed), ``progress`` (:class:`GroupProgress`, every step).

Pure: no torch, no torchft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collector.events import ExecutorCapabilities
from collector.plan import Plan

ORDER_KEY = "resihp/torchft/order"
LEFT_KEY = "resihp/torchft/left"
JOINED_KEY = "resihp/torchft/joined"
PROGRESS_KEY = "resihp/torchft/progress"

TORCHFT_CAPABILITIES = ExecutorCapabilities(
    executor="torchft",
    tp_shrink="no",
    tp_exclusion=False,
    pp_repartition="no",
    dp_drop=True,
    dp_microbatch_migration=False,
    spares=True,
    schedules=["1f1b"],
    notes={
        "dp_drop": "evict a replica group: it leaves the torchft quorum, the others go on at their own batch, "
                   "and it heals back from a peer after its probation",
        "tp_shrink": "a replica group's own layout is fixed; torchft changes only which groups take part",
        "pp_repartition": "a replica group's own layout is fixed; torchft changes only which groups take part",
        "dp_microbatch_migration": "every group keeps its own batch; torchft averages over the groups present",
    },
)


@dataclass(frozen=True)
class StandingOrder:
    """The supervisor's word to one group, newest ``serial`` first: ``out`` (leave the quorum and
    wait), or in as replica ``replica`` of ``replicas`` in plan ``epoch`` (what its telemetry
    then says: the epoch, its coordinates, the job's batch)."""

    serial: int
    epoch: int
    out: bool
    replica: int
    replicas: int
    command: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"serial": self.serial, "epoch": self.epoch, "out": self.out, "replica": self.replica,
                "replicas": self.replicas, "command": self.command}

    def as_ints(self) -> list[int]:
        return [self.serial, self.epoch, int(self.out), self.replica, self.replicas]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> StandingOrder:
        serial, epoch, out, replica, replicas = (int(v) for v in values)
        return cls(serial, epoch, bool(out), replica, replicas)

    @classmethod
    def parse(cls, body: Any) -> StandingOrder:
        ints = ("serial", "epoch", "replica", "replicas")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) and body[k] >= 0 for k in ints) \
                or not isinstance(body.get("out"), bool) or not isinstance(body.get("command"), str):
            raise ValueError("a standing order is {serial, epoch, replica, replicas: int >= 0, out: bool, command: str}")
        if not body["out"] and body["replica"] >= body["replicas"]:
            raise ValueError(f"a standing order puts the group in as replica {body['replica']} of {body['replicas']}")
        return cls(body["serial"], body["epoch"], body["out"], body["replica"], body["replicas"], body["command"][:200])


@dataclass(frozen=True)
class GroupProgress:
    """One group's last step as torchft saw it: torchtitan's step, torchft's committed step count,
    the quorum it ran in and how many groups took part, whether the step was committed."""

    step: int
    ft_step: int
    quorum_id: int
    participants: int
    committed: bool
    at_s: float  # the group's host clock (one host: the supervisor compares it with its own)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "ft_step": self.ft_step, "quorum_id": self.quorum_id,
                "participants": self.participants, "committed": self.committed, "at_s": self.at_s}

    @classmethod
    def parse(cls, body: Any) -> GroupProgress:
        ints = ("step", "ft_step", "quorum_id", "participants")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) for k in ints) \
                or not isinstance(body.get("committed"), bool) or not isinstance(body.get("at_s"), (int, float)):
            raise ValueError(f"group progress is {{{', '.join(ints)}: int, committed: bool, at_s: float}}")
        return cls(body["step"], body["ft_step"], body["quorum_id"], body["participants"], body["committed"],
                   float(body["at_s"]))


def group_plan_devices(plan: Plan) -> dict[int, tuple[int, ...]]:
    """Each replica's devices (a replica is a torchft group)."""
    return {p.replica: tuple(d for s in p.stages for d in s.devices) for p in plan.pipelines}


def evicted_groups(plan: Plan, running: Plan, groups: Sequence[tuple[int, ...]]) -> list[int]:
    """The groups (indices into ``groups``, each group's devices) that ``plan`` leaves out of
    ``running``; raises ValueError naming the rule when ``plan`` is anything but ``running`` minus
    whole groups: a replica on devices that are no group (a device moved, a group split or merged,
    a pipeline across groups), a group added, nothing left out."""
    kept = {tuple(sorted(devs)) for devs in group_plan_devices(plan).values()}
    known = {tuple(sorted(g)): i for i, g in enumerate(groups)}
    running_groups = {tuple(sorted(devs)) for devs in group_plan_devices(running).values()}
    strangers = sorted(kept - set(known))
    if strangers:
        raise ValueError(f"plan epoch {plan.epoch} has replicas on devices {[list(s) for s in strangers]} that are no "
                         f"torchft replica group of this job (groups: {[list(g) for g in groups]}); torchft can only "
                         "leave whole groups out")
    added = sorted(kept - running_groups)
    if added:
        raise ValueError(f"plan epoch {plan.epoch} brings back group(s) {[known[a] for a in added]}: a group comes "
                         "back by healing after its probation, not by command")
    out = sorted(known[g] for g in running_groups - kept)
    if not out:
        raise ValueError(f"plan epoch {plan.epoch} leaves every group of the running plan in: nothing to evict")
    return out


def eviction_refusal(live_groups: int, evicted: int, min_replicas: int) -> str | None:
    """Why the lighthouse would form no quorum after ``evicted`` of ``live_groups`` groups stop
    asking while they still heartbeat (None: it will): the rest must be at least ``min_replicas``
    and more than half of the groups it hears from."""
    remaining = live_groups - evicted
    if remaining < max(1, min_replicas):
        return (f"evicting {evicted} of {live_groups} groups leaves {remaining}, under the lighthouse's "
                f"min_replicas {min_replicas}")
    if remaining <= live_groups // 2:
        return (f"evicting {evicted} of {live_groups} groups leaves {remaining}, not more than half of the "
                f"{live_groups} groups that still heartbeat: the lighthouse forms no quorum (split brain guard)")
    return None


@dataclass(frozen=True)
class Probation:
    """How long an evicted group stays out: ``first_s`` the first time, doubled each time the same
    group is evicted again (a device still slow after it came back), at most ``max_s``."""

    first_s: float = 20.0
    max_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"probation {self.first_s} s (max {self.max_s} s): need 0 < first <= max")

    def seconds(self, evictions_before: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, evictions_before))
