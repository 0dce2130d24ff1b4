"""Injected faults in the simulator: what they do to the cluster and the truth events they produce.

The fault specs are the trainer's too (trainer/fault_spec.py: one vocabulary, one scenario format).
The kinds the simulator injects: ``slow_compute`` (a device computes ``factor`` times slower), ``slow_link`` (transfers
between two devices take ``factor`` times longer), ``slow_nic`` (all of a device's inter-node
traffic takes ``factor`` times longer), ``stop_device`` and ``stop_node`` (fail-stop: the device
or every device of the node stops; the job hangs until it is reshaped around them).

Onset by iteration (``at_iteration``) or by simulated time (``at_s``, seconds since the job
started); recovery after ``duration_iterations`` or ``duration_s`` (neither: it lasts). Each fault
produces a ``truth.fault`` event at onset; one that ends, or whose end was not known at onset, is
re-published with the same ``fault_id`` and its ``end_iteration`` when it ends (the last one wins).
"""

from __future__ import annotations

from dataclasses import dataclass

from collector.events import FaultInjected, Location
from collector.plan import Plan
from collector.topology import slowest_link_between
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import ClusterSpec


@dataclass
class ActiveFault:
    spec: FaultSpec
    fault_id: str
    start_iteration: int
    start_s: float
    end_iteration: int | None = None


def devices_of(spec: FaultSpec, cluster: ClusterSpec) -> set[int]:
    if spec.kind == "stop_node":
        assert spec.node is not None
        first = spec.node * cluster.gpus_per_node
        return set(range(first, min(first + cluster.gpus_per_node, cluster.gpus)))
    if spec.kind == "slow_link":
        assert spec.link is not None
        return set(spec.link)
    assert spec.device is not None
    return {spec.device}


def location_of(spec: FaultSpec, cluster: ClusterSpec, plan: Plan) -> Location:
    """Where the fault is, with the coordinates it has under ``plan`` (if the device is in it)."""
    if spec.kind == "stop_node":
        return Location(target="node", node=spec.node, factor=1e9)
    if spec.kind == "slow_link":
        return Location(target="link", link=spec.link, factor=spec.factor)
    d = spec.device
    assert d is not None
    role = plan.roles.get(d)
    stage = None if role is None else plan.pipelines[role.replica].stages[role.stage]
    return Location(target="link" if spec.kind == "slow_nic" else "compute", rank=d, node=cluster.node_of(d),
                    factor=1e9 if spec.kind == "stop_device" else spec.factor,
                    replica=None if role is None else role.replica, stage=None if role is None else role.stage,
                    tp_group=None if stage is None else stage.devices)


def truth_event_payload(f: ActiveFault, cluster: ClusterSpec, plan: Plan) -> FaultInjected:
    return FaultInjected(
        fault_id=f.fault_id, category=f.spec.category, location=location_of(f.spec, cluster, plan),
        start_iteration=f.start_iteration, end_iteration=f.end_iteration,
    )


@dataclass
class FaultEffects:
    """The combined effect of the active faults (factors multiply)."""

    compute: dict[int, float]  # device -> slowdown
    links: dict[frozenset[int], float]  # {a, b} -> slowdown of transfers between them
    nics: dict[int, float]  # device -> slowdown of its inter-node traffic
    dead: set[int]

    @classmethod
    def of(cls, active: list[ActiveFault], cluster: ClusterSpec) -> FaultEffects:
        out = cls({}, {}, {}, set())
        for f in active:
            s, d = f.spec, f.spec.device
            if s.kind == "slow_compute" and d is not None:
                out.compute[d] = out.compute.get(d, 1.0) * s.factor
            elif s.kind == "slow_link" and s.link is not None:
                key = frozenset(s.link)
                out.links[key] = out.links.get(key, 1.0) * s.factor
            elif s.kind == "slow_nic" and d is not None:
                out.nics[d] = out.nics.get(d, 1.0) * s.factor
            else:
                out.dead |= devices_of(s, cluster)
        return out

    def comm_factor(self, cluster: ClusterSpec, group_a: tuple[int, ...], group_b: tuple[int, ...]) -> float:
        """Slowdown of a transfer (or collective) between two device groups (the same group for
        TP): the worst slow link joining them, or slow NIC on a path that leaves a node."""
        worst = slowest_link_between(self.links, group_a, group_b)
        if self.nics:
            nodes = {cluster.node_of(d) for d in group_a + group_b}
            if len(nodes) > 1:
                for d in group_a + group_b:
                    worst = max(worst, self.nics.get(d, 1.0))
        return worst

    def compute_factor(self, devices: tuple[int, ...]) -> float:
        """A TP group runs in lock-step: it is as slow as its slowest member."""
        return max((self.compute.get(d, 1.0) for d in devices), default=1.0)
