"""The cost model recovers α, β, γ, shrugs off slow rows, and says how wrong it is."""

from __future__ import annotations

import numpy as np

from analytics.detection.cost_model import CostModel, fit_class


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


def _two_groups(model: CostModel, rng: np.random.Generator, slow: float, iterations: int = 4):
    """A class run by two TP groups (lowest ranks 4 and 20), the first ``slow`` times slower."""
    truth = None
    for it in range(iterations):
        for group, factor in ((4, slow), (20, 1.0)):
            tokens, s2, d, true = _rows(16, rng, noise=0.01)
            model.observe("stage2", it, tokens, s2, d * factor, groups=np.full(16, group))
            truth = (tokens, s2, true)
    model.refit()
    return truth


def test_a_group_found_slow_is_taken_back_out_of_the_window() -> None:
    """Two groups run the class and one is ×1.8 from the start: the robust fit sits between them
    (half its rows are slow). Forgotten, the line is the healthy group's."""
    model = CostModel(window_iterations=8)
    tokens, s2, true = _two_groups(model, np.random.default_rng(3), slow=1.8)
    before = np.median(model.predict("stage2", tokens, s2) / true)
    copy = model.without_groups({4})
    assert np.median(model.predict("stage2", tokens, s2) / true) == before  # the copy leaves it as it was
    model.forget_groups({4})
    after = np.median(model.predict("stage2", tokens, s2) / true)
    assert before > 1.15 and abs(after - 1) < 0.03, (before, after)
    assert np.allclose(copy.predict("stage2", tokens, s2), model.predict("stage2", tokens, s2))


def test_a_class_nobody_else_runs_keeps_its_rows() -> None:
    model = CostModel(window_iterations=8)
    rng = np.random.default_rng(4)
    tokens, s2, d, _ = _rows(16, rng)
    model.observe("head", 0, tokens, s2, d, groups=np.full(16, 7))
    model.refit()
    fit = model.fits["head"]
    model.forget_groups({7})
    assert model.fits["head"] is fit and model.fits["head"].rows == 16


def test_a_window_pickled_before_units_carried_their_group_still_learns_and_forgets() -> None:
    import pickle

    model = CostModel(window_iterations=8)
    rng = np.random.default_rng(5)
    tokens, s2, d, _ = _rows(16, rng)
    model.observe("stage0", 0, tokens, s2, d)
    state = model.__getstate__()
    for w in state["windows"].values():  # as a snapshot of an older build holds them
        w.iterations = type(w.iterations)(x[:4] for x in w.iterations)
    del state["forgotten"]
    old = pickle.loads(pickle.dumps(model))
    old.__setstate__(state)
    assert old.forgotten == set()
    old.observe("stage0", 0, tokens, s2, d, groups=np.full(16, 3))  # the same iteration: appended to the old entry
    old.forget_groups({3})
    old.refit()
    assert old.fits["stage0"].rows == 16  # the old rows, with no group, are never forgotten
