"""A Megatron-style training loop publishing ResiHP telemetry and obeying its commands.

A stand-in for Megatron's ``train_step``: one process (world size 1, gloo), a tiny GPT-like model
over *packed* micro-batches (several documents per row, attention within each document only, so
compute grows with Σ lᵢ², as the detector's cost model expects), gradient accumulation over the
plan's micro-batches, a DP all-reduce of the gradients, an SGD step. The ResiHP calls are
marked ``# ResiHP``; everything else is an ordinary loop.

    python examples/megatron_style_loop.py --iterations 5                  # embedded bus, .resihp/bus.sqlite
    python examples/megatron_style_loop.py --iterations 5 --command-at 2   # play the remediation engine once
    python examples/megatron_style_loop.py --iterations 5 --probe-at 1     # play the detector's probe once
    RESIHP_BUS=kafka RESIHP_KAFKA_BOOTSTRAP=host:9092 python examples/megatron_style_loop.py

On a GPU, time chunks with CUDA events instead of ``it.time_chunk`` (docs/real-cluster.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from collector.bus import open_bus
from collector.auth import Signer
from collector.events import EventFactory, ProbeRequest
from collector.plan import PipelinePlan, Plan
from trainer.integration import (CommandListener, ResiHPReporter, best_seconds, coords_in,
                                 new_command, probe_answer, seq_lens_from_cu_seqlens)

VOCAB, WIDTH, HEADS, LAYERS, BLOCK = 256, 64, 4, 2, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:  # x: (T, C), one packed row
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=-1)
        out = []
        for a, b in zip(cu_seqlens, cu_seqlens[1:]):  # attention inside each packed document
            qs, ks, vs = (t[a:b].view(b - a, HEADS, -1).transpose(0, 1) for t in (q, k, v))  # (nh, l, hs)
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1).reshape(b - a, WIDTH))
        x = x + self.proj(torch.cat(out))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.head(x)


def packed_microbatch(gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """One packed row of BLOCK tokens: documents of long-tailed lengths, and their cu_seqlens."""
    lengths, left = [], BLOCK
    while left > 0:
        n = min(left, max(8, int(torch.empty(1).exponential_(1 / 48, generator=gen).item())))
        lengths.append(n)
        left -= n
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.randint(0, VOCAB, (BLOCK + 1,), generator=gen), cu


def sgd_step(model: nn.Module, flat_grad: torch.Tensor, lr: float) -> None:
    """Plain SGD from the all-reduced flat gradient (written out: importing torch.optim pulls in
    torch._dynamo, seconds of start-up for a five-iteration example)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p -= lr * flat_grad[offset:offset + n].view_as(p)
            p.grad = None
            offset += n


def layer_state_bytes(model: TinyGPT) -> int:
    """What one layer costs to move in a real mixed-precision AdamW job: bf16 weights and
    gradients, fp32 master weights and two moments, 16 bytes a parameter."""
    return sum(p.numel() for p in model.blocks[0].parameters()) * 16


