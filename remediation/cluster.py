"""The cluster as the planner sees it: which devices are healthy, slow (×f in compute or in their
links) or dead, and the hardware numbers the planner needs to cost a layout.

Only damaged devices are stored, so a 100,000-GPU cluster with three faults is three entries. A
cluster is built either from the detector's incidents (their ``Location`` lists, see
:func:`cluster_from_incidents`) or directly by whoever knows the truth (the oracle, the
benchmarks). Device ``d`` lives on node ``d // devices_per_node`` (the layout ``Plan.uniform``
produces, and the simulator's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from collector.events import FaultCategory, Location

DEAD_FACTOR = 1e3  # a slowdown at or above this is treated as a dead device
HEALTHY_TOLERANCE = 1.02  # factors below this are noise, not a fault


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know about the machines (defaults: 8×80 GB GPUs per node)."""

    devices_per_node: int = 8
    device_memory_bytes: int = 80 * 2**30
    memory_headroom: float = 0.6  # fraction of device memory usable for weights + optimizer state
    link_bandwidth_Bps: float = 25e9  # per-device bandwidth for activations and state moves (200 Gb/s)
    tp_overhead: float = 0.06  # extra time per doubling of the TP degree (all-reduce), healthy links

    @property
    def state_capacity_bytes(self) -> float:
        return self.device_memory_bytes * self.memory_headroom


@dataclass(frozen=True)
class DeviceState:
    """One damaged device. ``compute_factor``/``link_factor`` multiply its compute/comm times."""

    compute_factor: float = 1.0
    link_factor: float = 1.0
    dead: bool = False

    @property
    def healthy(self) -> bool:
        return not self.dead and self.compute_factor < HEALTHY_TOLERANCE and self.link_factor < HEALTHY_TOLERANCE


@dataclass(frozen=True)
class ClusterState:
    """Devices 0..num_devices-1; ``damaged`` holds the ones that are not healthy."""

    num_devices: int
    hardware: Hardware = field(default_factory=Hardware)
    damaged: Mapping[int, DeviceState] = field(default_factory=dict)

    def node_of(self, device: int) -> int:
        return device // self.hardware.devices_per_node

    def state(self, device: int) -> DeviceState:
        return self.damaged.get(device, _HEALTHY)

    def is_dead(self, device: int) -> bool:
        s = self.damaged.get(device)
        return s is not None and s.dead

    def is_healthy(self, device: int) -> bool:
        s = self.damaged.get(device)
        return s is None or s.healthy

    def compute_factor(self, device: int) -> float:
        s = self.damaged.get(device)
        return 1.0 if s is None else s.compute_factor

    def link_factor(self, device: int) -> float:
        s = self.damaged.get(device)
        return 1.0 if s is None else s.link_factor

    def bad_devices(self) -> set[int]:
        return {d for d, s in self.damaged.items() if not s.healthy}

    def dead_devices(self) -> set[int]:
        return {d for d, s in self.damaged.items() if s.dead}

    def alive_count(self) -> int:
        return self.num_devices - len(self.dead_devices())

    # ---- building -------------------------------------------------------------------------------

    def with_device(self, device: int, state: DeviceState) -> ClusterState:
        """A copy with ``device`` in ``state`` (factors of two reports on one device combine by max)."""
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} is outside the cluster's 0..{self.num_devices - 1}")
        old = self.damaged.get(device, _HEALTHY)
        new = DeviceState(
            compute_factor=max(old.compute_factor, state.compute_factor),
            link_factor=max(old.link_factor, state.link_factor),
            dead=old.dead or state.dead,
        )
        damaged = dict(self.damaged)
        if new.healthy:
            damaged.pop(device, None)
        else:
            damaged[device] = new
        return replace(self, damaged=damaged)

    def with_location(self, location: Location, category: FaultCategory | str = FaultCategory.FAIL_SLOW) -> ClusterState:
        """Apply one detector ``Location``. A fail-stop (or a factor ≥ DEAD_FACTOR) kills the
        device(s); a link fault slows both ends' communication; a node fault hits all its devices.
        A location that names nothing usable raises, naming the missing field."""
        dead = FaultCategory(category) == FaultCategory.FAIL_STOP or location.factor >= DEAD_FACTOR
        f = location.factor
        out = self
        if location.target == "node":
            if location.node is None:
                raise ValueError("a node location needs its node id; the detector must fill Location.node")
            per = self.hardware.devices_per_node
            for d in range(location.node * per, min((location.node + 1) * per, self.num_devices)):
                out = out.with_device(d, DeviceState(compute_factor=f, dead=dead))
        elif location.target == "link":
            ends = list(location.link) if location.link else ([location.rank] if location.rank is not None else [])
            if not ends:
                raise ValueError("a link location needs Location.link (a, b) or Location.rank")
            for d in ends:
                out = out.with_device(d, DeviceState(link_factor=f, dead=dead))
        else:
            if location.rank is None:
                raise ValueError("a compute location needs Location.rank")
            out = out.with_device(location.rank, DeviceState(compute_factor=f, dead=dead))
        return out


_HEALTHY = DeviceState()


def cluster_from_incidents(
    num_devices: int,
    incidents: Iterable[tuple[FaultCategory | str, Iterable[Location]]],
    hardware: Hardware | None = None,
) -> ClusterState:
    """The cluster implied by the open incidents: (category, locations) per incident."""
    cluster = ClusterState(num_devices, hardware or Hardware())
    for category, locations in incidents:
        for loc in locations:
            cluster = cluster.with_location(loc, category)
    return cluster


def cluster_from_faults(
    num_devices: int,
    faults: Mapping[int, DeviceState],
    hardware: Hardware | None = None,
) -> ClusterState:
    """A cluster from exact per-device truth (the oracle and the benchmarks)."""
    cluster = ClusterState(num_devices, hardware or Hardware())
    for d, s in faults.items():
        cluster = cluster.with_device(d, s)
    return cluster
