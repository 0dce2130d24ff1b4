"""Chunk and communication times: the simulator's truth before noise and faults.

Per stage, a chunk of N tokens whose packed documents have lengths lᵢ costs

    compute  = (24·h²·N + 2·h·Σlᵢ²) · layers / (tp · effective FLOP/s)   (forward; causal attention)
             + 2·h·V·N / (tp · FLOP/s) on the last stage (the LM head)
    overhead = layers · layer_overhead_s
    tp comm  = 2 ring all-reduces of N·h·bytes per layer when tp > 1 (NVLink inside a node)

so it has the platform's α·N + β·Σlᵢ² + γ form. Backward is twice the forward's compute; the
zero-bubble split gives B (input gradients) = linear + 2·attention and W (weight gradients) =
linear. Pipeline transfers move N·h·bytes / tp per TP rank; the DP gradient all-reduce is a ring of
each stage's parameters / tp over the replicas, over the NICs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from collector.plan import PipelinePlan, Plan
from trainer.sim.presets import ClusterSpec, ModelSpec


def ring_allreduce_s(message_bytes: float, members: int, gbps: float, latency_s: float) -> float:
    """Ring all-reduce: 2(n−1)/n of the message over each link, 2(n−1) latency hops."""
    if members <= 1:
        return 0.0
    return 2 * (members - 1) / members * message_bytes * 8 / (gbps * 1e9) + 2 * (members - 1) * latency_s


@dataclass(frozen=True)
class StageCoefficients:
    """Per (replica, stage) coefficients of a group of same-shaped replicas; arrays are (R, S)."""

    replicas: list[int]  # plan replica ids, in row order
    linear_s_per_token: np.ndarray  # forward linear-layer compute per token
    attn_s_per_sq_token: np.ndarray  # forward attention compute per Σlᵢ²
    overhead_s: np.ndarray  # per chunk
    tp_comm_s_per_token: np.ndarray  # per chunk (forward or backward), per token
    tp_comm_latency_s: np.ndarray
    p2p_s_per_token: np.ndarray  # link stage s -> (s+1) % S
    p2p_latency_s: np.ndarray


def _same_node(cluster: ClusterSpec, devices: tuple[int, ...]) -> bool:
    return len({cluster.node_of(d) for d in devices}) == 1


def stage_coefficients(model: ModelSpec, cluster: ClusterSpec, plan: Plan, replicas: list[int]) -> StageCoefficients:
    pipes: list[PipelinePlan] = [plan.pipelines[r] for r in replicas]
    R, S = len(pipes), len(pipes[0].stages)
    h, bpv, flops = model.hidden, model.bytes_per_value, cluster.effective_flops
    shape = (R, S)
    lin, attn, over = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    tpc, tpl, p2p, p2pl = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for i, pipe in enumerate(pipes):
        for s, st in enumerate(pipe.stages):
            n, tp = st.num_layers, st.tp
            lin[i, s] = n * 24 * h * h / (tp * flops)
            if s == S - 1:
                lin[i, s] += 2 * h * model.vocab / (tp * flops)
            attn[i, s] = n * 2 * h / (tp * flops)
            over[i, s] = n * cluster.layer_overhead_s
            if tp > 1:
                gbps = cluster.intra_node_gbps if _same_node(cluster, st.devices) else cluster.inter_node_gbps
                per_token = ring_allreduce_s(h * bpv, tp, gbps, 0.0)
                tpc[i, s] = 2 * n * per_token
                tpl[i, s] = 2 * n * 2 * (tp - 1) * cluster.link_latency_s
            nxt = pipe.stages[(s + 1) % S]
            same = cluster.node_of(st.devices[0]) == cluster.node_of(nxt.devices[0])
            gbps = cluster.intra_node_gbps if same else cluster.inter_node_gbps
            p2p[i, s] = h * bpv * 8 / (min(tp, nxt.tp) * gbps * 1e9)
            p2pl[i, s] = cluster.link_latency_s
    return StageCoefficients(list(replicas), lin, attn, over, tpc, tpl, p2p, p2pl)


def dp_allreduce_s(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> float:
    """The gradient all-reduce after the slowest replica: a ring over replicas, as long as the
    largest per-device gradient shard of any replica (replicas may differ in TP degree and layer
    split; the device holding the most bytes finishes last)."""
    if plan.dp <= 1:
        return 0.0
    grad_bytes = max(st.num_layers * model.params_per_layer / st.tp * model.bytes_per_value
                     for pipe in plan.pipelines for st in pipe.stages)
    return ring_allreduce_s(grad_bytes, plan.dp, cluster.inter_node_gbps, cluster.link_latency_s)


def healthy_chunk_s(model: ModelSpec, cluster: ClusterSpec, plan: Plan, tokens: float, sum_sq: float) -> dict[str, float]:
    """Replica 0 stage 0's F / B / W times for one micro-batch: a reference for docs and tests."""
    c = stage_coefficients(model, cluster, plan, [0])
    lin = c.linear_s_per_token[0, 0] * tokens
    att = c.attn_s_per_sq_token[0, 0] * sum_sq
    comm = c.tp_comm_s_per_token[0, 0] * tokens + c.tp_comm_latency_s[0, 0]
    o = c.overhead_s[0, 0]
    return {"F": lin + att + o + comm, "B": 2 * (lin + att) + o + comm,
            "B_input": lin + 2 * att + o / 2 + comm, "W": lin + o / 2}
