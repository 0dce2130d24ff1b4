"""Bring your own torchtitan-style model to the native executor.

    PYTHONPATH=. python examples/native_user_model.py

The model below is the user's, not ours: torch's own ``nn.RMSNorm``, a fused-free attention with
learned-nothing rotary (here: no rotary at all, a plain causal mask), GELU-gated feed-forward. The
executor needs only the torchtitan layout — ``layers`` a ``ModuleDict`` keyed by global layer
index whose blocks have ``attention.wq/wk/wv/wo`` and ``feed_forward.w1/w2/w3``, and
``tok_embeddings`` / ``norm`` / ``output`` that ``forward`` skips when a pipeline stage set them to
None — and a factory ``(LlamaConfig, seed) -> nn.Module`` named as ``module:function``.

The run: TP2 on 2 CPU ranks for 3 iterations, then a live TP 2→1 reshape (rank 1 released), 3
more iterations; every loss is compared with one process training the same model and batches.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=False))
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(dim, hidden, bias=False)
        self.feed_forward.w3 = nn.Linear(dim, hidden, bias=False)
        self.feed_forward.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        a, h = self.attention, self.attention_norm(x)
        q, k, v = (w(h).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + a.wo(y)
        f, h = self.feed_forward, self.ffn_norm(x)
        return x + f.w2(F.gelu(f.w1(h)) * f.w3(h))


class UserDecoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm: nn.Module | None = nn.RMSNorm(dim)
        self.output: nn.Module | None = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens_or_h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # positions unused
        h = self.tok_embeddings(tokens_or_h) if self.tok_embeddings is not None else tokens_or_h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build(cfg, seed: int) -> nn.Module:
    """The factory the executor calls on every rank (same seed, same weights)."""
    torch.manual_seed(seed)
    return UserDecoder(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_hidden).to(cfg.torch_dtype)


def main() -> int:
    from collector.plan import PipelinePlan, Plan, StagePlan
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings, reference_losses
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native, read_results

    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, ffn_hidden=64, vocab_size=64, dtype="float64")
    settings = TrainSettings(block_size=16)

    def plan(epoch: int, devices: tuple[int, ...]) -> Plan:
        return Plan(epoch=epoch, num_layers=cfg.n_layers, pipelines=(PipelinePlan(
            replica=0, microbatches=2, stages=(StagePlan(devices=devices, first_layer=0, end_layer=cfg.n_layers),)),))

    out = tempfile.mkdtemp(prefix="native-user-model-")
    spec = NativeRunSpec(job="user-model", model=asdict(cfg), settings=asdict(settings), plan=plan(0, (0, 1)),
                         model_factory="examples.native_user_model:build", device="cpu",
                         reshapes=[ScheduledReshape(at_iteration=3, plan=plan(1, (0,)))], iterations=6, out_dir=out)
    codes = launch_native(spec)
    ranks, _ = read_results(out)
    ref, _ = reference_losses(cfg, settings, [2] * 6, model_factory=build)
    losses = {int(i): v for i, v in ranks[0]["losses"].items()}
    ok = all(c == 0 for c in codes.values()) and all(abs(losses[i] - ref[i]) < 1e-9 for i in range(6))
    for i in range(6):
        print(f"iteration {i}: loss {losses[i]:.6f} reference {ref[i]:.6f}")
    print("reshape phases s:", {k: round(v, 3) for k, v in ranks[0]["reshapes"][0]["phases_s"].items()})
    print("user model under the native executor:", "equal to the reference" if ok else "DIFFERS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
