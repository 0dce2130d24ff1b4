"""AdamW written out, with its state in plain view (the live reshape moves it shard by shard).

Why not torch.optim.AdamW: building one imports torch._dynamo, which costs several CPU-seconds
per process — with eight ranks on two cores that is most of a test's budget, and it would be
paid again on every reshape. The update is the same decoupled-weight-decay Adam (Loshchilov &
Hutter), element-wise, so a sharded parameter steps exactly like its slice of the full one.
"""

from __future__ import annotations

import math

import torch


class AdamW:
    """``state[param] = {"exp_avg": m, "exp_avg_sq": v}``; ``step`` counts applied updates."""

    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.01, step: int = 0) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = step
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            p: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in self.params}

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        bias1 = 1 - b1 ** self.step_count
        bias2_sqrt = math.sqrt(1 - b2 ** self.step_count)
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state[p]
            p.mul_(1 - self.lr * self.weight_decay)
            st["exp_avg"].lerp_(p.grad, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (st["exp_avg_sq"].sqrt() / bias2_sqrt).add_(self.eps)
            p.addcdiv_(st["exp_avg"], denom, value=-self.lr / bias1)