def answer_probes(requests: list[ProbeRequest], model: TinyGPT, rank: int, reporter: ResiHPReporter) -> None:
    """Run each probe on every rank at this boundary and publish the asked ranks' answers (ResiHP).

    compute: one GEMM of a block's MLP on a full row (on a GPU, pass ``sync=torch.cuda.synchronize``
    to ``best_seconds``). link: a world of one device has no link and answers 0 s; with more ranks,
    post the receive, meet at a barrier and time the send alone (trainer/reference/probe.py, ``link_seconds``)."""
    shared = [requests]
    dist.broadcast_object_list(shared, src=0)  # rank 0's listener read them; every rank runs them
    for request in shared[0]:
        seconds = 0.0
        if request.target == "compute":
            x, w = torch.ones(BLOCK, WIDTH), model.blocks[0].mlp[0].weight.detach()
            seconds = best_seconds(lambda x=x, w=w: x @ w.T, request.repeats)
        everyone: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(everyone, seconds)
        reporter.answer_probe(probe_answer(request, rank, seconds, everyone))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per iteration (gradient accumulation)")
    ap.add_argument("--job", default="example", help="job name on the bus")
    ap.add_argument("--bus", choices=["embedded", "kafka"], default=None, help="default: $RESIHP_BUS or embedded")
    ap.add_argument("--bus-path", default=None, help="embedded log (default: $RESIHP_EMBEDDED_PATH or .resihp/bus.sqlite)")
    ap.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: $RESIHP_KAFKA_BOOTSTRAP)")
    ap.add_argument("--command-at", type=int, default=None, metavar="ITERATION",
                    help="after this iteration, publish a command (one micro-batch fewer) as the remediation engine would")
    ap.add_argument("--probe-at", type=int, default=None, metavar="ITERATION",
                    help="after this iteration, publish a compute probe of rank 0 as the detector would")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    store_dir = tempfile.mkdtemp(prefix="resihp-example-")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1)
    model = TinyGPT()
    plan = Plan.uniform(tp=1, pp=1, dp=1, num_layers=LAYERS, microbatches_per_replica=args.microbatches)
    rank = dist.get_rank()  # the device id plans name: the global rank at start, kept across reshapes

    def runnable(p: Plan) -> str | None:  # what this toy can apply: only the micro-batch count changes
        if p.devices != [0] or p.num_layers != LAYERS:
            return f"this example runs {LAYERS} layers on device 0 only; the plan uses devices {p.devices}"
        return None

    bus = open_bus(args.bus, path=args.bus_path, bootstrap=args.bootstrap)
    reporter = ResiHPReporter(args.job, rank, coords_in(plan, rank), bus=bus, node=0)  # ResiHP: every rank
    listener = CommandListener(args.job, plan, bus=bus, check=runnable) if rank == 0 else None  # ResiHP: one reader
    if listener:
        listener.announce_plan(model_name="tiny-gpt", layer_state_bytes=layer_state_bytes(model),
                               tokens_per_microbatch=BLOCK, gpus_per_node=1)
    try:
        for i in range(args.iterations):
            command = listener.poll() if listener else None  # ResiHP: at the iteration boundary
            if command is not None:
                t0 = time.perf_counter()
                plan = command.plan  # a real loop rebuilds groups and moves state here (docs/real-cluster.md)
                reporter.follow(plan)
                listener.ack_applied(command, pause_s=time.perf_counter() - t0)
            answer_probes(listener.take_probes() if listener else [], model, rank, reporter)  # ResiHP: optional
            microbatches = plan.role_of(rank).microbatches
            with reporter.iteration(i) as it:  # ResiHP: one telemetry.iteration per rank per iteration
                total_loss = 0.0
                for m in range(microbatches):
                    row, cu = packed_microbatch(gen)
                    seq_lens = seq_lens_from_cu_seqlens(cu)  # ResiHP: lengths of the packed documents
                    with it.time_chunk("F", m, tokens=BLOCK, seq_lens=seq_lens):
                        logits = model(row[:-1], cu)
                        loss = F.cross_entropy(logits, row[1:]) / microbatches
                    with it.time_chunk("B", m, tokens=BLOCK, seq_lens=seq_lens):
                        loss.backward()
                    total_loss += loss.item()
                flat = torch.cat([p.grad.flatten() for p in model.parameters()])
                with it.time_comm("dp_allreduce", nbytes=flat.numel() * flat.element_size()):
                    dist.all_reduce(flat)
                sgd_step(model, flat, lr=1e-2)
                if rank == 0:
                    it.summary(tokens=microbatches * BLOCK, loss=total_loss)  # ResiHP: once per job
            print(f"iteration {i} epoch {plan.epoch} micro-batches {microbatches} loss {total_loss:.4f}", flush=True)
            if args.command_at == i and listener:  # the remediation engine's part, for the demonstration
                fewer = plan.model_copy(update={"epoch": plan.epoch + 1, "pipelines": (PipelinePlan(
                    replica=0, microbatches=max(1, microbatches - 1), stages=plan.pipelines[0].stages),)})
                # signed with the engine's key from the key file (docs/security.md): the listener obeys nothing else
                bus.publish([Signer(EventFactory(args.job, "example-remediation"), "engine").make(
                    new_command(fewer, "example-fewer", run=listener.run))])  # for this run, expiring in 10 min
            if args.probe_at == i and listener:  # the detector's part, for the demonstration
                bus.publish([Signer(EventFactory(args.job, "example-analytics"), "analytics").make(
                    ProbeRequest(probe_id=f"example-probe-{i}", ranks=[rank], target="compute", repeats=3))])
    finally:
        reporter.close()  # flushes the queue
        if listener:
            listener.close()
        bus.close()
        dist.destroy_process_group()
    print(f"done: {args.iterations} iterations published to the {bus.name} bus as job {args.job!r} "
          f"(telemetry dropped: {reporter.dropped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
