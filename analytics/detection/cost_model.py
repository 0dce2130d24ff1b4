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
analytics/detection/scoring.py). When the source reports no token counts either (N is NaN: unknown, not 0),
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
        self.forgotten: set[int] = set()  # TP groups whose rows were taken out (analytics/detection/scoring.py forget_suspects)

    def observe(self, key: Hashable, iteration: int, tokens: np.ndarray, sum_sq_len: np.ndarray,
                duration_s: np.ndarray, groups: np.ndarray | None = None) -> None:
        """Add one iteration's healthy work units of class ``key`` (arrays of equal length);
        ``groups``: the TP group each unit ran on (its lowest rank), so that a group found slow
        later can be taken back out (``forget_groups``)."""
        if len(tokens) == 0:
            return
        g = np.full(len(tokens), -1, np.int64) if groups is None else np.asarray(groups, np.int64)
        w = self._windows.setdefault(key, _ClassWindow())
        if w.iterations and w.iterations[-1][0] == iteration:
            it, t0, s0, d0, g0 = _entry(w.iterations.pop())
            tokens, sum_sq_len, duration_s, g = (np.concatenate([t0, tokens]), np.concatenate([s0, sum_sq_len]),
                                                 np.concatenate([d0, duration_s]), np.concatenate([g0, g]))
        w.iterations.append((iteration, np.asarray(tokens, float), np.asarray(sum_sq_len, float),
                             np.asarray(duration_s, float), g))
        while len(w.iterations) > self.window_iterations:
            w.iterations.popleft()
        w.dirty = True

    def forget_groups(self, groups: set[int]) -> None:
        """Take back what the TP groups ``groups`` taught, and refit: a group found slow taught the
        window while it was not yet suspected (from its first iteration, if it was slow from the
        start). Where only two groups run a class, half its rows were slow and the robust fit sat
        between them: the slow one read ×1.42 for ×1.72 and the healthy one read fast. A class
        that would be left with no rows keeps them (nobody else runs its work to learn it from)."""
        if not groups:
            return
        gone = np.fromiter(groups, np.int64, len(groups))
        for w in self._windows.values():
            entries = [_entry(x) for x in w.iterations]
            keep = [~np.isin(x[4], gone) for x in entries]
            if all(k.all() for k in keep) or not any(k.any() for k in keep):
                continue
            w.iterations = deque((it, t[k], s2[k], d[k], g[k])
                                 for (it, t, s2, d, g), k in zip(entries, keep) if k.any())
            w.dirty = True
        self.refit()

    def without_groups(self, groups: set[int]) -> CostModel:
        """A copy that never learned from ``groups`` (``forget_groups`` on the copy): this model
        stays as it is. Classes the groups never taught share their windows and fits with it."""
        other = CostModel(self.window_iterations)
        other._windows = {key: _ClassWindow(deque(w.iterations), w.dirty) for key, w in self._windows.items()}
        other.fits = dict(self.fits)
        other.forget_groups(groups)
        return other

    def refit(self) -> None:
        """Refit every class that received rows since its last fit (all of them as one stacked fit,
        ``fit_classes``: at 100k ranks every class gets rows every iteration)."""
        dirty = [(key, w) for key, w in self._windows.items() if w.dirty and w.iterations]
        rows = []
        for _, w in dirty:
            n = np.concatenate([x[1] for x in w.iterations])  # (iteration, tokens, Σl², seconds[, groups])
            s2 = np.concatenate([x[2] for x in w.iterations])
            d = np.concatenate([x[3] for x in w.iterations])
            if len(d) > MAX_FIT_ROWS:
                keep = np.linspace(0, len(d) - 1, MAX_FIT_ROWS).astype(np.int64)
                n, s2, d = n[keep], s2[keep], d[keep]
            rows.append((n, s2, d))
        for (key, w), fit in zip(dirty, fit_classes(rows)):
            self.fits[key] = fit
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
        self.forgotten = set()

    # state for the detector's snapshot ---------------------------------------------------------

    def __getstate__(self) -> dict:
        return {"window_iterations": self.window_iterations, "windows": self._windows, "fits": self.fits,
                "forgotten": self.forgotten}

    def __setstate__(self, state: dict) -> None:
        self.window_iterations = state["window_iterations"]
        self._windows = state["windows"]
        self.fits = state["fits"]
        self.forgotten = state.get("forgotten", set())  # absent in a snapshot taken before it existed


def _entry(x: tuple) -> tuple:
    """A window entry as (iteration, tokens, Σl², seconds, groups): entries of a model pickled
    before units carried their TP group have no groups (-1, never forgotten)."""
    return x if len(x) == 5 else (*x, np.full(len(x[1]), -1, np.int64))


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
    return fit_classes([(tokens, sum_sq_len, duration_s)])[0]


_TERMS = ("alpha", "beta", "gamma")


@dataclass
class _ClassRows:
    """One class's rows as ``fit_class`` fits them: its features, the terms still fitted, the coefficients."""

    features: dict[str, np.ndarray]
    d: np.ndarray
    has_s2: bool
    has_n: bool
    active: list[str]
    coef: dict[str, float] = field(default_factory=dict)


