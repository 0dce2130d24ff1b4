"""Packing: whole documents under the token budget, long-tailed lengths, deterministic per seed."""

from __future__ import annotations

import numpy as np

from trainer.sim.workload import WORKLOAD_PRESETS, WorkloadSpec, burst_rows, draw_microbatches


def test_microbatches_pack_whole_documents_under_the_budget() -> None:
    spec = WORKLOAD_PRESETS["pretrain"]
    rngs = [np.random.default_rng([1, i]) for i in range(5)]
    p = draw_microbatches(rngs, spec, 3, 16)
    assert p.tokens.shape == (15, 16)
    assert (p.tokens <= spec.tokens_per_microbatch).all() and (p.tokens > 0).all()
    for row in range(15):
        for m in range(16):
            lens = p.seq_lens(row, m)
            assert sum(lens) == p.tokens[row, m]
            assert p.sum_sq[row, m] == sum(x * x for x in lens)
        assert (p.first[row, 1:] == p.end[row, :-1]).all()  # in arrival order, nothing skipped
    # Σl² varies widely at a nearly fixed token count: the reason chunk time varies.
    ratio = p.sum_sq / p.tokens**2
    assert ratio.max() / ratio.min() > 5


def test_each_generator_draws_its_own_iteration_independent_of_batching() -> None:
    spec = WorkloadSpec(median_tokens=300, sigma=1.0)
    together = draw_microbatches([np.random.default_rng([2, i]) for i in range(4)], spec, 2, 8)
    alone = draw_microbatches([np.random.default_rng([2, 3])], spec, 2, 8)
    assert np.array_equal(together.tokens[6:8], alone.tokens)
    assert np.array_equal(together.sum_sq[6:8], alone.sum_sq)


def test_fixed_length_documents_give_uniform_microbatches() -> None:
    p = draw_microbatches([np.random.default_rng(0)], WORKLOAD_PRESETS["uniform"], 2, 4)
    assert (p.tokens == 4096).all() and (p.sum_sq == 4 * 1024**2).all()


def test_long_document_bursts_land_on_whole_replicas_for_their_span_whatever_the_batching() -> None:
    """A burst is a replica's few iterations of long documents: the same (iteration, replica)
    cells however iterations are batched, the other rows drawn as without bursts."""
    spec = WorkloadSpec(tokens_per_microbatch=32_768, median_tokens=600, sigma=1.2, min_tokens=64, burst_rate=0.05,
                        burst_iterations=3, burst_median_tokens=20_000, burst_sigma=0.8)
    replicas = list(range(16))
    whole = burst_rows(spec, seed=7, first_iteration=0, iterations=40, replicas=replicas)
    assert whole is not None
    halves = np.concatenate([burst_rows(spec, 7, 0, 17, replicas), burst_rows(spec, 7, 17, 23, replicas)])
    assert np.array_equal(whole, halves)
    cells = whole.reshape(40, 16)
    assert 0 < cells.mean() < 0.5
    starts = cells[1:] & ~cells[:-1]  # a burst that begins after the first iteration lasts its span
    for k, d in zip(*np.nonzero(starts[:-3])):
        assert cells[k + 1:k + 4, d].all()
    assert burst_rows(spec.model_copy(update={"burst_rate": 0.0}), 7, 0, 40, replicas) is None

    rngs = [np.random.default_rng([7, k]) for k in range(40)]
    plain = draw_microbatches([np.random.default_rng([7, k]) for k in range(40)], spec, 16, 8)
    bursty = draw_microbatches(rngs, spec, 16, 8, whole)
    assert np.array_equal(plain.sum_sq[~whole], bursty.sum_sq[~whole])
    per_token = bursty.sum_sq.sum(axis=1) / bursty.tokens.sum(axis=1)  # attention's weight per token
    assert np.median(per_token[whole]) > 5 * np.median(per_token[~whole])
