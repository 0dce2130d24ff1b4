"""The chunk cost model T ≈ α·N + β·Σ lᵢ² + γ, one fit per work class, online and robust.

A *work class* is whatever makes two chunks comparable apart from their sequences: the pipeline
stage (its layers and TP degree), the virtual stage and the chunk kind (F, B, W). The detector
names classes; this module only fits and predicts.

Why the fit does not get poisoned:
- Its rows are *work units*, not ranks: the TP ranks of one stage run the same micro-batch, and the
  detector feeds the median of their own compute times (a slow TP rank is outvoted), leaving out
  ranks it currently suspects.
- It minimises *relative* error with Huber weights (IRLS): a chunk 3× slower than the line gets a
  weight of roughly the Huber constant over its residual, so one slow replica cannot pull α, β, γ.
- It keeps a sliding window of the last ``window_iterations`` iterations, so it follows slow drift
  (warm-up, thermal state) while a fault, which the detector flags within a few iterations, never
  dominates the window.

What can go wrong: with fixed-length packing N is the same for every chunk and α, γ are not
separately identifiable; the least-squares minimum-norm solution still predicts correctly, which is
all the detector needs. When the source reports no ``seq_lens`` (Σ lᵢ² is NaN) the class is fitted
on N alone and ``has_seq_lens`` says so; the detector then corrects per micro-batch (see
analytics/scoring.py). When the source reports no token counts either (N is NaN: unknown, not 0),
the class is fitted on γ alone and ``has_tokens`` says so: its chunks are taken as unknown but equal
work, so the fit is the class's robust centre (its Huber-weighted median), which is what the
TP/DP comparison and the per-micro-batch correction need; a slow rank is still off it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

HUBER_C = 1.345  # in robust standard deviations: 95% efficiency under Gaussian noise
IRLS_ROUNDS = 4
MAX_FIT_ROWS = 768  # a class's window beyond this is thinned evenly (large jobs: 3 numbers need few rows)


@dataclass
class ClassFit:
    """α (s/token), β (s/token²), γ (s) of one class, with its recent relative error."""

    alpha: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0
    has_seq_lens: bool = True
    has_tokens: bool = True  # False: fitted without token counts (γ alone, plus β when Σl² is known)
    rel_error: float = float("nan")  # median |observed/predicted − 1| over the window
    rows: int = 0
    workload_cv: float = float("nan")  # std/mean of the line's predictions over the window's rows
    mean_sum_sq_len: float = float("nan")  # mean Σlᵢ² of the window's rows (NaN without sequence lengths)


@dataclass
class _ClassWindow:
    iterations: deque = field(default_factory=deque)  # (iteration, tokens, s2, duration) arrays
    dirty: bool = True


class CostModel:
    """Per-class robust fits over a sliding window of recent healthy work units."""

    def __init__(self, window_iterations: int = 8) -> None:
        if window_iterations < 1:
            raise ValueError(f"window_iterations={window_iterations}: the window needs at least one iteration")
        self.window_iterations = window_iterations
        self._windows: dict[Hashable, _ClassWindow] = {}
        self.fits: dict[Hashable, ClassFit] = {}

    def observe(self, key: Hashable, iteration: int, tokens: np.ndarray, sum_sq_len: np.ndarray,
                duration_s: np.ndarray) -> None:
        """Add one iteration's healthy work units of class ``key`` (arrays of equal length)."""
        if len(tokens) == 0:
            return
        w = self._windows.setdefault(key, _ClassWindow())
        if w.iterations and w.iterations[-1][0] == iteration:
            it, t0, s0, d0 = w.iterations.pop()
            tokens, sum_sq_len, duration_s = (np.concatenate([t0, tokens]), np.concatenate([s0, sum_sq_len]),
                                              np.concatenate([d0, duration_s]))
        w.iterations.append((iteration, np.asarray(tokens, float), np.asarray(sum_sq_len, float),
                             np.asarray(duration_s, float)))
        while len(w.iterations) > self.window_iterations:
            w.iterations.popleft()
        w.dirty = True

    def refit(self) -> None:
        """Refit every class that received rows since its last fit."""
        for key, w in self._windows.items():
            if w.dirty and w.iterations:
                n = np.concatenate([x[1] for x in w.iterations])
                s2 = np.concatenate([x[2] for x in w.iterations])
                d = np.concatenate([x[3] for x in w.iterations])
                if len(d) > MAX_FIT_ROWS:
                    keep = np.linspace(0, len(d) - 1, MAX_FIT_ROWS).astype(np.int64)
                    n, s2, d = n[keep], s2[keep], d[keep]
                self.fits[key] = fit_class(n, s2, d)
                w.dirty = False

    def predict(self, key: Hashable, tokens: np.ndarray, sum_sq_len: np.ndarray) -> np.ndarray:
        """Predicted seconds for chunks of class ``key``; NaN when the class was never fitted."""
        fit = self.fits.get(key)
        if fit is None:
            return np.full(len(tokens), np.nan)
        s2 = np.nan_to_num(np.asarray(sum_sq_len, float), nan=0.0) if fit.has_seq_lens else 0.0
        return _token_term(fit.alpha, np.asarray(tokens, float)) + fit.beta * s2 + fit.gamma

    def predict_classes(self, keys: Sequence[Hashable], c_class: np.ndarray, tokens: np.ndarray,
                        sum_sq_len: np.ndarray) -> np.ndarray:
        """``predict`` for many classes at once: chunk i is of class ``keys[c_class[i]]``."""
        coef = np.full((len(keys), 4), np.nan)  # alpha, beta, gamma, uses Σl²
        for i, key in enumerate(keys):
            fit = self.fits.get(key)
            if fit is not None:
                coef[i] = (fit.alpha, fit.beta, fit.gamma, 1.0 if fit.has_seq_lens else 0.0)
        c = coef[c_class]
        s2 = np.nan_to_num(np.asarray(sum_sq_len, float), nan=0.0)
        return _token_term(c[:, 0], np.asarray(tokens, float)) + c[:, 1] * s2 * c[:, 3] + c[:, 2]

    def error(self) -> float:
        """The model's recent relative error over all classes (median of the class errors)."""
        errs = [f.rel_error for f in self.fits.values() if np.isfinite(f.rel_error)]
        return float(np.median(errs)) if errs else float("nan")

    def forget(self) -> None:
        """Drop every window and fit (a new plan changed what the classes mean)."""
        self._windows.clear()
        self.fits.clear()

    # state for the detector's snapshot ---------------------------------------------------------

    def __getstate__(self) -> dict:
        return {"window_iterations": self.window_iterations, "windows": self._windows, "fits": self.fits}

    def __setstate__(self, state: dict) -> None:
        self.window_iterations = state["window_iterations"]
        self._windows = state["windows"]
        self.fits = state["fits"]


