"""Forecast a workflow's total spend from its trajectory so far, with an interval.

*Spend* (tokens) has two measures, both forecast:

- ``computed`` = ``recomputed`` (prefill) + ``completion_tokens`` (decode): the tokens the
  server ran the model for, the run's compute cost (the budget is set in this unit);
- ``prompt`` = ``prompt_tokens``: the tokens every call read (reused or not), the cost a
  provider without a shared cache would bill.

The model sees only what a server sees of a run (no workflow kind, no script): the aggregates in
:class:`TrajectoryState` after ``k`` finished turns. Per measure it predicts ``log1p`` of the
*remaining* spend by a random forest (scikit-learn's ``RandomForestRegressor``, fitted offline,
every run weighing the same, monotone in the features that grow with the spend so far:
:data:`SIGNS`); the total is ``spent + remaining``, so the forecast is never below the spend so
far and does not fall when it rises. The interval scales the remaining spend by the ``q_low`` /
``q_high`` quantiles of held-out log residuals (``low <= total <= high`` by construction).

Fitted offline (``sglang_kvcmas_bench.forecast_fit``, by ``benchmark/serving/forecast_bench.py
--fit`` on recorded runs) into a JSON artifact of the trees' arrays, loaded once (:func:`load`).
Token counts differ by model (answer lengths, how a model stops), so a known model may ship its
own artifact beside this module (``spend_forecast_<short name>.json``, :func:`artifact_for`);
``spend_forecast.json`` (the embedded model's runs) serves every other model unless the server is
given one (``--kvcmas-forecast-artifact``). A forecast walks the trees in pure Python: the served
package needs neither scikit-learn nor numpy for it.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ARTIFACT = Path(__file__).resolve().with_name("spend_forecast.json")
VERSION = 3
MEASURES = ("computed", "prompt")
FEATURES = ("bias", "log_turns", "log_agents", "log_last_prompt", "log_prompt_growth",
            "log_mean_completion", "log_mean_computed", "reused_fraction", "log_spent",
            "log_rounds", "agents_1", "agents_2", "agents_3", "agents_4plus", "log_in_flight",
            "log_in_flight_computed")
"""Feature names, in order (see :meth:`TrajectoryState.features`)."""
SIGNS = {"log_mean_completion": 1, "log_mean_computed": 1, "log_spent": 1,
         "reused_fraction": -1, "log_in_flight": 1, "log_in_flight_computed": 1}
"""Monotone constraints of the fit: the features that grow with the spend so far (and the reused
share, which shrinks as more is recomputed) may only push the remaining spend up."""


def artifact_for(model: str | None) -> Path:
    """The artifact shipped for the known model ``model`` (its short name), else the generic
    :data:`ARTIFACT`."""
    if model:
        own = ARTIFACT.with_name(f"spend_forecast_{model}.json")
        if own.is_file():
            return own
    return ARTIFACT


class ForecastArtifactError(ValueError):
    """The forecaster's JSON artifact is missing, malformed or of another version."""


