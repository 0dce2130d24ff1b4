"""Node plans: when the detector blames a whole node, plan without it and order it to stop.

A node is **blamed** when the open incidents make at least ``min_bad_devices`` of its devices bad
(slow compute, a slow NIC, dead; a node location makes all of them so) and the running plan uses it.
A slow link between two devices is not a node's fault and does not count. Device ``d`` is on node
``d // devices_per_node`` (remediation/cluster.py), which is the node agent's group rank when every
agent runs ``devices_per_node`` ranks: torch's elastic agent numbers global ranks by group rank.

The **exclusion** is scored by the same planner and cost model as every in-job reshape: the
planner's answer on the cluster with the blamed nodes' devices dead (:func:`without_nodes`). The
node plan is chosen (:func:`choose`) when the in-job winner already leaves every blamed device
unused (the node then runs nothing, and stopping it costs the job nothing), or when the exclusion
trains more over the horizon than the in-job winner. Otherwise the in-job plan is proposed as it is.

What a node plan orders (:func:`stop_orders`) is a ``stop`` per blamed node, carried in the proposal
(``PlanProposed.node_orders``) and issued as ``command.node`` once the plan's layout is applied
(remediation/lifecycle.py's reactions), and (:func:`join_orders`) a ``join`` of a waiting spare into
each stopped node's place while spares with the node's number of ranks say they wait (``node.spare``,
trainer/agent/commands.py's ``JoinOrders``); the spare holds the order until the place is published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from collector.events import NodeOrder
from collector.plan import Plan
from remediation.cluster import ClusterState, DeviceState
from remediation.plan_result import PlanResult


@dataclass(frozen=True)
class NodeSettings:
    """Whether and how the engine orders nodes. ``run`` is the job's rendezvous id (its agents'
    ``--rdzv-id``): an agent refuses an order that names no run or another, so without it the
    engine plans no node orders (it says so when a node is blamed). ``round`` is the rendezvous
    round orders name until an agent's ``command.node_ack`` tells the one it runs."""

    run: str | None = None
    round: int = 0
    min_bad_devices: int = 2  # capped at the node's device count: a one-device node is blamed by its device


def node_devices(cluster: ClusterState, node: int) -> list[int]:
    per = cluster.hardware.devices_per_node
    return list(range(node * per, min((node + 1) * per, cluster.num_devices)))


def blamed_nodes(cluster: ClusterState, plan: Plan, min_bad_devices: int) -> dict[int, str]:
    """Node -> why it is blamed, for the nodes the running ``plan`` uses that hold at least
    ``min_bad_devices`` bad devices (capped at the devices per node)."""
    need = max(1, min(min_bad_devices, cluster.hardware.devices_per_node))
    used = {cluster.node_of(d) for d in plan.devices}
    bad: dict[int, list[str]] = {}
    for d, st in sorted(cluster.damaged.items()):
        if st.healthy or cluster.node_of(d) not in used:
            continue
        if st.dead:
            what = "dead"
        elif st.link_factor > st.compute_factor:
            what = f"NIC ×{st.link_factor:.2f}"
        else:
            what = f"slow ×{st.compute_factor:.2f}"
        bad.setdefault(cluster.node_of(d), []).append(f"{d} {what}")
    per = cluster.hardware.devices_per_node
    return {node: f"{len(found)} of its {per} devices are bad ({', '.join(found)})"
            for node, found in sorted(bad.items()) if len(found) >= need}


def without_nodes(cluster: ClusterState, nodes: Mapping[int, str] | list[int]) -> ClusterState:
    """``cluster`` with every device of ``nodes`` dead: what the job has once they stop."""
    out = cluster
    for node in nodes:
        for d in node_devices(cluster, node):
            out = out.with_device(d, DeviceState(dead=True))
    return out


def choose(in_job: PlanResult | None, excluded: PlanResult | None, devices: set[int]) -> PlanResult | None:
    """The plan to propose with the nodes' stop orders, or None to propose ``in_job`` as it is.

    ``in_job`` is the planner's pick on the cluster as the incidents describe it (None: nothing worth
    applying), ``excluded`` its pick without the blamed nodes (None: nothing worth applying, or
    refused), ``devices`` the blamed nodes' devices. A plan that uses any of them cannot stop them."""
    leaves_out = [r for r in (in_job, excluded) if r is not None and not devices & set(r.plan.devices)]
    if not leaves_out:
        return None
    best = max(leaves_out, key=lambda r: r.horizon_tokens)
    if in_job is not None and best is not in_job and best.horizon_tokens <= in_job.horizon_tokens:
        return None  # keeping (part of) the node trains more: the in-job reshape wins
    return best


def stop_orders(plan_id: str, blamed: Mapping[int, str], cluster: ClusterState, settings: NodeSettings,
                round_: int) -> list[NodeOrder]:
    """One ``stop`` per blamed node, with the command id the engine will issue it under."""
    return [NodeOrder(command_id=f"node-stop-{node}-{plan_id}"[:200], node=node, action="stop", round=round_,
                      run=settings.run, devices=node_devices(cluster, node), reason=f"node {node}: {why}"[:2000])
            for node, why in sorted(blamed.items())]


def join_orders(plan_id: str, stops: list[NodeOrder], spares: list[str]) -> list[NodeOrder]:
    """A ``join`` per stopped node while waiting spares last (in ``stops``' order, one spare each):
    the spare takes the place the node leaves, with the node's ranks, as soon as it is published
    (the agent holds the order until then), so the job grows back to its size on new hardware."""
    return [NodeOrder(command_id=f"node-join-{stop.node}-{plan_id}"[:200], node=stop.node, action="join",
                      round=stop.round, run=stop.run, devices=stop.devices, spare=spare,
                      reason=f"node {stop.node}: spare {spare} takes its place"[:2000])
            for stop, spare in zip(stops, spares)]


def order_line(order: NodeOrder) -> str:
    """The diff's line for one order."""
    devices = f"devices {order.devices[0]}–{order.devices[-1]}" if order.devices else "no devices known"
    if order.action == "join":
        return (f"join spare {order.spare or '(any)'} into node {order.node}'s place ({devices}, rendezvous round "
                f"{order.round}) once the node has left")
    return (f"{order.action} node {order.node} ({devices}, rendezvous round {order.round}) once the plan runs: "
            f"{order.reason.removeprefix(f'node {order.node}: ')}")
