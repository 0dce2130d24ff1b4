"""A hand-written 1F1B pipeline schedule over point-to-point sends (isend / recv).

Why not torch.distributed.pipelining: its stages map one pipeline stage to one rank of one PP
group, so a replica whose stages have different TP degrees (a stage at TP 2 next to one at TP 1,
after a reshape around a lost device) has no PP group to give it, and replicas of one job may split
layers differently. Here each TP rank of stage s talks directly to the TP ranks of stage s±1: a
receiver with TP index j takes its activations from sender j mod tp(s) (activations are replicated
across a stage's TP ranks, so any sender is right), and gradients flow back the same way.

Sends are ``isend`` (waited at the end of the iteration), receives block: with every stage running
the same warm-up / steady / cool-down order this cannot deadlock. Each rank records its F and B
chunks and its waits (recv, and the send drain at the end) in the iteration recorder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from collector.events import ChunkKind, CommOp
from collector.plan import PipelinePlan, RankRole
from trainer.data import IGNORE, MicroBatch
from trainer.faults import FaultInjector
from trainer.model import GPTStage
from trainer.parallel import Layout
from trainer.telemetry import IterationRecorder


@dataclass
class Peers:
    """Who this rank receives from and sends to, as world ranks (device ids in ``*_devices``)."""

    recv_act: int | None
    send_act: list[int]
    recv_grad: int | None
    send_grad: list[int]
    recv_act_device: int | None
    recv_grad_device: int | None


def pipeline_peers(pipe: PipelinePlan, role: RankRole, layout: Layout) -> Peers:
    s, t = role.stage, role.tp_rank
    me = pipe.stages[s]
    prev = pipe.stages[s - 1] if s > 0 else None
    nxt = pipe.stages[s + 1] if s + 1 < len(pipe.stages) else None
    recv_act_dev = prev.devices[t % prev.tp] if prev else None
    recv_grad_dev = nxt.devices[t % nxt.tp] if nxt else None
    send_act = [d for j, d in enumerate(nxt.devices) if j % me.tp == t] if nxt else []
    send_grad = [d for j, d in enumerate(prev.devices) if j % me.tp == t] if prev else []
    return Peers(
        recv_act=layout.rank(recv_act_dev) if prev else None,
        send_act=[layout.rank(d) for d in send_act],
        recv_grad=layout.rank(recv_grad_dev) if nxt else None,
        send_grad=[layout.rank(d) for d in send_grad],
        recv_act_device=recv_act_dev, recv_grad_device=recv_grad_dev,
    )


class OneFOneB:
    """Runs one iteration's micro-batches through this rank's stage; returns its loss sum."""

    def __init__(self, stage: GPTStage, pipe: PipelinePlan, role: RankRole, layout: Layout,
                 faults: FaultInjector, pace_s_per_layer_token: float = 0.0) -> None:
        self.stage, self.role, self.faults = stage, role, faults
        self.pace = pace_s_per_layer_token
        self.peers = pipeline_peers(pipe, role, layout)
        self.hidden = stage.cfg.n_embd
        self.dtype = stage.cfg.torch_dtype

    def run(self, mbs: list[MicroBatch], global_targets: int, rec: IterationRecorder) -> float:
        n, s, S = len(mbs), self.role.stage, self.role.num_stages
        warmup = min(S - s - 1, n)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending: list[dist.Work] = []
        loss_sum = 0.0
        f_next = b_next = 0
        order = ["F"] * warmup
        for _ in range(n - warmup):
            order += ["F", "B"]
        order += ["B"] * warmup
        for op in order:
            if op == "F":
                mb = mbs[f_next]
                f_next += 1
                inp, out = self._forward(mb, global_targets, rec, pending)
                saved[mb.index] = (inp, out)
                if self.stage.is_last:
                    loss_sum += float(out.detach())
            else:
                mb = mbs[b_next]
                b_next += 1
                inp, out = saved.pop(mb.index)
                self._backward(mb, inp, out, rec, pending)
        with rec.comm_wait(CommOp.PP_SEND):
            for w in pending:
                w.wait()
        return loss_sum

    def _paced_s(self, mb: MicroBatch) -> float:
        """Emulated device time of a forward chunk (cost model α·N + β·Σl², per layer)."""
        if not self.pace:
            return 0.0
        layers = self.role.end_layer - self.role.first_layer
        return layers * (self.pace * len(mb.tokens) + self.pace / 32 * sum(n * n for n in mb.seq_lens))

    def _forward(self, mb: MicroBatch, global_targets: int, rec: IterationRecorder,
                 pending: list[dist.Work]) -> tuple[torch.Tensor | None, torch.Tensor]:
        T = len(mb.tokens)
        inp: torch.Tensor | None = None
        if self.peers.recv_act is not None:
            inp = torch.empty(T, self.hidden, dtype=self.dtype)
            with rec.comm_wait(CommOp.PP_RECV, peer=self.peers.recv_act_device, microbatch=mb.index,
                               nbytes=inp.numel() * inp.element_size()):
                dist.recv(inp, src=self.peers.recv_act)
            inp.requires_grad_(True)
        start = rec.now_s()
        x = mb.tokens if inp is None else inp
        out = self.stage(x, mb.positions, mb.seq_lens)
        if self.stage.is_last:
            out = F.cross_entropy(out.float() if out.dtype == torch.float16 else out, mb.targets,
                                  ignore_index=IGNORE, reduction="sum") / global_targets
        duration = rec.now_s() - start
        self.faults.after_compute(duration, self._paced_s(mb))
        rec.chunk(ChunkKind.FORWARD, mb.index, T, mb.seq_lens, start, rec.now_s() - start)
        for dst in self.peers.send_act:
            self.faults.before_send()
            pending.append(dist.isend(out.detach().contiguous(), dst=dst))
        return inp, out

    def _backward(self, mb: MicroBatch, inp: torch.Tensor | None, out: torch.Tensor, rec: IterationRecorder,
                  pending: list[dist.Work]) -> None:
        grad: torch.Tensor | None = None
        if self.peers.recv_grad is not None:
            grad = torch.empty_like(out)
            with rec.comm_wait(CommOp.PP_RECV, peer=self.peers.recv_grad_device, microbatch=mb.index,
                               nbytes=grad.numel() * grad.element_size()):
                dist.recv(grad, src=self.peers.recv_grad)
        start = rec.now_s()
        out.backward(grad)
        duration = rec.now_s() - start
        self.faults.after_compute(duration, 2 * self._paced_s(mb))
        rec.chunk(ChunkKind.BACKWARD, mb.index, len(mb.tokens), mb.seq_lens, start, rec.now_s() - start)
        if inp is not None:
            for dst in self.peers.send_grad:
                self.faults.before_send()
                pending.append(dist.isend(inp.grad.contiguous(), dst=dst))
