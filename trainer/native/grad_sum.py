"""Data parallelism for a stage whose replicas cut it differently (one at TP 3, another at TP 4).

FSDP2 reduces a parameter's gradient across replicas shard by shard, so every replica must cut
it the same way; a stage that excluded a device from one replica's TP group does not. Here each
rank writes its local gradient into a buffer the size of the whole stage, at the flat global
indices its shard covers (``state._cut``, the same cut that moves state; only TP rank 0 writes a
parameter every TP rank holds whole, such as a norm's weight), one SUM all-reduce over every
device holding the stage in any replica adds the replicas' full gradients, and each rank takes
its shard back. Exact for any TP degrees (the reference trainer's "full" mode, without its
all-gather inside the TP group). Costs one all-reduce of the stage's full size per iteration,
and each replica keeps its whole stage and AdamW state (nothing is sharded across replicas).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.native.state import _cut, _local


class FullGradSum:
    """The gradient sum of one non-grid stage: ``params`` the stage's parameters by name,
    ``tp_rank`` this rank's index in its TP group, ``group`` every device of the stage."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], tp_rank: int, group: dist.ProcessGroup) -> None:
        self.group = group
        self.parts: list[tuple[nn.Parameter, torch.Tensor, int | None, int, bool]] = []  # + offset, writes
        offset = 0
        for _, p in params:
            index, start = _cut(p)
            self.parts.append((p, index, start, offset, isinstance(p, DTensor) or tp_rank == 0))
            offset += p.numel()
        self.total = offset

    def __call__(self) -> None:
        """Sum every replica's gradient into each rank's ``grad`` (a collective over the stage's devices)."""
        first = self.parts[0][0]
        flat = torch.zeros(self.total, dtype=first.dtype, device=_local(first).device)
        for p, index, start, offset, writes in self.parts:
            assert p.grad is not None, "every parameter of a stage takes part in its loss"
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # DTensor may leave a gradient Partial or Replicate (the embedding's, the first wq's):
                # placed like its parameter (a collective of the TP group) before it is cut.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            if writes:
                g = _local(p.grad).reshape(-1)
                if start is not None:
                    flat[offset + start:offset + start + g.numel()] = g
                else:
                    flat[offset + index.to(flat.device)] = g
        dist.all_reduce(flat, group=self.group)
        for p, index, start, offset, _ in self.parts:
            assert p.grad is not None
            g = _local(p.grad)
            mine = (flat[offset + start:offset + start + g.numel()] if start is not None
                    else flat[offset + index.to(flat.device)])
            g.copy_(mine.view(g.shape))
