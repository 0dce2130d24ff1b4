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

import math
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


class FaultSchedule:
    """The scripted faults of one run: those yet to start (``pending``), the ``active`` ones,
    every one that started (``history``), and the active ones' combined ``effects``. A fault
    starts when its iteration or time comes and ends after its duration; the engine asks
    :meth:`update` at every iteration boundary and clock move, and cuts its blocks of iterations
    where :meth:`changes_at` says the faults change."""

    def __init__(self, faults: list[FaultSpec], cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.pending = [(f.id or f"fault-{i}", f) for i, f in enumerate(faults)]
        self.active: list[ActiveFault] = []
        self.history: list[ActiveFault] = []
        self.effects = FaultEffects.of([], cluster)

    @staticmethod
    def _triggered(spec: FaultSpec, iteration: int, t_s: float) -> bool:
        return (spec.at_iteration is not None and iteration >= spec.at_iteration) or (
            spec.at_s is not None and t_s >= spec.at_s)

    @staticmethod
    def _ended(f: ActiveFault, iteration: int, t_s: float) -> bool:
        s = f.spec
        return (s.duration_iterations is not None and iteration >= f.start_iteration + s.duration_iterations) or (
            s.duration_s is not None and t_s >= f.start_s + s.duration_s)

    def update(self, iteration: int, t_s: float) -> list[ActiveFault]:
        """End the faults due to end and start the ones due to start, at ``iteration`` and ``t_s``
        (simulated seconds); returns those that ended, then those that started (each one's truth
        is published again)."""
        changed = []
        for f in [f for f in self.active if self._ended(f, iteration, t_s)]:
            f.end_iteration = iteration
            self.active.remove(f)
            changed.append(f)
        for fid, spec in [p for p in self.pending if self._triggered(p[1], iteration, t_s)]:
            self.pending.remove((fid, spec))
            f = ActiveFault(spec, fid, iteration, t_s)
            if spec.duration_iterations is not None:
                f.end_iteration = iteration + spec.duration_iterations
            self.active.append(f)
            self.history.append(f)
            changed.append(f)
        if changed:
            self.effects = FaultEffects.of(self.active, self.cluster)
        return changed

    def changes_at(self, iteration: int, t_s: float) -> bool:
        """Whether a fault would start or end at ``iteration`` and ``t_s``."""
        return any(self._triggered(s, iteration, t_s) for _, s in self.pending) or any(
            self._ended(f, iteration, t_s) for f in self.active)

    def next_change_s(self, now_s: float) -> float:
        """When the next timed fault starts or ends after ``now_s`` (inf when none is due)."""
        times = [s.at_s for _, s in self.pending if s.at_s is not None]
        times += [f.start_s + f.spec.duration_s for f in self.active if f.spec.duration_s is not None]
        return min((t for t in times if t > now_s), default=math.inf)