def _token_term(alpha: np.ndarray | float, tokens: np.ndarray) -> np.ndarray:
    """α·N, where an unknown N (NaN) costs nothing under a fit made without tokens (α = 0) and is
    unknown (NaN: not judged) under one made with them."""
    return np.where(np.asarray(alpha) == 0.0, 0.0, alpha * tokens)


def fit_class(tokens: np.ndarray, sum_sq_len: np.ndarray, duration_s: np.ndarray) -> ClassFit:
    """Robust fit of duration = α·N + β·S2 + γ minimising Huber-weighted relative error.

    Coefficients are kept non-negative (a negative cost per token means the rows cannot tell the
    terms apart): a negative one is dropped and the rest refitted. ``workload_cv`` is the spread
    of the fitted line over the rows (std/mean of α·N + β·S2 + γ): the part of a chunk's time the
    packed mix moves, free of jitter and stalls, which the planner needs for a pipeline's mean
    (remediation.costs.ScheduleModelScorer). ``mean_sum_sq_len`` is the rows' mean Σlᵢ²: what
    β multiplies for a typical micro-batch, which the planner cannot infer from N alone.

    Rows without a token count (NaN) make the class a γ-only fit (``has_tokens`` False): the source
    does not report tokens, so its chunks count as equal work and γ is their robust centre. Fitting
    α on the rows that have counts would instead predict nothing for those that do not.
    """
    ok = np.isfinite(duration_s) & (duration_s > 0)
    has_n = bool(np.all(np.isfinite(tokens[ok])))
    has_s2 = bool(np.all(np.isfinite(sum_sq_len[ok]))) and ok.any()
    n, d = (tokens[ok] if has_n else np.zeros(int(ok.sum()))), duration_s[ok]
    s2 = sum_sq_len[ok] if has_s2 else np.zeros_like(n)
    if len(d) == 0:
        return ClassFit(has_seq_lens=has_s2, has_tokens=has_n)
    features = {"alpha": n, "beta": s2, "gamma": np.ones_like(n)}
    active = [k for k in ("alpha", "beta", "gamma") if np.ptp(features[k]) > 0 or k == "gamma"]
    if not has_s2 and "beta" in active:
        active.remove("beta")
    coef: dict[str, float] = {}
    weights = np.ones_like(d)
    for _ in range(len(features)):
        coef = _irls(features, active, d, weights)
        negative = [k for k in active if coef[k] < 0]
        if not negative:
            break
        active = [k for k in active if k not in negative]
    pred = np.sum([coef.get(k, 0.0) * features[k] for k in features], axis=0)
    rel = np.abs(d / np.maximum(pred, 1e-12) - 1.0)
    mean_pred = float(pred.mean())
    spread = float(pred.std() / mean_pred) if mean_pred > 0 else float("nan")
    return ClassFit(alpha=coef.get("alpha", 0.0), beta=coef.get("beta", 0.0), gamma=coef.get("gamma", 0.0),
                    has_seq_lens=has_s2, has_tokens=has_n, rel_error=float(np.median(rel)), rows=len(d), workload_cv=spread,
                    mean_sum_sq_len=float(s2.mean()) if has_s2 else float("nan"))


def _irls(features: dict[str, np.ndarray], active: list[str], d: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    if not active:
        return {}
    cols = np.stack([features[k] for k in active], axis=1)
    scale = np.maximum(np.abs(cols).max(axis=0), 1e-30)
    x = cols / scale / d[:, None]  # relative error: divide each row by its observation
    y = np.ones_like(d)
    w = weights.copy()
    theta = np.zeros(len(active))
    for _ in range(IRLS_ROUNDS):
        xw = x * w[:, None]
        gram = xw.T @ x + 1e-9 * np.eye(len(active))  # normal equations: columns are scaled, 3x3 at most
        theta = np.linalg.solve(gram, xw.T @ y)
        r = y - x @ theta
        sigma = 1.4826 * np.median(np.abs(r - np.median(r)))
        c = HUBER_C * max(sigma, 1e-3)
        w = np.minimum(1.0, c / np.maximum(np.abs(r), 1e-12))
    return {k: float(t / s) for k, t, s in zip(active, theta, scale)}
