"""Restart at a new layout: the agent asks, the ranks stop together at a step boundary and save, the
agent starts the new world, the ranks resume from what they saved.

For a job whose framework runs one regular layout (torchtitan: one DeviceMesh, one schedule) a
reshape is a restart, and what makes it cheap and exact is the hand-over, in the ranks' bootstrap
store of the round (MASTER_ADDR/MASTER_PORT), every record signed (trainer/agent/signed_store.py):

    stop      the agent writes ``resihp/relayout/stop`` {epoch, command}: stop for plan ``epoch``
    agree     at every step boundary the job's rank 0 checks for that record and the ranks take the
              max of what it found (one all-reduce of one number): every rank stops after the same
              step, whatever moment the record landed
    save      every rank writes the checkpoint of that step (the framework's own, resharded on load)
    stopped   rank 0 writes ``resihp/relayout/stopped`` {epoch, step} and every rank exits 0
    start     the agent starts the new world (its process count, flags, and the device of each rank)
    resumed   the new world's rank 0, after its first step, writes ``resihp/relayout/resumed``
              {epoch, step} in the new round's store; the agent acknowledges the command

The same agreement carries the detector's probes (``probe.request``, read by the agent): the agent
posts each as ``resihp/relayout/probe/<n>`` and the newest ``n`` as ``resihp/relayout/probe``; rank
0 reads the number at the step boundary, the all-reduce spreads it, and every rank runs the probes
it has not run yet at that boundary, outside any step's timings.

What can fail: a rank that dies before ``stopped`` turns the stop into a failure (torch's restart
from the last checkpoint, at the old layout); a new world that never writes ``resumed`` within the
agent's deadline is reported as a failed command. A forged stop record is refused and reported,
never obeyed: a stranger who reaches the store cannot stop the job.

Across nodes every node's agent restarts its own share of the new world in the same rendezvous
round. The leader (the agent of the round's group rank 0, the only one on the bus) writes, before
the stop, ``resihp/relayout/order`` {epoch, command, devices, flags}: the new world's devices in
world-rank order and the flags it runs with. Each agent starts, once ``stopped`` is written and its
ranks are gone, the order's devices that are its own (``resihp/relayout/node/<group rank>``: the
devices each node has, written by its agent every round) — so the new round's world is the
order's, and torch's rendezvous is the barrier. A node with none of the order's devices leaves the
job: its agent takes itself out of the rendezvous and ends (the leader orders that only when the
job's ``--nnodes`` minimum allows it and the node does not serve the rendezvous). A round of
another size than the layout it was
meant for (a node gone, or a node that lost a device) is laid out by every agent alike from the
job's last shape (the same rule, the same inputs, no exchange): the uniform layout of exactly
that many ranks.

A node that joins a running job (an agent started later, or again after its node came back) waits
in the rendezvous; torch would restart every node at once and lose the steps since the last
checkpoint. Instead the leader writes a stop order for the next epoch with no order of devices
(command ``grow``): the ranks stop after the same step and save, and every agent then restarts its
share into the round the joiner completes, which is laid out like any round of another size. The
joiner learns what the job runs from the record the leader keeps in the job's own store, which
outlives rounds (``resihp/relayout/shape``: the shape, and ``high``, one past every device the job
has ever had); its devices are new numbers from ``high`` on, claimed with a counter so that two
joiners never share one (a counter is a hint: a claim below ``high`` is not taken).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STOP_KEY = "resihp/relayout/stop"
STOPPED_KEY = "resihp/relayout/stopped"
RESUMED_KEY = "resihp/relayout/resumed"
PROBE_KEY = "resihp/relayout/probe"  # {number}: the newest probe the agent posted
PROBE_REQUEST_KEY = "resihp/relayout/probe/{number}"  # the probe.request itself
ORDER_KEY = "resihp/relayout/order"  # {epoch, command, devices, flags}: the new world, from the leader
NODE_KEY = "resihp/relayout/node/{group_rank}"  # {devices, hosts}: a node's devices, from its agent
SHAPE_KEY = "resihp/relayout/shape"  # job store: {shape, high}, from the leader: what a joining node lays out from
JOINED_KEY = "resihp/relayout/joined/{high}"  # job store counter: devices joining nodes claimed from ``high`` on
GROW_COMMAND = "grow"  # the command a stop order names when it makes room for a joining node
DEVICES_ENV = "RESIHP_DEVICES"  # comma-separated: the device of each of this node's ranks, by local rank
EPOCH_ENV = "RESIHP_PLAN_EPOCH"  # the plan epoch the new world runs


@dataclass(frozen=True)
class StopOrder:
    epoch: int
    command: str

    @classmethod
    def parse(cls, body: Any) -> StopOrder:
        if not isinstance(body, dict) or not isinstance(body.get("epoch"), int) or body["epoch"] < 1 \
                or not isinstance(body.get("command"), str):
            raise ValueError("a stop order is {epoch: int >= 1, command: str}")
        return cls(body["epoch"], body["command"][:200])


@dataclass(frozen=True)
class StepMark:
    """Where the job stopped (``stopped``) or resumed (``resumed``): the plan epoch and the step."""

    epoch: int
    step: int

    @classmethod
    def parse(cls, body: Any) -> StepMark:
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) and body[k] >= 0
                                                 for k in ("epoch", "step")):
            raise ValueError("a step mark is {epoch: int >= 0, step: int >= 0}")
        return cls(body["epoch"], body["step"])


@dataclass(frozen=True)
class ProbeNumber:
    """The newest probe the agent posted (``PROBE_KEY``): ranks run every one up to it."""

    number: int

    @classmethod
    def parse(cls, body: Any) -> ProbeNumber:
        if not isinstance(body, dict) or not isinstance(body.get("number"), int) or body["number"] < 1:
            raise ValueError("a probe number is {number: int >= 1}")
        return cls(body["number"])


def devices_of(env_value: str | None, local_world: int, first_rank: int = 0) -> list[int]:
    """The device of each of this node's ranks, by local rank: ``RESIHP_DEVICES`` when the agent
    set it, else the world ranks themselves (``first_rank`` onward: a job owns devices 0..N-1)."""
    if not env_value:
        return list(range(first_rank, first_rank + local_world))
    devices = [int(d) for d in env_value.split(",")]
    if len(devices) != local_world or len(set(devices)) != local_world or min(devices) < 0:
        raise ValueError(f"{DEVICES_ENV}={env_value!r} must name {local_world} distinct devices, one per local rank")
    return devices


@dataclass(frozen=True)
class RelayoutOrder:
    """The world a leader's stop order leads to: its devices in world-rank order and its flags."""

    epoch: int
    command: str
    devices: tuple[int, ...]
    flags: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "command": self.command, "devices": list(self.devices), "flags": list(self.flags)}

    @classmethod
    def parse(cls, body: Any) -> RelayoutOrder:
        if not isinstance(body, dict) or not isinstance(body.get("epoch"), int) or body["epoch"] < 1 \
                or not isinstance(body.get("command"), str):
            raise ValueError("a relayout order is {epoch: int >= 1, command: str, devices: [int], flags: [str]}")
        devices, flags = body.get("devices"), body.get("flags")
        if not isinstance(devices, list) or not devices or len(devices) > 65536 or \
                not all(isinstance(d, int) and d >= 0 for d in devices) or len(set(devices)) != len(devices):
            raise ValueError("a relayout order names distinct non-negative devices")
        if not isinstance(flags, list) or len(flags) > 64 or not all(isinstance(f, str) and len(f) <= 200 for f in flags):
            raise ValueError("a relayout order's flags are at most 64 strings")
        return cls(body["epoch"], body["command"][:200], tuple(devices), tuple(flags))

    def share(self, node_devices: Sequence[int]) -> list[int]:
        """The order's devices on a node that has ``node_devices``, in world-rank order."""
        mine = set(node_devices)
        return [d for d in self.devices if d in mine]


@dataclass(frozen=True)
class NodeRecord:
    """What a node's agent says of its node each round (``NODE_KEY``): its devices, and whether it
    serves the job's rendezvous (a node that does cannot leave the job while it runs)."""

    devices: tuple[int, ...]
    hosts_rendezvous: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "hosts": self.hosts_rendezvous}

    @classmethod
    def parse(cls, body: Any) -> NodeRecord:
        devices = body.get("devices") if isinstance(body, dict) else None
        if not isinstance(devices, list) or len(devices) > 65536 or \
                not all(isinstance(d, int) and d >= 0 for d in devices) or \
                not isinstance(body.get("hosts", False), bool):
            raise ValueError("a node record is {devices: [int >= 0], hosts: bool}")
        return cls(tuple(devices), body.get("hosts", False))
