"""The job's noise σ: the scale every CUSUM's thresholds are set in.

Scores are centred log-ratios of own compute over predicted; their spread on a healthy job is the
noise the CUSUMs must not alarm on. It is read over a window of iterations (``window_iterations``),
from the fast side only (``fast_side_sigma``), and never below ``sigma_floor``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from analytics.detection.config import DetectorConfig
from analytics.detection.frame import IterationFrame
from analytics.detection.scoring import FrameScore, fit_ranks, tp_group_max


def fast_side_sigma(pooled: np.ndarray, *, levelled: bool = False) -> float:
    """The noise σ of scores ``pooled`` (centred log-ratios), read from their fast side only: the
    deviations below the median, 1.4826·their median, or with ``levelled`` the larger of that and
    their 90th percentile over 1.6449 (both are σ for normal noise: the deviations are half-normal). 0 when nothing lies below.

    Why the fast side: slowdowns (unsuspected yet, any number of them) and preemption only add
    time, so the half below the median is what healthy noise looks like.

    Why the tail for levelled scores: without sequence lengths each micro-batch's prediction is
    levelled on the median over its replica's stages (analytics/detection/scoring.py), which pulls the middle
    stages' scores to 0 and leaves the outer ones — those that can alarm — as spread as the raw
    per-stage noise. The median deviation then describes the middle ones: in the Megatron dialect
    it read σ 0.009 where a healthy stage under the simulator's 2 % per-stage jitter swung by
    +0.06 twice in a row and opened a ×1.06 incident. Scores centred on the whole job (sequence
    lengths known) keep the median: their tail is what it implies, and a larger σ there only
    delays the smallest slowdowns (×1.05)."""
    centre = float(np.median(pooled))
    below = centre - pooled[pooled < centre]
    if not len(below):
        return 0.0
    sigma = 1.4826 * float(np.median(below))
    return max(sigma, float(np.quantile(below, 0.9)) / 1.6449) if levelled else sigma


class JobNoise:
    """The window of clean TP groups' scores the job's σ is read from, and the last σ read."""

    def __init__(self, window_iterations: int) -> None:
        self.window: deque[np.ndarray] = deque(maxlen=window_iterations)
        self.last_sigma: float | None = None  # the job's σ at the last judged iteration

    def measure(self, frame: IterationFrame, score: FrameScore, suspects: set[int], config: DetectorConfig) -> float:
        """Add this iteration's scores and read σ.

        One value per clean TP group, its slowest member: suspects' groups are out (their peers
        wait for the suspect, ``fit_ranks``), and members that waited for a peer read fast, which
        is not noise (``tp_group_max``); on the paced torch trainer a peer of a ×3 rank scores
        ×0.05, which alone made σ ≈ 1.6 and resolved the slow rank's incident while it was still slow."""
        self.window.append(tp_group_max(frame, score.z, fit_ranks(frame, suspects)))
        pooled = np.concatenate(list(self.window))
        sigma = max(fast_side_sigma(pooled, levelled=score.inferred), config.sigma_floor) if len(pooled) else \
            config.sigma_floor
        self.last_sigma = sigma
        return sigma

    def forget(self) -> None:
        """A new layout whose classes are keyed by stage index: its scores are of other work."""
        self.window.clear()