@dataclass(frozen=True)
class TrajectoryState:
    """What a server knows of a run after some finished turns (counts in tokens, but ``turns``,
    ``agents`` (distinct) and ``in_flight``: the workflow's requests admitted and not finished
    when the latest turn finished, such as a fan-out's workers or a round's other agents)."""

    turns: int = 0
    agents: int = 0
    prompt_tokens: int = 0
    recomputed: int = 0
    completion_tokens: int = 0
    first_prompt: int = 0
    last_prompt: int = 0
    in_flight: int = 0

    @property
    def computed(self) -> int:
        """Tokens computed so far: prefill + decode."""
        return self.recomputed + self.completion_tokens

    def spent(self, measure: str) -> int:
        return self.computed if measure == "computed" else self.prompt_tokens

    def add(self, prompt_tokens: int, recomputed: int, completion_tokens: int,
            new_agent: bool, in_flight: int = 0) -> TrajectoryState:
        """The state after one more finished turn."""
        return replace(self, turns=self.turns + 1, agents=self.agents + int(new_agent),
                       prompt_tokens=self.prompt_tokens + prompt_tokens,
                       recomputed=self.recomputed + recomputed,
                       completion_tokens=self.completion_tokens + completion_tokens,
                       first_prompt=self.first_prompt if self.turns else prompt_tokens,
                       last_prompt=prompt_tokens, in_flight=max(0, in_flight))

    @classmethod
    def prefixes(cls, turns: Iterable[Mapping[str, Any]]) -> list[TrajectoryState]:
        """The state after each of ``turns`` (dicts with ``prompt_tokens``, ``recomputed``,
        ``completion_tokens``, ``agent`` and optionally ``in_flight``: the ledger's turn
        records), in finish order: element ``k - 1`` is the state after ``k`` turns."""
        states, state, seen = [], cls(), set()
        for t in turns:
            agent = t.get("agent")
            state = state.add(int(t.get("prompt_tokens", 0)), int(t.get("recomputed", 0)),
                              int(t.get("completion_tokens", 0)),
                              agent is not None and agent not in seen,
                              int(t.get("in_flight", 0) or 0))
            seen.add(agent)
            states.append(state)
        return states

    @classmethod
    def of_turns(cls, turns: Iterable[Mapping[str, Any]]) -> TrajectoryState:
        """The state after ``turns`` (see :meth:`prefixes`)."""
        states = cls.prefixes(turns)
        return states[-1] if states else cls()

    def features(self) -> list[float]:
        """The model's inputs, in :data:`FEATURES` order (logs of token counts; ``log_rounds``:
        turns per agent so far; ``agents_*``: one-hot of the agents seen, which tells the
        workflow's shape apart; ``log_in_flight``: requests still running, and that count times
        the mean computed tokens per turn so far)."""
        k = max(1, self.turns)
        growth = max(0, self.last_prompt - self.first_prompt) / k
        reused = 1.0 - self.recomputed / self.prompt_tokens if self.prompt_tokens else 0.0
        return [1.0, math.log1p(self.turns), math.log1p(self.agents),
                math.log1p(self.last_prompt), math.log1p(growth),
                math.log1p(self.completion_tokens / k), math.log1p(self.computed / k),
                reused, math.log1p(self.computed),
                math.log1p(self.turns / max(1, self.agents)),
                float(self.agents <= 1), float(self.agents == 2), float(self.agents == 3),
                float(self.agents >= 4), math.log1p(self.in_flight),
                math.log1p(self.in_flight * self.computed / k)]


@dataclass(frozen=True)
class SpendForecast:
    """One forecast of a run's total spend (tokens), made after ``at_turn`` turns.

    Attributes:
        total, low, high: total computed tokens (prefill + decode) at the end of the run: the
            point forecast and its interval (``low <= total <= high``).
        prompt_total, prompt_low, prompt_high: the same for prompt tokens read.
        at_turn: turns finished when it was made.
        spent: computed tokens so far; prompt_spent: prompt tokens read so far.
    """

    total: int
    low: int
    high: int
    prompt_total: int
    prompt_low: int
    prompt_high: int
    at_turn: int
    spent: int
    prompt_spent: int

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "low": self.low, "high": self.high,
                "at_turn": self.at_turn, "spent": self.spent,
                "prompt": {"total": self.prompt_total, "low": self.prompt_low,
                           "high": self.prompt_high, "spent": self.prompt_spent}}


