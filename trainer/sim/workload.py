"""Micro-batches of packed variable-length sequences under a token budget.

Documents are drawn from a long-tailed (log-normal) length distribution, truncated to the budget,
and packed greedily in arrival order: a micro-batch takes whole documents until the next one would
not fit (no splitting, as in packed fine-tuning with document masking). So both the token count N
and Σlᵢ² — which attention cost follows — vary from micro-batch to micro-batch.

Defaults and where they come from: web-text pre-training corpora have document lengths with a
median of a few hundred tokens and a heavy right tail spanning three to four orders of magnitude;
a log-normal with median 600 tokens and σ = 1.2 reproduces that shape (about 10 % of documents are
over 2,800 tokens). ``long_context`` (median 3,000, σ = 1.5, 32k budget) mimics long-context
fine-tuning mixes where a few documents fill most of a micro-batch. These are shapes chosen to look
like published length histograms, not fits to a particular dataset; pass your own numbers.

Long-document bursts (``burst_rate`` > 0): now and then a replica's data loader reaches a run of
long documents (a shard of books or code files) and, for ``burst_iterations`` iterations, that
replica's micro-batches pack a few long documents each (``burst_median_tokens``, ``burst_sigma``)
while the other replicas keep the ordinary mix. Its chunks then run ×1.3–×2 longer on every stage
at once, which is not a fault: the ``long_doc_bursts_*`` scenarios (docs/scenarios.md) grade
detectors on it. Whether a (replica, iteration) is in a burst depends only on the seed, the
iteration and the replica (``burst_rows``), never on how iterations are batched.

Packing is vectorised over rows (replicas × iterations): one ``searchsorted`` per micro-batch
index, never a Python loop per document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens_per_microbatch: int = Field(default=4096, ge=1, description="the packing budget")
    median_tokens: float = Field(default=600.0, gt=0)
    sigma: float = Field(default=1.2, ge=0, description="log-normal shape; 0 gives fixed-length documents")
    min_tokens: int = Field(default=16, ge=1)
    burst_rate: float = Field(default=0.0, ge=0, le=1, description=(
        "chance per (replica, iteration) that a burst of long documents starts on the replica; 0: none"))
    burst_iterations: int = Field(default=3, ge=1, description="how many iterations a burst lasts")
    burst_median_tokens: float = Field(default=16_000.0, gt=0, description="median document length in a burst")
    burst_sigma: float = Field(default=1.0, ge=0, description="log-normal shape of a burst's document lengths")


WORKLOAD_PRESETS: dict[str, WorkloadSpec] = {
    "pretrain": WorkloadSpec(),
    "long_context": WorkloadSpec(tokens_per_microbatch=32_768, median_tokens=3000.0, sigma=1.5, min_tokens=64),
    "uniform": WorkloadSpec(tokens_per_microbatch=4096, median_tokens=1024.0, sigma=0.0),
}


@dataclass(frozen=True)
class Packed:
    """Packed micro-batches of ``rows`` independent streams, ``M`` micro-batches each."""

    tokens: np.ndarray  # (rows, M) int64
    sum_sq: np.ndarray  # (rows, M) float64, Σ lᵢ² over the documents of each micro-batch
    lengths: np.ndarray  # (rows, K) int64 document lengths in arrival order
    first: np.ndarray  # (rows, M) index of each micro-batch's first document in ``lengths``
    end: np.ndarray  # (rows, M) one past its last document

    def seq_lens(self, row: int, microbatch: int) -> list[int]:
        return self.lengths[row, self.first[row, microbatch]:self.end[row, microbatch]].tolist()


def draw_lengths(rng: np.random.Generator, spec: WorkloadSpec, rows: int, count: int) -> np.ndarray:
    """(rows, count) document lengths, clipped to [min_tokens, tokens_per_microbatch]."""
    raw = spec.median_tokens * np.exp(spec.sigma * rng.standard_normal((rows, count)))
    return np.clip(np.rint(raw), spec.min_tokens, spec.tokens_per_microbatch).astype(np.int64)


def docs_needed(spec: WorkloadSpec, microbatches: int) -> int:
    """Documents to draw per stream so that ``microbatches`` packs (almost) never run dry."""
    mean = min(spec.median_tokens * np.exp(spec.sigma**2 / 2), spec.tokens_per_microbatch)
    per_mb = spec.tokens_per_microbatch / max(mean, spec.min_tokens)
    return int(np.ceil(microbatches * (per_mb * 1.6 + 2))) + 8


def pack(lengths: np.ndarray, budget_tokens: int, microbatches: int) -> Packed | None:
    """Greedy packing of each row's documents into ``microbatches`` micro-batches.

    Returns None when some row ran out of documents (draw more and call again).
    """
    rows, K = lengths.shape
    C = np.zeros((rows, K + 1), dtype=np.int64)
    np.cumsum(lengths, axis=1, out=C[:, 1:])
    Q = np.zeros((rows, K + 1), dtype=np.float64)
    np.cumsum(lengths.astype(np.float64) ** 2, axis=1, out=Q[:, 1:])
    offset = int(C[:, -1].max()) + budget_tokens + 1  # row r's prefix sums live in [r·offset, ...)
    row_base = np.arange(rows, dtype=np.int64) * offset
    flat = (C + row_base[:, None]).ravel()
    row_start = np.arange(rows, dtype=np.int64) * (K + 1)
    first = np.empty((rows, microbatches), dtype=np.int64)
    end = np.empty((rows, microbatches), dtype=np.int64)
    p = np.zeros(rows, dtype=np.int64)
    r_idx = np.arange(rows)
    for m in range(microbatches):
        target = C[r_idx, p] + budget_tokens + row_base
        e = np.searchsorted(flat, target, side="right") - 1 - row_start
        e = np.minimum(e, K)
        if np.any(e <= p) or np.any(e >= K):
            return None  # a row is out of documents
        first[:, m] = p
        end[:, m] = e
        p = e
    tokens = C[r_idx[:, None], end] - C[r_idx[:, None], first]
    sum_sq = Q[r_idx[:, None], end] - Q[r_idx[:, None], first]
    return Packed(tokens, sum_sq, lengths, first, end)


def burst_rows(spec: WorkloadSpec, seed: int, first_iteration: int, iterations: int, replicas: list[int]
               ) -> np.ndarray | None:
    """(iterations · len(replicas),) True where a replica is in a long-document burst, rows
    iteration-major as ``draw_microbatches`` stacks them; None when the workload has no bursts.

    A burst starts at iteration k on replica r when the uniform drawn for r from (seed, k) falls
    under ``burst_rate``, and lasts ``burst_iterations``: the same replicas and iterations however
    iterations are batched, whatever the replica's group."""
    if spec.burst_rate <= 0 or not replicas:
        return None
    width = max(replicas) + 1
    span = spec.burst_iterations
    starts = np.stack([np.random.default_rng([seed, k, 5]).random(width) < spec.burst_rate if k >= 0
                       else np.zeros(width, dtype=bool)  # nothing ran before the first iteration
                       for k in range(first_iteration - span + 1, first_iteration + iterations)])
    ongoing = np.stack([starts[j:j + span].any(axis=0) for j in range(iterations)])  # (iterations, width)
    return ongoing[:, replicas].reshape(-1)


