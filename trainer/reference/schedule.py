"""Pipeline schedules over point-to-point sends: 1F1B, interleaved 1F1B and zero-bubble.

What a schedule *is* comes from the platform's own model: each stage runs the op order
``analytics.detection.schedule.op_table(schedule, S, M, V).stage_order(s)`` — (kind, chunk, micro-batch)
triples — so the trainer runs exactly the order the detector and the planner predict. This module
only executes such an order:

* ``F(c, i)``: receive chunk c's input from virtual stage ``g-1`` (``g = c·S + s``; stage 0's chunk
  c > 0 receives from stage S-1's chunk c-1), run the chunk, send the output to ``g+1``.
* ``B(c, i)``: receive the output gradient from ``g+1``, backpropagate, send the input gradient to
  ``g-1``. Under 1F1B and interleaved, B is the whole backward (weight gradients included).
* zero-bubble splits the backward: ``B`` computes only the input gradient
  (``torch.autograd.grad`` w.r.t. the chunk's input, keeping the graph), so the previous stage can
  go on at once; ``W`` — deferred to where the order puts it — accumulates the weight gradients
  (``backward(inputs=parameters)`` on the kept graph). The first stage has no input gradient, so
  its B is empty and its W does the whole backward. Correctness first: W walks the kept graph again,
  so it recomputes the activation gradients inside the chunk instead of keeping them from B (same
  numbers, more FLOPs than a fused kernel split would need).

Why not torch.distributed.pipelining: its stages map one pipeline stage to one rank of one PP
group, so a replica whose stages have different TP degrees (a stage at TP 2 next to one at TP 1,
after a reshape around a lost device) has no PP group to give it, and replicas of one job may split
layers differently. Here each TP rank of stage s talks directly to the TP ranks of its neighbours:
a receiver with TP index j takes its input from sender j mod tp(sender) (activations are
replicated across a stage's TP ranks, so any sender is right), and gradients flow back the same
way. Every message carries a tag naming (micro-batch, sender's virtual stage, direction), so a
receiver can take messages in its own order. Sends are ``isend`` (waited at the end of the
iteration), receives block; since each stage follows one topological order of an acyclic op DAG,
this cannot deadlock. A single-stage interleaved pipeline hands chunk outputs over in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # see below
import torch.nn.functional as F

from analytics.detection.schedule import op_table
from collector.events import ChunkKind, CommOp
from collector.plan import PipelinePlan, RankRole, stage_peers
from trainer.reference.chunks import virtual_stages
from trainer.data import IGNORE, MicroBatch
from trainer.faults import FaultInjector
from trainer.agent.wake import wait
from trainer.reference.model import GPTStage
from trainer.reference.parallel import PlanWorld
from trainer.telemetry import IterationRecorder

# ``backward(grad)`` with an explicit gradient lazily imports torch's symbolic-shapes module (and
# sympy): several CPU-seconds in *every* rank process on its first backward. Importing it here
# pays that once in the launcher's fork server, which preloads trainer.reference.worker (and so this module).


@dataclass
class Peers:
    """Who this rank receives from and sends to, as world ranks (device ids in ``*_device``).

    ``act_from`` is the previous stage (stage S-1 for stage 0 when chunks wrap around), ``act_to``
    the next one; gradients come from ``grad_from`` and go to ``grad_to``. Which chunks actually
    use them is decided by the virtual stage (the first chunk of the pipeline receives nothing)."""

    act_from: int | None
    act_to: list[int]
    grad_from: int | None
    grad_to: list[int]
    act_from_device: int | None
    grad_from_device: int | None


def pipeline_peers(pipe: PipelinePlan, role: RankRole, layout: PlanWorld, wrap: bool = False) -> Peers:
    """This rank's peers by the contract's rule (``collector.plan.stage_peers``), as world ranks."""
    p = stage_peers(pipe, role.stage, role.tp_rank, wrap)
    return Peers(
        act_from=layout.rank(p.act_from) if p.act_from is not None else None,
        act_to=[layout.rank(d) for d in p.act_to],
        grad_from=layout.rank(p.grad_from) if p.grad_from is not None else None,
        grad_to=[layout.rank(d) for d in p.grad_to],
        act_from_device=p.act_from, grad_from_device=p.grad_from,
    )


@dataclass
class _Held:
    """What one (chunk, micro-batch) keeps between its F and its B (and W)."""

    inp: torch.Tensor | None
    out: torch.Tensor
    grad: torch.Tensor | None = None


@dataclass
class _Iteration:
    rec: IterationRecorder
    global_targets: int
    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    pending: list[dist.Work] = field(default_factory=list)
    local: dict[int, torch.Tensor] = field(default_factory=dict)  # in-memory hand-over, by tag
    loss_sum: float = 0.0


def paced_chunk_s(pace_s_per_layer_token: float, layers: int, tp: int, tokens: int, seq_lens: list[int]) -> float:
    """Emulated device time of a forward chunk on one rank of a TP group (0 when not pacing).

    The cost model's α·N + β·Σl² per layer, with β = α/32, split over the group's ``tp`` ranks as
    tensor parallelism splits a layer's matmuls: a stage that shrinks from TP 2 to TP 1 takes twice
    as long per layer, as it would on devices. The pace is one device's time per layer-token."""
    if not pace_s_per_layer_token:
        return 0.0
    per_layer = pace_s_per_layer_token * tokens + pace_s_per_layer_token / 32 * sum(n * n for n in seq_lens)
    return layers * per_layer / tp


