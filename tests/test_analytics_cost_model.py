"""The cost model recovers α, β, γ, shrugs off slow rows, and says how wrong it is."""

from __future__ import annotations

import numpy as np

from analytics.cost_model import CostModel, fit_class


def _rows(n: int, rng: np.random.Generator, noise: float = 0.02):
    lens = [rng.integers(64, 4096, size=rng.integers(1, 10)) for _ in range(n)]
    tokens = np.array([x.sum() for x in lens], float)
    s2 = np.array([(x.astype(float) ** 2).sum() for x in lens])
    true = 3e-6 * tokens + 5e-11 * s2 + 2e-3
    return tokens, s2, true * np.exp(rng.normal(0, noise, n)), true


def test_fit_recovers_the_coefficients_and_reports_its_error() -> None:
    tokens, s2, d, true = _rows(400, np.random.default_rng(0))
    fit = fit_class(tokens, s2, d)
    assert fit.has_seq_lens
    assert abs(fit.alpha / 3e-6 - 1) < 0.1 and abs(fit.beta / 5e-11 - 1) < 0.1
    pred = fit.alpha * tokens + fit.beta * s2 + fit.gamma
    assert np.median(np.abs(pred / true - 1)) < 0.01
    assert 0.005 < fit.rel_error < 0.03  # ~ the 2% noise it was given


def test_a_fifth_of_rows_three_times_slower_does_not_poison_the_fit() -> None:
    tokens, s2, d, true = _rows(500, np.random.default_rng(1))
    d[::5] *= 3.0
    fit = fit_class(tokens, s2, d)
    pred = fit.alpha * tokens + fit.beta * s2 + fit.gamma
    assert np.median(np.abs(pred / true - 1)) < 0.03


def test_without_seq_lens_the_class_is_fitted_on_tokens_and_says_so() -> None:
    tokens, s2, d, _ = _rows(200, np.random.default_rng(2))
    fit = fit_class(tokens, np.full_like(s2, np.nan), d)
    assert not fit.has_seq_lens and fit.beta == 0.0 and fit.alpha > 0


def test_the_window_forgets_old_iterations_so_drift_is_followed() -> None:
    model = CostModel(window_iterations=3)
    rng = np.random.default_rng(3)
    for it in range(10):
        tokens, s2, d, _ = _rows(50, rng, noise=0.0)
        model.observe("c", it, tokens, s2, d * (2.0 if it >= 5 else 1.0))
        model.refit()
    tokens, s2, _, true = _rows(20, rng, noise=0.0)
    assert np.allclose(model.predict("c", tokens, s2), 2.0 * true, rtol=0.01)
    assert np.isnan(model.predict("unknown", tokens, s2)).all()
