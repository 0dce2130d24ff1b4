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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STOP_KEY = "resihp/relayout/stop"
STOPPED_KEY = "resihp/relayout/stopped"
RESUMED_KEY = "resihp/relayout/resumed"
PROBE_KEY = "resihp/relayout/probe"  # {number}: the newest probe the agent posted
PROBE_REQUEST_KEY = "resihp/relayout/probe/{number}"  # the probe.request itself
DEVICES_ENV = "RESIHP_DEVICES"  # comma-separated: the device each new world rank runs on
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


def devices_of(env_value: str | None, world: int) -> list[int]:
    """The device of each world rank: ``RESIHP_DEVICES`` when the agent set it, else the rank itself."""
    if not env_value:
        return list(range(world))
    devices = [int(d) for d in env_value.split(",")]
    if len(devices) != world or len(set(devices)) != world or min(devices) < 0:
        raise ValueError(f"{DEVICES_ENV}={env_value!r} must name {world} distinct devices, one per rank")
    return devices
