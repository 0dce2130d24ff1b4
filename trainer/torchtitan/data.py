"""Where every sample of a torchtitan job comes from, as a function of the job's position alone.

torchtitan's own loaders keep one state per data-parallel rank (``dp_rank_3``: that rank's place in
its shard of the dataset) and refuse a checkpoint taken at another dp degree ("dataloader resharding
is not supported yet"). A job the platform restarts at a new layout changes exactly that degree, so
the loader here keeps one number for the whole job instead: how many samples the job has consumed.

* The corpus is one packed token stream (each document ``<bos> … <eos>``, the corpus repeated), and
  sample ``i`` is the window of ``seq_len + 1`` tokens starting at ``i · seq_len`` (inputs, and the
  labels shifted by one), with per-document positions that restart at 0 where a document starts —
  the convention torchtitan's attention masks and the detector's sequence lengths read.
* Batch ``k`` of dp rank ``r`` among ``D`` holds the ``B`` samples of slot ``k·D + r``. A step takes
  the same number of batches on every rank, so step ``s`` always consumes the global samples
  ``[s·G, (s+1)·G)`` for a global batch of ``G``, whatever ``D``, ``B``, gradient accumulation or
  pipeline micro-batching: a job restarted at another layout with the same global batch sees no
  sample twice and skips none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackedStream:
    """The packed corpus: ``tokens`` (the concatenated documents) and ``starts`` (1 where a document
    begins), both of one length."""

    tokens: np.ndarray
    starts: np.ndarray

    @classmethod
    def from_documents(cls, documents: list[list[int]]) -> PackedStream:
        if not documents or not any(documents):
            raise ValueError("the corpus has no tokens; build it with trainer.torchtitan.assets.build_assets")
        tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents if d])
        starts = np.zeros(len(tokens), dtype=bool)
        starts[np.cumsum([0] + [len(d) for d in documents if d][:-1])] = True
        return cls(tokens, starts)

    def sample(self, index: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, positions, labels) of global sample ``index``, each ``seq_len`` long."""
        n = len(self.tokens)
        at = (index * seq_len + np.arange(seq_len + 1)) % n
        ids = self.tokens[at]
        return ids[:-1], positions_of(self.starts[at[:-1]]), ids[1:]


def positions_of(starts: np.ndarray) -> np.ndarray:
    """Per-token positions restarting at 0 at every document start. A window that begins inside a
    document starts at 0 too: torchtitan reads a 0 as a boundary, and the document's earlier tokens
    are outside the window either way."""
    idx = np.arange(len(starts))
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))


def slot(batch_index: int, dp_rank: int, dp_degree: int) -> int:
    """The global slot of a rank's ``batch_index``-th batch: slots interleave ranks, so the first
    ``D`` slots are the first batch of every rank."""
    return batch_index * dp_degree + dp_rank


def batches_done(samples_consumed: int, dp_degree: int, batch_size: int) -> int:
    """How many batches each rank of a layout has taken after the job consumed ``samples_consumed``;
    raises when the position is not a whole number of that layout's rounds (the global batch changed)."""
    per_round = dp_degree * batch_size
    if samples_consumed % per_round:
        raise ValueError(f"the job has consumed {samples_consumed} samples, not a multiple of dp degree "
                         f"{dp_degree} x batch {batch_size}; resume with a layout whose dp x batch divides the "
                         "global batch")
    return samples_consumed // per_round
