"""The spend forecaster: its math, its artifact, and the budget built on it (no server)."""

from __future__ import annotations

import json
import random
import time

import pytest
from sglang_kvcmas.policy import spend_forecast as sf
from sglang_kvcmas.policy.spend_budget import Budget, BudgetExceeded, BudgetStatus
from sglang_kvcmas_bench import forecast_fit


def synthetic_runs(n: int = 24, seed: int = 0) -> list[list[dict]]:
    """Runs of 2..12 turns whose prompts grow with the transcript (as the recorded ones do)."""
    rng = random.Random(seed)
    runs = []
    for _ in range(n):
        agents, turns, transcript = rng.randint(2, 4), rng.randint(2, 12), 120
        run = []
        for k in range(turns):
            out = rng.randint(40, 250)
            prompt = 80 + transcript
            run.append({"agent": f"a{k % agents}", "prompt_tokens": prompt,
                        "recomputed": rng.randint(prompt // 4, prompt), "completion_tokens": out})
            transcript += out
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def fitted() -> sf.SpendForecaster:
    return forecast_fit.fit(synthetic_runs(), fitted_on="synthetic")


def test_one_turn_trajectory_and_interval_contains_the_point(fitted):
    state = sf.TrajectoryState.of_turns([{"agent": "a", "prompt_tokens": 200, "recomputed": 200,
                                          "completion_tokens": 50}])
    f = fitted.forecast(state)
    assert f.at_turn == 1 and f.spent == 250 and f.prompt_spent == 200
    assert f.spent <= f.low <= f.total <= f.high
    assert f.prompt_spent <= f.prompt_low <= f.prompt_total <= f.prompt_high
    for run in synthetic_runs(8, seed=3):
        for k in range(1, len(run) + 1):
            g = fitted.forecast(sf.TrajectoryState.of_turns(run[:k]))
            assert g.spent <= g.low <= g.total <= g.high and g.at_turn == k


def test_forecast_is_monotone_in_spend_so_far(fitted):
    base = synthetic_runs(1, seed=5)[0][:3]
    totals = []
    for extra in (0, 50, 200, 800):
        turns = [dict(t) for t in base]
        turns[-1]["completion_tokens"] += extra
        turns[0]["recomputed"] = min(turns[0]["prompt_tokens"], turns[0]["recomputed"] + extra)
        totals.append(fitted.forecast(sf.TrajectoryState.of_turns(turns)).total)
    assert totals == sorted(totals)


def test_artifact_round_trip_and_bad_artifacts(tmp_path, fitted):
    path = tmp_path / "f.json"
    path.write_text(json.dumps(fitted.to_json()))
    loaded = sf.load(path)
    state = sf.TrajectoryState.of_turns(synthetic_runs(1, seed=9)[0][:2])
    assert loaded.forecast(state) == fitted.forecast(state)
    with pytest.raises(sf.ForecastArtifactError, match="cannot read"):
        sf.load(tmp_path / "missing.json")
    for bad in ({"version": 99}, {**fitted.to_json(), "features": ["bias"]}, {"version": 1}):
        path.write_text(json.dumps(bad))
        with pytest.raises(sf.ForecastArtifactError):
            sf.load(path)
    path.write_text("{not json")
    with pytest.raises(sf.ForecastArtifactError):
        sf.load(path)


def test_the_shipped_artifact_loads_and_forecasts_fast():
    forecaster = sf.load()  # python/sglang_kvcmas/policy/spend_forecast.json
    state = sf.TrajectoryState.of_turns(synthetic_runs(1, seed=1)[0])
    t0 = time.perf_counter()
    for _ in range(200):
        f = forecaster.forecast(state)
    assert (time.perf_counter() - t0) / 200 < 0.005  # <= 5 ms a forecast
    assert f.low <= f.total <= f.high


def test_fit_needs_two_runs():
    with pytest.raises(ValueError, match="two runs"):
        forecast_fit.fit(synthetic_runs(1))


def test_budget_status_and_refusal(fitted):
    state = sf.TrajectoryState.of_turns(synthetic_runs(1, seed=2)[0][:2])
    f = fitted.forecast(state)
    ok = BudgetStatus(Budget(f.high + 1000, enforce=True), f.spent, f)
    assert not ok.exceeded and not ok.forecast_exceeded and not ok.refuses
    assert ok.usage_fields()["kvcmas_budget_forecast"] == f.total
    warned = BudgetStatus(Budget(max(f.spent + 1, f.total - 1), enforce=False), f.spent, f)
    assert warned.forecast_exceeded and not warned.refuses
    spent = BudgetStatus(Budget(f.spent, enforce=True), f.spent, f)
    assert spent.exceeded and spent.refuses
    err = spent.refusal("wf-9")
    assert isinstance(err, BudgetExceeded) and isinstance(err, ValueError)
    assert "'wf-9'" in str(err) and str(f.spent) in str(err) and str(f.total) in str(err)
    assert BudgetStatus(Budget(10), 3, None).usage_fields()["kvcmas_budget_forecast"] is None
    with pytest.raises(ValueError):
        Budget(0)


def test_in_flight_enters_the_state_and_prefixes_match_of_turns():
    turns = [{"agent": "p", "prompt_tokens": 100, "recomputed": 100, "completion_tokens": 40},
             {"agent": "w", "prompt_tokens": 150, "recomputed": 60, "completion_tokens": 30,
              "in_flight": 3},
             {"agent": "w", "prompt_tokens": 150, "recomputed": 60, "completion_tokens": 30,
              "in_flight": 2}]
    states = sf.TrajectoryState.prefixes(turns)
    assert [s.in_flight for s in states] == [0, 3, 2]
    assert [s.turns for s in states] == [1, 2, 3] and states[1].agents == 2
    assert sf.TrajectoryState.of_turns(turns) == states[-1]
    assert sf.TrajectoryState.of_turns([]) == sf.TrajectoryState()
    x = states[1].features()
    assert len(x) == len(sf.FEATURES)
    assert x[sf.FEATURES.index("log_in_flight")] > states[0].features()[
        sf.FEATURES.index("log_in_flight")]


def test_each_known_model_may_ship_its_own_artifact():
    assert sf.artifact_for(None) == sf.ARTIFACT
    assert sf.artifact_for("no-such-model") == sf.ARTIFACT
    for own in sf.ARTIFACT.parent.glob("spend_forecast_*.json"):
        model = own.stem.removeprefix("spend_forecast_")
        assert sf.artifact_for(model) == own
        sf.load(own)  # every shipped artifact loads


def test_the_pure_python_forest_equals_scikit_learns_prediction():
    """The server's tree walk against the library that fitted it, on training rows, random
    rows, and rows sitting exactly on split thresholds."""
    import numpy as np
    from sklearn.ensemble import RandomForestRegressor

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, len(sf.FEATURES))).astype(np.float64) * 3
    y = x[:, 1] * 2 + np.sin(x[:, 4]) + rng.normal(size=300) * 0.1
    forest = RandomForestRegressor(**forecast_fit.FOREST, random_state=0).fit(x, y)
    model = sf.MeasureModel(tuple(forecast_fit.tree_of_sklearn(t) for t in forest.estimators_), 0.0, 0.0)
    on_threshold = x[:20].copy()
    tree0 = model.trees[0]
    for i, row in enumerate(on_threshold):
        node = i % len(tree0.value)
        if tree0.left[node] >= 0:
            row[tree0.feature[node]] = tree0.threshold[node]
    probe = np.vstack([x[:50], rng.normal(size=(50, len(sf.FEATURES))) * 5, on_threshold,
                       np.zeros((1, len(sf.FEATURES)))])
    want = forest.predict(probe)
    from array import array

    got = [sum(t.predict(array("f", row)) for t in model.trees) / len(model.trees)
           for row in probe]
    assert np.allclose(got, want, rtol=0, atol=1e-9)


def test_malformed_trees_are_refused(tmp_path, fitted):
    good = fitted.to_json()
    path = tmp_path / "f.json"

    def with_tree(change):
        data = json.loads(json.dumps(good))
        tree = data["models"]["computed"]["trees"][0]
        change(tree)
        return data

    bad = [
        with_tree(lambda t: t[4].pop()),                      # arrays of different lengths
        with_tree(lambda t: t[2].__setitem__(0, 0)),          # a cycle: node 0's child is 0
        with_tree(lambda t: t[0].__setitem__(0, 99)),         # no such feature
        with_tree(lambda t: t[3].__setitem__(0, -1)),         # a node with one child
        with_tree(lambda t: t.clear()),                       # not a tree
    ]
    empty = json.loads(json.dumps(good))
    empty["models"]["prompt"]["trees"] = []
    for data in (*bad, empty):
        path.write_text(json.dumps(data))
        with pytest.raises(sf.ForecastArtifactError):
            sf.load(path)
