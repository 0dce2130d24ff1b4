"""The cluster as the planner sees it: which devices are healthy, slow (×f in compute or in their
links) or dead, and the hardware numbers the planner needs to cost a layout.

Only damaged devices (and slow links, as device pairs) are stored, so a 100,000-GPU cluster with
three faults is three entries. A slow link slows traffic between its two ends only (a TP
all-reduce whose group holds both, a pipeline transfer or DP ring joining them), a slow NIC
(a link location naming one rank) all of that device's traffic that leaves its node, exactly as
the simulator applies them. A
cluster is built either from the detector's incidents (their ``Location`` lists, see
:func:`cluster_from_incidents`) or directly by whoever knows the truth (the oracle, the
benchmarks). Device ``d`` lives on node ``d // devices_per_node`` (the layout ``Plan.uniform``
produces, and the simulator's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from collector.events import FaultCategory, Location
from collector.topology import slowest_link_between

DEAD_FACTOR = 1e3  # a slowdown at or above this is treated as a dead device
HEALTHY_TOLERANCE = 1.02  # factors below this are noise, not a fault


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know about the machines (defaults: 8×80 GB GPUs per node)."""

    devices_per_node: int = 8
    device_memory_bytes: int = 80 * 2**30
    memory_headroom: float = 0.6  # fraction of device memory usable for weights + optimizer state
    link_bandwidth_Bps: float = 50e9  # per-device bandwidth between nodes (one 400 Gb/s NIC per GPU)
    intra_node_bandwidth_Bps: float = 300e9  # per-device bandwidth inside a node (NVLink)
    link_latency_s: float = 10e-6  # per message hop

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
    """Devices 0..num_devices-1; ``damaged`` holds the ones that are not healthy, ``links`` the
    slow device pairs (frozenset({a, b}) → slowdown)."""

    num_devices: int
    hardware: Hardware = field(default_factory=Hardware)
    damaged: Mapping[int, DeviceState] = field(default_factory=dict)
    links: Mapping[frozenset[int], float] = field(default_factory=dict)

    def _link_ends(self) -> set[int]:
        return {d for key in self.links for d in key}

    def node_of(self, device: int) -> int:
        return device // self.hardware.devices_per_node

    def state(self, device: int) -> DeviceState:
        return self.damaged.get(device, _HEALTHY)

    def is_dead(self, device: int) -> bool:
        s = self.damaged.get(device)
        return s is not None and s.dead

    def is_healthy(self, device: int) -> bool:
        s = self.damaged.get(device)
        if s is not None and not s.healthy:
            return False
        return not self.links or device not in self._link_ends()

    def compute_factor(self, device: int) -> float:
        s = self.damaged.get(device)
        return 1.0 if s is None else s.compute_factor

    def link_factor(self, device: int) -> float:
        """The worst slowdown of any traffic of ``device`` (its NIC, or a slow link it ends)."""
        s = self.damaged.get(device)
        worst = 1.0 if s is None else s.link_factor
        for key, f in self.links.items():
            if device in key:
                worst = max(worst, f)
        return worst

    def comm_factor(self, group_a: tuple[int, ...], group_b: tuple[int, ...]) -> float:
        """Slowdown of traffic between two device groups (the same group for a TP all-reduce): the
        worst slow link with one end in each, or a slow NIC on a path that leaves a node."""
        worst = slowest_link_between(self.links, group_a, group_b)
        if self.damaged:
            nics = [self.damaged[d].link_factor for d in (*group_a, *group_b) if d in self.damaged]
            if nics and max(nics) > 1.0 and len({self.node_of(d) for d in (*group_a, *group_b)}) > 1:
                worst = max(worst, max(nics))
        return worst

    def bad_devices(self) -> set[int]:
        return {d for d, s in self.damaged.items() if not s.healthy} | self._link_ends()

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

    def with_link(self, a: int, b: int, factor: float) -> ClusterState:
        """A copy where transfers between ``a`` and ``b`` take ``factor`` × longer (max with a known one)."""
        for d in (a, b):
            if not 0 <= d < self.num_devices:
                raise ValueError(f"device {d} is outside the cluster's 0..{self.num_devices - 1}")
        key = frozenset((a, b))
        links = dict(self.links)
        f = max(links.get(key, 1.0), factor)
        if f < HEALTHY_TOLERANCE:
            links.pop(key, None)
        else:
            links[key] = f
        return replace(self, links=links)

    def with_location(self, location: Location, category: FaultCategory | str = FaultCategory.FAIL_SLOW) -> ClusterState:
        """Apply one detector ``Location``. A fail-stop (or a factor ≥ DEAD_FACTOR) kills the
        device(s); a link fault slows both ends' communication; a node fault hits all its devices.

        A compute location that names only a TP group (``rank`` unset, ``tp_group`` set: the
        detector's call for a lock-step group before a probe names the member) marks every
        member slow (or dead) by the factor. The group runs at its slowest member's speed, so the
        stage costs what it really costs; the planner cannot exclude a member it does not know,
        so it plans around the whole group (fewer layers or micro-batches, or without the stage).

        Raises :class:`Unlocatable` when the location names no device (a link with neither
        ``link`` nor ``rank``, a compute location with neither ``rank`` nor ``tp_group``, a node
        location without ``node``) and ValueError for a device outside the cluster."""
        dead = FaultCategory(category) == FaultCategory.FAIL_STOP or location.factor >= DEAD_FACTOR
        f = location.factor
        out = self
        if location.target == "node":
            if location.node is None:
                raise Unlocatable("a node location needs its node id; the detector must fill Location.node")
            per = self.hardware.devices_per_node
            for d in range(location.node * per, min((location.node + 1) * per, self.num_devices)):
                out = out.with_device(d, DeviceState(compute_factor=f, dead=dead))
        elif location.target == "link":
            if location.link and not dead:
                out = out.with_link(location.link[0], location.link[1], f)
            else:
                ends = list(location.link) if location.link else ([location.rank] if location.rank is not None else [])
                if not ends:
                    raise Unlocatable("a link location names neither its ends (Location.link) nor a rank's NIC "
                                      "(Location.rank); wait for a probe to confirm where it is")
                for d in ends:  # one end named: its NIC is slow
                    out = out.with_device(d, DeviceState(link_factor=f, dead=dead))
        elif location.rank is not None:
            out = out.with_device(location.rank, DeviceState(compute_factor=f, dead=dead))
        elif location.tp_group:
            for d in location.tp_group:
                out = out.with_device(d, DeviceState(compute_factor=f, dead=dead))
        else:
            raise Unlocatable("a compute location needs Location.rank (or at least Location.tp_group)")
        return out


