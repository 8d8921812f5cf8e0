"""A workflow's token budget: where its spend and forecast stand against it, and when to refuse.

The budget is in *computed* tokens (prefill + decode, ``policy/spend_forecast.py``), set per
workflow by a request (``custom_params.kvcmas_budget_tokens``, the latest given wins) or for every
workflow by the server knob ``--kvcmas-budget-tokens``. Against it, after each finished turn:

- ``exceeded``: the spend so far is at or past the budget;
- ``forecast_exceeded``: the forecast total of the run is past the budget.

Every response of a workflow with a budget reports both in its usage
(``prompt_tokens_details.kvcmas_budget_*``, :meth:`BudgetStatus.usage_fields`). With ``enforce``
(``kvcmas_budget_enforce`` / ``--kvcmas-budget-enforce``) a new turn is refused (400, naming the
workflow, its spend and forecast) once the spend is at the budget or even the forecast's *low*
end is past it (the run would exceed it however it goes). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kvcmas.policy.spend_forecast import SpendForecast


class BudgetExceeded(ValueError):
    """A turn of a workflow whose budget is spent, or forecast to be, under enforcement (a
    ``ValueError``: SGLang answers it with a 400)."""


@dataclass(frozen=True)
class Budget:
    """A workflow's budget.

    Attributes:
        tokens: computed tokens (prefill + decode) the whole run may spend (>= 1).
        enforce: refuse further turns once it is spent or forecast to be.
    """

    tokens: int
    enforce: bool = False

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"a budget must be >= 1 token, got {self.tokens}")


@dataclass(frozen=True)
class BudgetStatus:
    """Where one workflow stands against its budget (tokens).

    Attributes:
        budget: the budget.
        spent: computed tokens so far.
        forecast: the forecast of the run's total spend, or None (no forecaster, no turn yet).
    """

    budget: Budget
    spent: int
    forecast: SpendForecast | None

    @property
    def exceeded(self) -> bool:
        return self.spent >= self.budget.tokens

    @property
    def forecast_exceeded(self) -> bool:
        return self.forecast is not None and self.forecast.total > self.budget.tokens

    @property
    def refuses(self) -> bool:
        """Whether a new turn is refused: enforced, and spent or surely going to be."""
        return self.budget.enforce and (self.exceeded or (
            self.forecast is not None and self.forecast.low > self.budget.tokens))

    def usage_fields(self) -> dict[str, Any]:
        """The ``prompt_tokens_details.kvcmas_budget_*`` fields of a response."""
        f = self.forecast
        return {"kvcmas_budget_tokens": self.budget.tokens, "kvcmas_budget_spent": self.spent,
                "kvcmas_budget_forecast": f.total if f else None,
                "kvcmas_budget_forecast_low": f.low if f else None,
                "kvcmas_budget_forecast_high": f.high if f else None,
                "kvcmas_budget_exceeded": self.exceeded,
                "kvcmas_budget_forecast_exceeded": self.forecast_exceeded,
                "kvcmas_budget_enforce": self.budget.enforce}

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.budget.tokens, "enforce": self.budget.enforce,
                "spent": self.spent, "exceeded": self.exceeded,
                "forecast_exceeded": self.forecast_exceeded}

    def refusal(self, workflow: str) -> BudgetExceeded:
        """The error a refused turn is answered with."""
        f = self.forecast
        why = (f"has spent {self.spent} computed tokens" if self.exceeded else
               f"is forecast to spend {f.total} computed tokens (at least {f.low})")
        told = f"; forecast {f.total} [{f.low}, {f.high}] after {f.at_turn} turns" if f else ""
        return BudgetExceeded(
            f"workflow {workflow!r} {why}, past its budget of {self.budget.tokens} "
            f"(kvcmas_budget_tokens, enforced): further turns are refused (spent "
            f"{self.spent}{told})")