def fit_classes(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[ClassFit]:
    """``fit_class`` of each (tokens, Σlᵢ², duration) in ``rows``, the same numbers class by class.

    Why at once: the cost model refits every class it holds after each iteration (32 at TP8·PP16),
    and one class's IRLS is a few dozen numpy calls on 768 rows: fitted one by one, per-call
    overhead, not arithmetic, makes the refit most of the sharded merge's judging (27 ms against
    9 ms stacked, at 100k ranks). Classes with the same number of rows and the
    same terms are stacked and fitted as one batch of small matrices; each class's products,
    solves and medians are the ones it would get alone (stacked ``matmul`` and ``solve`` run the
    same BLAS and LAPACK call per matrix, and a median along an axis is each row's median)."""
    classes = [_class_rows(*r) for r in rows]
    going = [c for c in classes if len(c.d)]
    for _ in range(len(_TERMS)):  # a round drops the terms that came out negative and refits the rest
        groups: dict[tuple[int, tuple[str, ...]], list[_ClassRows]] = {}
        for c in going:
            groups.setdefault((len(c.d), tuple(c.active)), []).append(c)
        going = []
        for (_, active), group in groups.items():
            for c, coef in zip(group, _irls_stacked(group, list(active))):
                c.coef = coef
                negative = [k for k in c.active if coef[k] < 0]
                if negative:
                    c.active = [k for k in c.active if k not in negative]
                    going.append(c)
    fits = {id(c): ClassFit(has_seq_lens=c.has_s2, has_tokens=c.has_n) for c in classes if not len(c.d)}
    by_rows: dict[int, list[_ClassRows]] = {}
    for c in classes:
        if len(c.d):
            by_rows.setdefault(len(c.d), []).append(c)
    for group in by_rows.values():
        fits.update(zip(map(id, group), _class_fits(group)))
    return [fits[id(c)] for c in classes]


def _class_rows(tokens: np.ndarray, sum_sq_len: np.ndarray, duration_s: np.ndarray) -> _ClassRows:
    ok = np.isfinite(duration_s) & (duration_s > 0)
    has_n = bool(np.all(np.isfinite(tokens[ok])))
    has_s2 = bool(np.all(np.isfinite(sum_sq_len[ok]))) and ok.any()
    n, d = (tokens[ok] if has_n else np.zeros(int(ok.sum()))), duration_s[ok]
    s2 = sum_sq_len[ok] if has_s2 else np.zeros_like(n)
    features = {"alpha": n, "beta": s2, "gamma": np.ones_like(n)}
    active = [k for k in _TERMS if k == "gamma" or (len(d) and np.ptp(features[k]) > 0)]
    if not has_s2 and "beta" in active:
        active.remove("beta")
    return _ClassRows(features, d, bool(has_s2), has_n, active)


def _class_fits(group: list[_ClassRows]) -> list[ClassFit]:
    """The fits of classes with the same (non-zero) row count, their line's statistics stacked."""
    feats = {k: np.stack([c.features[k] for c in group]) for k in _TERMS}  # (K, n) each
    d = np.stack([c.d for c in group])
    coef = {k: np.array([c.coef.get(k, 0.0) for c in group])[:, None] for k in _TERMS}
    pred = coef["alpha"] * feats["alpha"] + coef["beta"] * feats["beta"] + coef["gamma"] * feats["gamma"]
    rel_error = np.median(np.abs(d / np.maximum(pred, 1e-12) - 1.0), axis=1)
    mean_pred = pred.mean(axis=1)
    spread = pred.std(axis=1) / np.where(mean_pred > 0, mean_pred, np.nan)
    mean_s2 = feats["beta"].mean(axis=1)
    return [ClassFit(alpha=c.coef.get("alpha", 0.0), beta=c.coef.get("beta", 0.0), gamma=c.coef.get("gamma", 0.0),
                     has_seq_lens=c.has_s2, has_tokens=c.has_n, rel_error=float(rel_error[i]), rows=len(c.d),
                     workload_cv=float(spread[i]) if mean_pred[i] > 0 else float("nan"),
                     mean_sum_sq_len=float(mean_s2[i]) if c.has_s2 else float("nan"))
            for i, c in enumerate(group)]


def _irls_stacked(group: list[_ClassRows], active: list[str]) -> list[dict[str, float]]:
    """The IRLS of classes with the same row count and terms, stacked: (K classes, n rows, a terms)."""
    if not active:
        return [{} for _ in group]
    cols = np.stack([np.stack([c.features[k] for k in active], axis=1) for c in group])  # (K, n, a)
    d = np.stack([c.d for c in group])  # (K, n)
    scale = np.maximum(np.abs(cols).max(axis=1), 1e-30)  # (K, a)
    x = cols / scale[:, None, :] / d[:, :, None]  # relative error: divide each row by its observation
    y = np.ones_like(d)
    w = np.ones_like(d)
    theta = np.zeros((len(group), len(active)))
    ridge = 1e-9 * np.eye(len(active))
    for _ in range(IRLS_ROUNDS):
        xw = x * w[:, :, None]
        xw_t = xw.transpose(0, 2, 1)
        gram = np.matmul(xw_t, x) + ridge  # normal equations: columns are scaled, 3x3 at most
        theta = np.linalg.solve(gram, np.matmul(xw_t, y[:, :, None]))[:, :, 0]
        r = y - np.matmul(x, theta[:, :, None])[:, :, 0]
        sigma = 1.4826 * np.median(np.abs(r - np.median(r, axis=1, keepdims=True)), axis=1)
        c = HUBER_C * np.maximum(sigma, 1e-3)
        w = np.minimum(1.0, c[:, None] / np.maximum(np.abs(r), 1e-12))
    return [{k: float(t / s) for k, t, s in zip(active, th, sc)} for th, sc in zip(theta, scale)]
