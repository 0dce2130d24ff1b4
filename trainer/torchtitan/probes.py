"""A torchtitan rank's answers to the detector's probes: a fixed matmul or a fixed send, timed by every rank.

The detector asks a probe when telemetry cannot tell which member of a group is slow (members of a
TP group, or an FSDP group, wait for each other inside every chunk). The agent posts the request in
the ranks' store; the ranks run it together at one step boundary (trainer/torchtitan/trainer.py),
outside any step's timings, so the probe times the device and nothing else. Every rank runs it, not
only the asked ones: the job pauses anyway, and the reference a healthy device takes is then the
world's median, measured under the same conditions (trainer/integration.py's ``probe_answer``).

The workload is ``repeats`` matmuls of 256 × 256 fp32 on the rank's device, each padded by the
rank's injected slowdown as a training chunk is (trainer/faults.py), best of the repeats
(``best_seconds``: noise only adds time), bounded by ``MAX_PROBE_S``. On a GPU the clock stops
after a synchronise.

A link probe (asked when no member computes slow and the time went to a link or a NIC) is
``repeats`` sends of one 256 × 256 fp32 buffer (256 KiB) from each rank to the next world rank, on
the job's own process group and devices (a torchtitan rank injects no send delay: its faults are
compute faults, trainer/torchtitan/telemetry.py). Every receive is posted and the world meets at a barrier
before each timed send, so a sender never times its receiver's lateness; every repeat runs (the
sends pair ranks up: a rank that stopped early would leave its peer waiting). A world of one rank
has no link and answers 0 s against the reference of 1 s.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from collector.events import ProbeRequest, ProbeResult
from trainer.faults import FaultInjector
from trainer.integration import best_seconds, probe_answer

PROBE_DIM = 256


def compute_seconds(repeats: int, injector: FaultInjector | None, device: torch.device) -> float:
    """Best seconds of one repeat of the compute probe on ``device``, injected slowdown included."""
    x = torch.ones(PROBE_DIM, PROBE_DIM, device=device)
    w = torch.full((PROBE_DIM, PROBE_DIM), 1.0 / PROBE_DIM, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def once() -> None:
        start = time.perf_counter()
        x @ w
        if sync is not None:
            sync()
        if injector is not None:
            injector.after_compute(time.perf_counter() - start)

    return best_seconds(once, repeats, sync=sync)


def link_seconds(repeats: int, device: torch.device) -> float:
    """Best seconds of this rank's sends of the probe's buffer to the next world rank (0.0 alone).
    A collective: every rank of the world calls it with the same ``repeats``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0
    out = torch.ones(PROBE_DIM, PROBE_DIM, device=device)
    into = torch.empty_like(out)
    to, frm = (rank + 1) % world, (rank - 1) % world
    samples = []
    for _ in range(repeats):
        recv = dist.irecv(into, src=frm)
        dist.barrier()
        start = time.perf_counter()
        send = dist.isend(out, dst=to)
        assert send is not None and recv is not None  # None only on a rank outside the world
        send.wait()
        samples.append(time.perf_counter() - start)
        recv.wait()
    return min(samples)


def answer_probe(request: ProbeRequest, device_id: int, injector: FaultInjector | None,
                 device: torch.device) -> ProbeResult | None:
    """Run ``request`` on this rank with every other rank of the world and return this rank's
    answer (None when it was not asked). A collective: every rank must call it for the same request."""
    if request.target == "link":
        seconds = link_seconds(request.repeats, device)
    else:
        seconds = compute_seconds(request.repeats, injector, device)
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return probe_answer(request, device_id, seconds, [float(t.item()) for t in everyone])