class Unlocatable(ValueError):
    """A detector location that names no device: nothing can be planned around it yet."""


def precision(location: Location) -> str:
    """How exactly ``location`` names its devices: "device" (a rank, a link's ends, a node),
    "group" (a compute fault on a TP group, member unknown) or "none" (nothing usable)."""
    if location.target == "node":
        return "device" if location.node is not None else "none"
    if location.target == "link":
        return "device" if location.link or location.rank is not None else "none"
    if location.rank is not None:
        return "device"
    return "group" if location.tp_group else "none"


_HEALTHY = DeviceState()


def cluster_from_incidents(
    num_devices: int,
    incidents: Iterable[tuple[FaultCategory | str, Iterable[Location]]],
    hardware: Hardware | None = None,
    skipped: list[tuple[Location, str]] | None = None,
) -> ClusterState:
    """The cluster implied by the open incidents: (category, locations) per incident.

    A location that cannot be applied (names no device, or a device outside the cluster) raises
    — unless ``skipped`` is given, where it is appended with the reason and left out, so one bad
    location does not stop planning around the others."""
    cluster = ClusterState(num_devices, hardware or Hardware())
    for category, locations in incidents:
        for loc in locations:
            try:
                cluster = cluster.with_location(loc, category)
            except ValueError as exc:
                if skipped is None:
                    raise
                skipped.append((loc, str(exc)))
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