def _burst_spec(spec: WorkloadSpec) -> WorkloadSpec:
    return spec.model_copy(update={"median_tokens": spec.burst_median_tokens, "sigma": spec.burst_sigma})


def draw_microbatches(rngs: list[np.random.Generator], spec: WorkloadSpec, streams: int, microbatches: int,
                      bursts: np.ndarray | None = None) -> Packed:
    """One independent set of ``streams`` × ``microbatches`` micro-batches per generator, stacked
    (rows = len(rngs) · streams, generator-major). Each generator's draws depend only on itself,
    so an iteration's workload does not depend on how iterations are batched. ``bursts`` (one
    bool per row, ``burst_rows``): rows whose documents come from the burst's long lengths, drawn
    after the ordinary ones so the other rows are the same with bursts or without."""
    count = docs_needed(spec, microbatches)
    while True:
        parts = []
        for i, g in enumerate(rngs):
            drawn = draw_lengths(g, spec, streams, count)
            if bursts is not None and bursts[i * streams:(i + 1) * streams].any():
                long = draw_lengths(g, _burst_spec(spec), streams, count)
                drawn = np.where(bursts[i * streams:(i + 1) * streams, None], long, drawn)
            parts.append(drawn)
        lengths = np.concatenate(parts) if rngs else np.zeros((0, count), dtype=np.int64)
        packed = pack(lengths, spec.tokens_per_microbatch, microbatches)
        if packed is not None:
            return packed
        count *= 2  # rare: a row drew unusually short documents; redraw everything, deterministically
        rngs = [g.spawn(1)[0] for g in rngs]
