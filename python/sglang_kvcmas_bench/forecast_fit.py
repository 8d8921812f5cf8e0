"""Fit the spend forecaster offline (``policy/spend_forecast.py`` serves it): a random forest per
measure over every prefix of recorded runs, with held-out residual quantiles for its interval.

Used by ``benchmark/serving/forecast_bench.py --fit`` (which writes the artifact the server loads)
and by tests. Needs scikit-learn and numpy; the served package never imports this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sglang_kvcmas.policy.spend_forecast import (
    FEATURES,
    MEASURES,
    SIGNS,
    MeasureModel,
    SpendForecaster,
    TrajectoryState,
    Tree,
)

FOREST = {"n_estimators": 30, "max_depth": 6, "min_samples_leaf": 5}
"""The forest's size, chosen by cross-validation on the recorded runs: as accurate as larger
unbounded forests, in a smaller artifact (``docs/results.md``, Serving: spend forecast)."""


def tree_of_sklearn(tree: Any) -> Tree:
    """A served :class:`Tree` from a fitted scikit-learn ``DecisionTreeRegressor`` (its
    ``tree_``)."""
    t = tree.tree_
    return Tree(tuple(int(v) for v in t.feature), tuple(float(v) for v in t.threshold),
                tuple(int(v) for v in t.children_left), tuple(int(v) for v in t.children_right),
                tuple(float(v) for v in t.value[:, 0, 0]))


def fit_measure(x: Any, y_remaining: Any, coverage: tuple[float, float] = (0.1, 0.9),
                folds: int = 5, groups: Any = None, seed: int = 0) -> MeasureModel:
    """Fit one measure: ``x`` (n x len(FEATURES)), ``y_remaining`` (n, tokens). Rows are
    weighted so that every run (``groups``: the run of each row) weighs the same. The interval's
    quantiles come from residuals of ``folds``-fold cross-validation, folds drawn by run (a
    run's rows are held out together). Needs scikit-learn."""
    import numpy as np
    from sklearn.ensemble import RandomForestRegressor

    x = np.asarray(x, dtype=np.float64)
    y = np.log1p(np.maximum(np.asarray(y_remaining, dtype=np.float64), 0.0))
    groups = np.arange(len(y)) if groups is None else np.asarray(groups)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    weight = 1.0 / counts[inverse]  # every run weighs the same, long or short
    monotone = [SIGNS.get(name, 0) for name in FEATURES]

    def forest(rows: Any) -> Any:
        return RandomForestRegressor(**FOREST, monotonic_cst=monotone, random_state=seed,
                                     n_jobs=1).fit(x[rows], y[rows], sample_weight=weight[rows])

    uniq = np.unique(groups)
    residuals = []
    for f in range(min(folds, len(uniq))):
        held = np.isin(groups, uniq[f::folds])
        if held.all() or not held.any():
            continue
        pred = np.clip(forest(~held).predict(x[held]), 0.0, 30.0)
        residuals.append(y[held] - pred)
    res = np.concatenate(residuals) if residuals else np.zeros(1)
    fitted = forest(np.ones(len(y), dtype=bool))
    q_low = min(0.0, float(np.quantile(res, coverage[0])))
    q_high = max(0.0, float(np.quantile(res, coverage[1])))
    return MeasureModel(tuple(tree_of_sklearn(t) for t in fitted.estimators_), q_low, q_high)


def training_rows(runs: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[list, dict, list]:
    """Every prefix of every run as one row: features after ``k`` turns (1 <= k < T) and the
    remaining spend per measure. Returns (features, measure -> remaining, run index)."""
    xs: list[list[float]] = []
    ys: dict[str, list[float]] = {m: [] for m in MEASURES}
    groups: list[int] = []
    for i, turns in enumerate(runs):
        states = TrajectoryState.prefixes(turns)
        for state in states[:-1]:
            xs.append(state.features())
            for m in MEASURES:
                ys[m].append(states[-1].spent(m) - state.spent(m))
            groups.append(i)
    return xs, ys, groups


def fit(runs: Sequence[Sequence[Mapping[str, Any]]],
        coverage: tuple[float, float] = (0.1, 0.9), fitted_on: str = "",
        seed: int = 0) -> SpendForecaster:
    """A forecaster fitted on ``runs`` (each a list of turn records in finish order, as
    :meth:`TrajectoryState.prefixes` reads them). Needs scikit-learn.

    Raises:
        ValueError: fewer than two runs of two or more turns.
    """
    xs, ys, groups = training_rows(runs)
    if len(set(groups)) < 2:
        raise ValueError("fitting needs at least two runs of two or more turns")
    return SpendForecaster({m: fit_measure(xs, ys[m], coverage, groups=groups, seed=seed)
                            for m in MEASURES}, coverage, fitted_on)
