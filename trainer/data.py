"""Deterministic packed variable-length sequences: the same global batch whatever the layout.

Each iteration's global batch is a fixed list of micro-batches, and micro-batch ``m`` of iteration
``i`` is a pure function of (seed, i, m): one packed row of ``block_size`` tokens made of documents
with long-tailed lengths (a clipped log-normal — most documents short, a few long). A plan assigns
each DP replica a contiguous range of micro-batch ids by its per-replica counts, so moving
micro-batches between replicas never changes what the job trains on.

The synthetic corpus is learnable on purpose (each document counts up from a random start with a
document-specific stride, modulo the vocabulary), so a loss curve visibly falls. Targets are the
next token inside the document; the last token of each document has no target (-100), which keeps
attention and loss from ever crossing a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from collector.plan import Plan

IGNORE = -100


@dataclass(frozen=True)
class MicroBatch:
    """One packed row. ``seq_lens`` sum to ``len(tokens)``; ``targets`` are -100 at document ends."""

    iteration: int
    index: int  # micro-batch id inside the global batch
    tokens: torch.Tensor  # (T,) int64
    targets: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, restarting at 0 for every document
    seq_lens: list[int]

    @property
    def num_targets(self) -> int:
        """Tokens that carry a loss: every token but the last of each document."""
        return len(self.tokens) - len(self.seq_lens)


@lru_cache(maxsize=4096)
def document_lengths(seed: int, iteration: int, index: int, block_size: int, mean_len: int) -> tuple[int, ...]:
    """The packed documents' lengths of one micro-batch (long-tailed, summing to block_size)."""
    rng = np.random.default_rng([seed, iteration, index, 1])
    lens: list[int] = []
    remaining = block_size
    while remaining > 0:
        length = int(np.clip(rng.lognormal(np.log(mean_len), 0.9), 2, block_size))
        length = min(length, remaining)
        lens.append(length)
        remaining -= length
    return tuple(lens)


def microbatch(seed: int, iteration: int, index: int, vocab_size: int, block_size: int,
               mean_len: int | None = None) -> MicroBatch:
    mean_len = mean_len or max(4, block_size // 6)
    lens = document_lengths(seed, iteration, index, block_size, mean_len)
    rng = np.random.default_rng([seed, iteration, index, 2])
    tokens = np.empty(block_size, dtype=np.int64)
    targets = np.full(block_size, IGNORE, dtype=np.int64)
    positions = np.empty(block_size, dtype=np.int64)
    at = 0
    for length in lens:
        start, stride = int(rng.integers(vocab_size)), int(rng.integers(1, 4))
        doc = (start + stride * np.arange(length)) % vocab_size
        tokens[at:at + length] = doc
        targets[at:at + length - 1] = doc[1:]
        positions[at:at + length] = np.arange(length)
        at += length
    return MicroBatch(iteration, index, torch.from_numpy(tokens), torch.from_numpy(targets),
                      torch.from_numpy(positions), list(lens))


def global_targets(seed: int, iteration: int, global_microbatches: int, block_size: int,
                   mean_len: int | None = None) -> int:
    """Loss-carrying tokens in the whole global batch: the denominator of the loss, in every layout."""
    mean_len = mean_len or max(4, block_size // 6)
    return sum(block_size - len(document_lengths(seed, iteration, m, block_size, mean_len))
               for m in range(global_microbatches))


def replica_microbatch_ids(plan: Plan, replica: int) -> range:
    """The contiguous micro-batch ids replica ``replica`` runs under ``plan``."""
    start = sum(p.microbatches for p in plan.pipelines if p.replica < replica)
    count = next(p.microbatches for p in plan.pipelines if p.replica == replica)
    return range(start, start + count)
