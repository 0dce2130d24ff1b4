"""A pipeline stage whose neighbours may run at other TP degrees: torch's ``PipelineStage`` with
the contract's p2p mapping.

torch's ``PipelineStage`` sends to and receives from one rank per neighbouring stage, taken from
a PP group in which each stage has one rank — which a replica with a stage at TP 3 beside one at
TP 4 does not have. :class:`MappedStage` keeps torch's stage and schedule (1F1B, its buffers,
its backward) and changes only who is at the other end, by ``collector.plan.stage_peers``: TP
rank j receives activations from the previous stage's rank j mod tp(previous) and output
gradients from the next stage's rank j mod tp(next), and a rank sends to every neighbour that
maps to it (none, one or several). The messages travel over the layout's world group.

The stage is given its input and output shapes (``static_meta``), so torch's schedule never runs
its shape-inference round trip (which assumes one peer per neighbour) and the first step on a new
layout sends no metadata. torch builds the stage on a group of this rank alone: its schedule then
sees no other rank in the pipeline (no PP-group vote, no pre-connect), and every message goes by
the overridden peers instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from collector.plan import RankRole, StagePeers


def static_meta(role: RankRole, dim: int, vocab: int, block: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of one micro-batch on this stage (one row of ``block`` tokens):
    token ids on the first stage, else the hidden state; logits on the last, else the hidden state.
    torch derives the gradients' shapes from those that require one."""
    hidden = torch.empty(1, block, dim, dtype=dtype, device=device, requires_grad=True)  # gradients flow back
    first = torch.empty(1, block, dtype=torch.int64, device=device)
    last = torch.empty(1, block, vocab, dtype=dtype, device=device, requires_grad=True)
    return (first if role.stage == 0 else hidden), (last if role.stage == role.num_stages - 1 else hidden)


class MappedStage(PipelineStage):
    """torch's stage with its peers given: ``peers`` (device ids), ``rank_of`` (device → rank in
    the job's default group), ``p2p_group`` (the layout's world) and ``solo`` (a group of this rank
    alone, which torch's stage is built on)."""

    def __init__(self, model: nn.Module, role: RankRole, device: torch.device, peers: StagePeers,
                 rank_of: dict[int, int], p2p_group: dist.ProcessGroup, solo: dist.ProcessGroup,
                 example: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(model, role.stage, role.num_stages, device, input_args=example[0], output_args=example[1],
                         group=solo)
        self.peers, self.rank_of, self.p2p_group = peers, rank_of, p2p_group

    def _resolve_peer_global_rank(self, stage_idx: int) -> int:
        """The one rank this rank receives from: activations from the previous stage, gradients
        from the next (sends are re-addressed by ``_fan_out``)."""
        peer = self.peers.act_from if stage_idx < self.stage_index else self.peers.grad_from
        if peer is None:
            raise RuntimeError(f"stage {self.stage_index} has no peer at stage {stage_idx}")
        return self.rank_of[peer]

    def _get_p2p_group(self, source_stage: int, destination_stage: int) -> dist.ProcessGroup:
        return self.p2p_group

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_fwd_send_ops(fwd_chunk_id), self.peers.act_to)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_bwd_send_ops(bwd_chunk_id), self.peers.grad_to)

    def _fan_out(self, ops: list[dist.P2POp], to: tuple[int, ...]) -> list[dist.P2POp]:
        """torch's send ops, each sent to every device of ``to`` instead of its one peer."""
        return [dist.P2POp(op.op, op.tensor, self.rank_of[d], self.p2p_group) for op in ops for d in to]
