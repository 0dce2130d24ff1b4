"""Answering the detector's probes: a short, fixed workload run by every rank between iterations.

When telemetry can only point at a TP group (its members run in lock-step, so all of them look
slow), the detector asks the group to run a probe (``probe.request``) and names the member whose
probe is slow (analytics/detection/incidents.py). The launcher, the only reader of the control topic, posts
each request in the store (trainer/reference/rendezvous.py: ``probe/Q``); ranks learn of it at their commit,
which carries the newest probe number, so every rank of the world runs it at the same iteration
boundary, after the optimizer step and outside any iteration's timings.

Every rank of the world runs the workload, not only the asked ones, for two reasons: the job is
paused anyway (a rank that skipped it would only wait for the others), and the reference a
healthy device takes is then measured under the same conditions — the world's median, which a
minority of slow devices cannot move. Only asked ranks publish a ``probe.result``.

* ``compute``: ``repeats`` times the matmul of one MLP projection on one micro-batch, padded by
  the fault injector exactly like a training chunk: its slow factor, and, when pacing, the
  emulated device time of one layer on one full-length sequence. Without pacing the matmul is at
  least 256 × 256 × 256, so a toy model still times milliseconds rather than the OS's sleep
  granularity.
* ``link``: ``repeats`` times a send of one activation (a micro-batch's tokens × width) to the next
  rank of the world, through the same send hook as pipeline sends, so a slow NIC shows up on the
  sender. Every receive is posted and the world meets at a barrier before the timed sends, so a
  sender never times its receiver's lateness (without it, one slow sender delays its successor's
  next receive and the delay travels round the ring). A world of one device has no link to time
  and answers with a zero-length duration.

The work is bounded (the launcher refuses a request over trainer/integration.py's
``probe_refusal`` bounds before any rank sees it; a compute probe also stops repeating after
``MAX_PROBE_S``). A link probe runs every repeat it asks for, since its sends pair ranks up and a
rank that stopped early would leave its peer waiting.

Each duration is the best of the repeats: noise from the OS (preemption, other ranks sharing the
cores) only ever adds time, and a slow device is slow in every repeat.

A dead rank does not answer, as with the simulator (trainer/sim/engine.py: ``SimEngine.probe``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from collector.events import ProbeRequest, ProbeResult
from trainer.faults import FaultInjector
from trainer.integration import MAX_PROBE_S, probe_answer
from trainer.reference.model import GPTConfig
from trainer.reference.schedule import paced_chunk_s

MIN_PROBE_DIM = 256


def compute_seconds(config: GPTConfig, faults: FaultInjector, repeats: int, pace_s_per_layer_token: float) -> float:
    """Best seconds of one compute-probe repeat on this rank, slow factor included."""
    t = config.block_size
    floor = 1 if pace_s_per_layer_token else MIN_PROBE_DIM
    rows, width = max(t, floor), max(config.n_embd, floor)
    x = torch.ones(rows, width, dtype=config.torch_dtype)
    w = torch.full((width, width), 1.0 / width, dtype=config.torch_dtype)
    paced_s = paced_chunk_s(pace_s_per_layer_token, layers=1, tp=1, tokens=t, seq_lens=[t])  # one device's layer
    samples: list[float] = []
    began = time.perf_counter()
    for _ in range(repeats):
        if samples and time.perf_counter() - began >= MAX_PROBE_S:
            break  # bounded in time as well as in repeats (trainer/integration.py's probe_refusal)
        start = time.perf_counter()
        x @ w
        faults.after_compute(time.perf_counter() - start, paced_s)
        samples.append(time.perf_counter() - start)
    return min(samples)


def link_seconds(config: GPTConfig, faults: FaultInjector, repeats: int, world_rank: int, world_size: int,
                 group: dist.ProcessGroup) -> float:
    """Best seconds of this rank's sends of one activation to the next rank (0.0 alone)."""
    if world_size < 2:
        return 0.0
    out = torch.zeros(config.block_size, config.n_embd, dtype=config.torch_dtype)
    into = torch.empty_like(out)
    to, frm = (world_rank + 1) % world_size, (world_rank - 1) % world_size
    samples = []
    for _ in range(repeats):
        recv = dist.irecv(into, src=frm, group=group)
        dist.barrier(group=group)
        start = time.perf_counter()
        faults.before_send()
        send = dist.isend(out, dst=to, group=group)
        assert send is not None and recv is not None  # None only on a rank outside the group
        send.wait()
        samples.append(time.perf_counter() - start)
        recv.wait()
    return min(samples)


def run_probe(request: ProbeRequest, device: int, world_rank: int, world_size: int, group: dist.ProcessGroup,
              config: GPTConfig, faults: FaultInjector, pace_s_per_layer_token: float) -> ProbeResult | None:
    """Run ``request`` on this rank (every rank of the world must call it, in the same order);
    this rank's answer, or None when it was not asked."""
    if request.target == "compute":
        seconds = compute_seconds(config, faults, request.repeats, pace_s_per_layer_token)
    else:
        seconds = link_seconds(config, faults, request.repeats, world_rank, world_size, group)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(everyone, torch.tensor([seconds], dtype=torch.float64), group=group)
    return probe_answer(request, device, seconds, [float(t) for t in everyone])