@dataclass(frozen=True)
class Tree:
    """One regression tree, as arrays over its nodes (scikit-learn's ``tree_`` layout): at node
    ``i``, ``x[feature[i]] <= threshold[i]`` goes to ``left[i]``, else ``right[i]`` (-1 at a
    leaf, whose prediction is ``value[i]``)."""

    feature: tuple[int, ...]
    threshold: tuple[float, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    value: tuple[float, ...]

    def predict(self, x: Sequence[float]) -> float:
        """The leaf value ``x`` reaches (``x`` already rounded to float32, as the fit saw it)."""
        i = 0
        left, right, feature, threshold = self.left, self.right, self.feature, self.threshold
        while left[i] >= 0:
            i = left[i] if x[feature[i]] <= threshold[i] else right[i]
        return self.value[i]

    def check(self, n_features: int) -> None:
        """Raises ForecastArtifactError: arrays of different lengths, a child out of range or
        not after its parent (no cycles), a feature out of range, a non-finite number."""
        n = len(self.value)
        if n == 0 or any(len(a) != n for a in (self.feature, self.threshold, self.left,
                                                 self.right)):
            raise ForecastArtifactError("a tree's arrays differ in length")
        for i in range(n):
            kids = (self.left[i], self.right[i])
            if (kids[0] < 0) != (kids[1] < 0):
                raise ForecastArtifactError(f"node {i} has one child")
            if kids[0] >= 0 and (not all(i < k < n for k in kids)
                                 or not 0 <= self.feature[i] < n_features
                                 or not math.isfinite(self.threshold[i])):
                raise ForecastArtifactError(f"node {i} is malformed")
            if not math.isfinite(self.value[i]):
                raise ForecastArtifactError(f"node {i} has a non-finite value")

    def to_json(self) -> list[list[float]]:
        return [list(self.feature), [round(t, 6) for t in self.threshold], list(self.left),
                list(self.right), [round(v, 6) for v in self.value]]

    @classmethod
    def from_json(cls, raw: Any) -> Tree:
        feature, threshold, left, right, value = raw
        return cls(tuple(int(v) for v in feature), tuple(float(v) for v in threshold),
                   tuple(int(v) for v in left), tuple(int(v) for v in right),
                   tuple(float(v) for v in value))


@dataclass(frozen=True)
class MeasureModel:
    """The fitted model of one measure: a forest over :data:`FEATURES`.

    Attributes:
        trees: the forest; its prediction (the mean of the trees') is ``log1p(remaining)``.
        q_low, q_high: quantiles of held-out log residuals of the remaining spend
            (``q_low <= 0 <= q_high``).
    """

    trees: tuple[Tree, ...]
    q_low: float
    q_high: float

    def remaining(self, x: Sequence[float]) -> float:
        """Point forecast of the remaining spend (tokens) for features ``x``."""
        x32 = array("f", x)  # the fit saw float32 features (scikit-learn's trees do)
        z = sum(t.predict(x32) for t in self.trees) / len(self.trees)
        return math.expm1(min(max(z, 0.0), 30.0))


@dataclass(frozen=True)
class SpendForecaster:
    """A fitted forecaster: one :class:`MeasureModel` per measure, its nominal interval
    ``coverage`` (e.g. ``(0.1, 0.9)``) and a short description of the runs it was fitted on."""

    models: Mapping[str, MeasureModel]
    coverage: tuple[float, float]
    fitted_on: str = ""

    def forecast(self, state: TrajectoryState) -> SpendForecast:
        """The total spend of the run whose trajectory so far is ``state`` (>= 1 turn)."""
        x = state.features()
        out: dict[str, tuple[int, int, int]] = {}
        for measure in MEASURES:
            model, spent = self.models[measure], state.spent(measure)
            rem = model.remaining(x)
            out[measure] = (round(spent + rem), math.floor(spent + rem * math.exp(model.q_low)),
                            math.ceil(spent + rem * math.exp(model.q_high)))
        (total, low, high), (p_total, p_low, p_high) = out["computed"], out["prompt"]
        return SpendForecast(total=total, low=min(low, total), high=max(high, total),
                             prompt_total=p_total, prompt_low=min(p_low, p_total),
                             prompt_high=max(p_high, p_total), at_turn=state.turns,
                             spent=state.computed, prompt_spent=state.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "features": list(FEATURES), "coverage": list(self.coverage),
                "fitted_on": self.fitted_on,
                "models": {m: {"q_low": v.q_low, "q_high": v.q_high,
                               "trees": [t.to_json() for t in v.trees]}
                           for m, v in self.models.items()}}

    @classmethod
    def from_json(cls, data: Any) -> SpendForecaster:
        """Raises ForecastArtifactError naming what is wrong."""
        try:
            if data.get("version") != VERSION:
                raise ForecastArtifactError(f"version {data.get('version')!r}, expected "
                                            f"{VERSION}")
            if list(data["features"]) != list(FEATURES):
                raise ForecastArtifactError(f"features {data['features']} differ from "
                                            f"{list(FEATURES)}")
            models = {}
            for m in MEASURES:
                raw = data["models"][m]
                trees = tuple(Tree.from_json(t) for t in raw["trees"])
                if not trees:
                    raise ForecastArtifactError(f"model {m!r} has no trees")
                for t in trees:
                    try:
                        t.check(len(FEATURES))
                    except ForecastArtifactError as e:
                        raise ForecastArtifactError(f"model {m!r}: {e}") from None
                q_low, q_high = float(raw["q_low"]), float(raw["q_high"])
                if not (q_low <= 0.0 <= q_high) or not all(map(math.isfinite, (q_low, q_high))):
                    raise ForecastArtifactError(f"model {m!r} has bad interval quantiles")
                models[m] = MeasureModel(trees, q_low=q_low, q_high=q_high)
            lo, hi = (float(c) for c in data["coverage"])
            return cls(models, (lo, hi), str(data.get("fitted_on", "")))
        except ForecastArtifactError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ForecastArtifactError(f"malformed forecaster artifact: {e!r}") from None


def load(path: Path | None = None) -> SpendForecaster:
    """The forecaster stored at ``path`` (default: :data:`ARTIFACT`); raises
    ForecastArtifactError when it is missing, unreadable or malformed."""
    path = path or ARTIFACT
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ForecastArtifactError(f"cannot read {path}: {e}") from None
    return SpendForecaster.from_json(data)
