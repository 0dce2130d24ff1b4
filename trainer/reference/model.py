"""A GPT-style decoder in one file, nanoGPT-like, that a pipeline stage can hold a slice of.

Read top to bottom: the config, the Megatron TP helpers (two autograd functions), attention, MLP,
block, and ``GPTStage`` — the layers ``[first_layer, end_layer)`` of the model plus, on the first
stage, the embeddings and, on the last, the final norm and the head. A single-stage, TP-1 model is
the plain GPT. Parallelism is applied from outside (trainer/reference/parallel.py): the pipeline split by
choosing which layers a stage builds, TP by ``shard_stage`` which cuts weights and installs the
collectives, DP by a gradient reducer. The model code itself only knows "my heads" and "my hidden
slice".

Attention is per document: a micro-batch is one packed row of documents, and each document attends
only to itself (causally). We run scaled_dot_product_attention per document, so compute grows with
Σ lᵢ², not with T². On GPUs a varlen flash kernel would do the same in one launch.

Every parameter has a canonical name (``layers.3.attn.q.weight``) and a shard rule (``col``: split
dim 0 across TP ranks, ``row``: split dim 1, ``rep``: replicated); that name and rule are what
checkpoints and the live reshape speak, independent of any layout. Initialisation draws each full
parameter from a generator seeded by its canonical name, so every layout starts from the same model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from trainer.decoder_config import DecoderConfig
from trainer.agent.wake import wait

ShardRule = Literal["col", "row", "rep"]


@dataclass(frozen=True)
class GPTConfig(DecoderConfig):
    """nanoGPT's sizes and names; the vocabulary and dtype come from DecoderConfig."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 128  # tokens per packed micro-batch row (and the position table size)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=64, n_layer=4, n_head=4, n_embd=32, block_size=64),
    "small": GPTConfig(vocab_size=512, n_layer=8, n_head=8, n_embd=256, block_size=256),
    "gpt2": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, n_embd=1024, block_size=1024),
}


