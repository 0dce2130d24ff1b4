"""A small Llama-style decoder built from plain ``torch.nn`` modules, read top to bottom.

RMSNorm, rotary attention, SwiGLU — the shape torchtitan's Llama has, so the parallelisation
steps in trainer/native/parallelize.py apply to a user's own torchtitan-style model unchanged:
layers live in a ``ModuleDict`` keyed by their global index (a pipeline stage deletes the ones it
does not hold and the state-dict keys stay global), and the embedding, final norm and output
projection may be ``None`` on stages that do not hold them.

Packed documents: ``positions`` restart at 0 at every document start (trainer/data.py), so rotary
phases restart per document and attention is causal *within* a document only. Every stage gets
``positions`` as a keyword argument (pipelining passes kwargs to every stage), so nothing but the
hidden state travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.decoder_config import DecoderConfig


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, T, 1, head_dim/2) for per-document ``positions`` (B, T)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (B, T, hd/2)
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, T, h, hd/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query i may see key j when j ≤ i inside the same packed document."""
    doc = torch.cumsum(positions == 0, dim=-1)  # (B, T)
    same = doc[:, :, None] == doc[:, None, :]
    T = positions.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


class Attention(nn.Module):
    """Heads are inferred from the projection's width (``view(..., -1, head_dim)``), so a
    column-parallel wq/wk/wv that holds n_heads/tp heads needs no change here."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rotary(self.wq(x).view(B, T, -1, self.head_dim), cos, sin)  # (B, T, h, hd)
        k = apply_rotary(self.wk(x).view(B, T, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it once ``keep_layers`` pruned it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens_or_h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids on the first stage, else (B, T, dim) hidden; returns the hidden state,
        or (B, T, vocab) logits on the last stage."""
        h = self.tok_embeddings(tokens_or_h) if self.tok_embeddings is not None else tokens_or_h
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        mask = document_mask(positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


ModelFactory = Callable[[LlamaConfig, int], nn.Module]


def build_model(cfg: LlamaConfig, seed: int) -> Transformer:
    """The full model, initialised the same way on every rank (the same seed gives the same weights
    whatever the layout, so a parallel run can be compared with a single-process one)."""
    torch.manual_seed(seed)
    return Transformer(cfg).to(cfg.torch_dtype)


def keep_layers(model: Any, first_layer: int, end_layer: int) -> Any:
    """Prune ``model`` in place to one pipeline stage: layers [first_layer, end_layer), the
    embedding only on the first stage, norm and output only on the last. Any module with the
    torchtitan layout works (``layers`` a ModuleDict keyed by global index, ``tok_embeddings``,
    ``norm``, ``output`` attributes its forward skips when None)."""
    n_layers = len(model.layers)
    for i in list(model.layers.keys()):
        if not first_layer <= int(i) < end_layer:
            del model.layers[i]
    if first_layer > 0:
        model.tok_embeddings = None
    if end_layer < n_layers:
        model.norm = None
        model.output = None
    return model