class PipelineSchedule:
    """Runs one iteration's micro-batches through this rank's stage in the plan's schedule."""

    def __init__(self, stage: GPTStage, pipe: PipelinePlan, role: RankRole, layout: PlanWorld, schedule: str,
                 virtual_stages_: int, faults: FaultInjector, pace_s_per_layer_token: float = 0.0,
                 group: dist.ProcessGroup | None = None) -> None:
        self.stage, self.role, self.faults = stage, role, faults
        self.group = group  # spans the whole world (group rank = world rank); None: the default group
        self.pace = pace_s_per_layer_token
        self.S = len(pipe.stages)
        self.tp = pipe.stages[role.stage].tp
        self.V = virtual_stages_ if schedule == "interleaved" else 1
        if len(stage.chunks) != self.V:
            raise ValueError(f"stage holds {len(stage.chunks)} chunks but the {schedule} schedule runs {self.V}")
        self.split_backward = schedule == "zero_bubble"
        self.microbatches = pipe.microbatches
        self.order = op_table(schedule, self.S, pipe.microbatches, self.V).stage_order(role.stage)
        self.peers = pipeline_peers(pipe, role, layout, wrap=self.V > 1)
        self.me = layout.rank(role.device)
        self.hidden = stage.cfg.n_embd
        self.dtype = stage.cfg.torch_dtype
        self.params = [p for p in stage.parameters()]

    @classmethod
    def for_plan(cls, stage: GPTStage, layout: PlanWorld, role: RankRole, faults: FaultInjector,
                 pace_s_per_layer_token: float = 0.0, group: dist.ProcessGroup | None = None) -> PipelineSchedule:
        """The schedule ``layout.plan`` names for ``role``. Pass the world-wide training group so
        that a receive from a dead peer fails at its short timeout, not the default group's."""
        plan = layout.plan
        pipe = next(p for p in plan.pipelines if p.replica == role.replica)
        return cls(stage, pipe, role, layout, plan.schedule, virtual_stages(plan), faults, pace_s_per_layer_token,
                   group)

    def run(self, mbs: list[MicroBatch], global_targets: int, rec: IterationRecorder) -> float:
        """Run every op of this stage's order; returns the loss sum (last virtual stage only)."""
        if len(mbs) != self.microbatches:
            raise ValueError(f"the schedule was built for {self.microbatches} micro-batches, got {len(mbs)}")
        it = _Iteration(rec, global_targets)
        for kind, c, i in self.order:
            mb = mbs[i]
            if kind == "F":
                self._forward(it, c, mb)
            elif kind == "B":
                self._backward(it, c, mb)
            else:
                self._weight(it, c, mb)
        with rec.comm_wait(CommOp.PP_SEND):
            for w in it.pending:
                wait(w, "pp send", p2p=True)
        return it.loss_sum

    # ---- helpers -----------------------------------------------------------------------------------

    def _g(self, c: int) -> int:
        return c * self.S + self.role.stage

    def _tag(self, mb: MicroBatch, sender_g: int, grad: bool) -> int:
        return (mb.index * self.S * self.V + sender_g) * 2 + int(grad)

    def _paced_s(self, mb: MicroBatch, chunk: int) -> float:
        return paced_chunk_s(self.pace, self.stage.chunk_layers(chunk), self.tp, len(mb.tokens), mb.seq_lens)

    def _recv(self, it: _Iteration, src: int | None, device: int | None, tag: int, like: torch.Tensor | None,
              mb: MicroBatch) -> torch.Tensor:
        """The tensor ``src`` sends under ``tag``; a chunk that receives always has a peer (``src``
        is None only for the pipeline's first chunk, which receives nothing)."""
        assert src is not None, "a chunk with no upstream peer has nothing to receive"
        if src == self.me:
            return it.local.pop(tag)
        buf = torch.empty(len(mb.tokens), self.hidden, dtype=self.dtype) if like is None else torch.empty_like(like)
        with it.rec.comm_wait(CommOp.PP_RECV, peer=device, microbatch=mb.index,
                              nbytes=buf.numel() * buf.element_size()):
            wait(dist.irecv(buf, src=src, tag=tag, group=self.group), "pp recv", p2p=True)
        return buf

    def _send(self, it: _Iteration, dsts: list[int], tensor: torch.Tensor, tag: int) -> None:
        data = tensor.detach().contiguous()
        for dst in dsts:
            self.faults.before_send()
            if dst == self.me:
                it.local[tag] = data.clone()
            else:
                work = dist.isend(data, dst=dst, tag=tag, group=self.group)
                if work is not None:  # None only where this rank is outside the group
                    it.pending.append(work)

    def _record(self, it: _Iteration, kind: ChunkKind, c: int, mb: MicroBatch, start: float, paced_s: float) -> None:
        """Pad the chunk's compute (its time less the TP all-reduces inside it) to the emulated
        device time and slow factor, then record it. The all-reduces are communication, not the
        device's compute: padded over, a TP rank's own time (chunk less its TP waits, what the
        detector scores) read a ×3 device as ×3.3-×3.6 while a probe timed ×3.00."""
        elapsed = it.rec.now_s() - start
        self.faults.after_compute(elapsed - it.rec.waited_s(CommOp.TP_ALLREDUCE, start), paced_s)
        it.rec.chunk(kind, mb.index, len(mb.tokens), mb.seq_lens, start, it.rec.now_s() - start, virtual_stage=c)

    # ---- the three chunk kinds ---------------------------------------------------------------------

    def _forward(self, it: _Iteration, c: int, mb: MicroBatch) -> None:
        g, last = self._g(c), self.S * self.V - 1
        inp = None
        if g > 0:
            inp = self._recv(it, self.peers.act_from, self.peers.act_from_device, self._tag(mb, g - 1, False), None, mb)
            inp.requires_grad_(True)
        start = it.rec.now_s()
        out = self.stage(mb.tokens if inp is None else inp, mb.positions, mb.seq_lens, chunk=c)
        if g == last:
            out = F.cross_entropy(out.float() if out.dtype == torch.float16 else out, mb.targets,
                                  ignore_index=IGNORE, reduction="sum") / it.global_targets
            it.loss_sum += float(out.detach())
        self._record(it, ChunkKind.FORWARD, c, mb, start, self._paced_s(mb, c))
        if g < last:
            self._send(it, self.peers.act_to, out, self._tag(mb, g, False))
        it.held[(c, mb.index)] = _Held(inp, out)

    def _backward(self, it: _Iteration, c: int, mb: MicroBatch) -> None:
        g, last = self._g(c), self.S * self.V - 1
        held = it.held[(c, mb.index)]
        if g < last:
            held.grad = self._recv(it, self.peers.grad_from, self.peers.grad_from_device,
                                   self._tag(mb, g + 1, True), held.out, mb)
        start = it.rec.now_s()
        if not self.split_backward:
            held.out.backward(held.grad)
            input_grad = held.inp.grad if held.inp is not None else None
            del it.held[(c, mb.index)]
            paced = 2 * self._paced_s(mb, c)
        else:  # zero-bubble B: the input gradient only; the graph is kept for W
            input_grad = None
            if held.inp is not None:
                (input_grad,) = torch.autograd.grad(held.out, held.inp, held.grad, retain_graph=True)
            paced = self._paced_s(mb, c)
        self._record(it, ChunkKind.BACKWARD, c, mb, start, paced)
        if g > 0:
            assert input_grad is not None, "every chunk after the first has an input to differentiate"
            self._send(it, self.peers.grad_to, input_grad, self._tag(mb, g, True))

    def _weight(self, it: _Iteration, c: int, mb: MicroBatch) -> None:
        """Zero-bubble W: accumulate the chunk's weight gradients into ``.grad``, free the graph."""
        held = it.held.pop((c, mb.index))
        start = it.rec.now_s()
        torch.autograd.backward(held.out, held.grad, inputs=self.params)
        self._record(it, ChunkKind.WEIGHT, c, mb, start, self._paced_s(mb, c))