# ---- Megatron's f and g: the only places TP talks ----------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward (before column-parallel)."""

    @staticmethod
    def forward(ctx, x, group, timer):
        ctx.group, ctx.timer = group, timer
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with ctx.timer("tp"):
            wait(dist.all_reduce(grad, group=ctx.group, async_op=True), "tp all_reduce (backward)")
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (after row-parallel); identity backward."""

    @staticmethod
    def forward(ctx, x, group, timer):
        x = x.contiguous()
        with timer("tp"):
            wait(dist.all_reduce(x, group=group, async_op=True), "tp all_reduce (forward)")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _NoTimer:
    def __call__(self, what: str) -> "_NoTimer":
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class TPContext:
    """What a sharded module needs to talk to its TP group: the group, its size, a comm timer."""

    def __init__(self, group: dist.ProcessGroup | None = None, degree: int = 1, rank: int = 0, timer=None) -> None:
        self.group, self.degree, self.rank = group, degree, rank
        self.timer = timer or _NoTimer()

    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.degree == 1 else _CopyToTP.apply(x, self.group, self.timer)

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.degree == 1 else _ReduceFromTP.apply(x, self.group, self.timer)


# ---- the model ----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TPContext) -> None:
        super().__init__()
        c = cfg.n_embd
        self.tp = tp
        self.n_head_local = cfg.n_head // tp.degree
        self.head_dim = c // cfg.n_head
        local = self.n_head_local * self.head_dim
        self.q = nn.Linear(c, local, bias=False)  # col
        self.k = nn.Linear(c, local, bias=False)  # col
        self.v = nn.Linear(c, local, bias=False)  # col
        self.proj = nn.Linear(local, c, bias=False)  # row

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        T, _ = x.shape  # (T, C): one packed row
        x = self.tp.copy_in(x)
        h, d = self.n_head_local, self.head_dim
        q = self.q(x).view(T, h, d).transpose(0, 1)  # (h, T, d)
        k = self.k(x).view(T, h, d).transpose(0, 1)
        v = self.v(x).view(T, h, d).transpose(0, 1)
        outs = []
        for qs, ks, vs in zip(q.split(seq_lens, 1), k.split(seq_lens, 1), v.split(seq_lens, 1)):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))  # (h, l, d)
        y = torch.cat(outs, dim=1).transpose(0, 1).reshape(T, h * d)  # (T, h·d)
        return self.tp.reduce_out(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        hidden = 4 * cfg.n_embd // tp.degree
        self.fc = nn.Linear(cfg.n_embd, hidden, bias=False)  # col
        self.out = nn.Linear(hidden, cfg.n_embd, bias=False)  # row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce_out(self.out(F.gelu(self.fc(self.tp.copy_in(x)))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TPContext) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg, tp)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), seq_lens)
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """The layers one pipeline stage holds, as one or more model chunks (virtual stages).

    ``chunks`` are layer ranges ``[first, end)`` indexed by chunk (one for 1F1B and zero-bubble;
    V for the interleaved schedule, see trainer/reference/chunks.py). The chunk starting at layer 0 also
    holds the embeddings, the one ending at the last layer the final norm and head.
    ``forward(..., chunk=c)`` runs chunk ``c``: it takes token ids (the chunk with the embeddings)
    or the previous chunk's activations (T, C), and returns activations (T, C), or — the chunk
    with the head — logits (T, V).
    """

    def __init__(self, cfg: GPTConfig, chunks: Sequence[tuple[int, int]], tp: TPContext | None = None) -> None:
        super().__init__()
        tp = tp or TPContext()
        if cfg.n_head % tp.degree:
            raise ValueError(f"TP degree {tp.degree} does not divide n_head={cfg.n_head}; pick a smaller TP")
        self.cfg, self.tp, self.chunks = cfg, tp, tuple((int(a), int(b)) for a, b in chunks)
        if not self.chunks or any(b <= a for a, b in self.chunks):
            raise ValueError(f"a stage needs non-empty layer ranges, got {list(self.chunks)}")
        self.is_first = any(a == 0 for a, _ in self.chunks)  # holds the embeddings
        self.is_last = any(b == cfg.n_layer for _, b in self.chunks)  # holds the head
        if self.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp) for a, b in self.chunks for i in range(a, b)})
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.to(cfg.torch_dtype)

    def chunk_layers(self, chunk: int) -> int:
        a, b = self.chunks[chunk]
        return b - a

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: list[int], chunk: int = 0) -> torch.Tensor:
        first, end = self.chunks[chunk]
        if first == 0:
            x = self.wte(x) + self.wpe(positions)  # (T, C)
        for i in range(first, end):
            x = self.layers[str(i)](x, seq_lens)
        if end == self.cfg.n_layer:
            x = self.lm_head(self.ln_f(x))  # (T, V)
        return x


# ---- canonical names, shard rules, deterministic init ---------------------------------------------


def shard_rule(name: str) -> ShardRule:
    if name.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight")):
        return "col"
    if name.endswith(("attn.proj.weight", "mlp.out.weight")):
        return "row"
    return "rep"


def unit_of(name: str) -> str:
    """The unit a parameter moves with: ``embed``, ``layer.3`` or ``head``."""
    if name.startswith("layers."):
        return "layer." + name.split(".")[1]
    return "embed" if name.startswith(("wte", "wpe")) else "head"


def full_shape(cfg: GPTConfig, name: str) -> tuple[int, ...]:
    c, v = cfg.n_embd, cfg.vocab_size
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    shapes = {
        "wte.weight": (v, c), "wpe.weight": (cfg.block_size, c), "ln_f.weight": (c,), "ln_f.bias": (c,),
        "lm_head.weight": (v, c), "ln1.weight": (c,), "ln1.bias": (c,), "ln2.weight": (c,), "ln2.bias": (c,),
        "attn.q.weight": (c, c), "attn.k.weight": (c, c), "attn.v.weight": (c, c), "attn.proj.weight": (c, c),
        "mlp.fc.weight": (4 * c, c), "mlp.out.weight": (c, 4 * c),
    }
    return shapes[leaf]


def shard(full: torch.Tensor, rule: ShardRule, tp_degree: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's piece of a full tensor (a copy)."""
    if rule == "rep" or tp_degree == 1:
        return full.clone()
    dim = 0 if rule == "col" else 1
    return full.chunk(tp_degree, dim=dim)[tp_rank].clone()


def unshard(pieces: list[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """The full tensor from every TP rank's piece, in TP-rank order."""
    if rule == "rep" or len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=0 if rule == "col" else 1)


def init_full(cfg: GPTConfig, name: str, seed: int) -> torch.Tensor:
    """The full initial value of a parameter: a pure function of (config, name, seed)."""
    shape = full_shape(cfg, name)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=cfg.torch_dtype)
    if "ln" in name.split(".")[-2]:
        return torch.ones(shape, dtype=cfg.torch_dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02
    if name.endswith(("attn.proj.weight", "mlp.out.weight")):
        std = 0.02 / math.sqrt(2 * cfg.n_layer)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(cfg.torch_dtype)


def init_stage(stage: GPTStage, seed: int) -> None:
    """Fill a (possibly TP-sharded) stage with its slice of the canonical initial model."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(shard(init_full(stage.cfg, name, seed), shard_rule(name), stage.tp.degree, stage.tp.rank))
