"""Per-workflow token accounting: what each workflow's turns read, reused and computed.

A *workflow* is the product's one identity for a multi-agent run (``kvcmas_workflow`` /
``X-KVCMAS-Workflow``, or the router's routing key). Every finished request of a workflow adds
one :class:`Turn` (its reuse record and completion tokens) to the workflow's
:class:`WorkflowTotals`. The ledger holds the ``max_workflows`` most recently active workflows
(counting the ones dropped), each with its last ``max_turns`` turns, so memory stays bounded on a
server that runs for months.

Token kinds (the reuse record's): ``reused_exact`` + ``reused_factored`` +
``reused_repositioned`` + ``recomputed`` = ``prompt_tokens``; ``computed`` = ``recomputed``
(prefill) + ``completion_tokens`` (decode), the tokens the server ran the model for.

KV bytes: ``kv_bytes_written`` is the ``computed`` tokens' KV, the pool slots the workflow's
requests filled (an upper bound on what it holds: the cache may have evicted some since), and
``kv_bytes_read`` the ``prompt_tokens``' KV its turns attended over. What a workflow *holds* is
not counted: a cached prefix is one copy that several workflows may read; the pool's occupancy is
in ``/server_info``.

A workflow also carries its spend forecast (``policy/spend_forecast.py``; a forecaster that fails
is logged and the workflow goes without), its budget (``policy/spend_budget.py``) and the
fidelity monitor's scores of its sampled turns (:meth:`WorkflowLedger.add_fidelity`). Pure
Python.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sglang_kvcmas.policy.fidelity import Tally, TurnScore
from sglang_kvcmas.policy.spend_budget import Budget, BudgetStatus
from sglang_kvcmas.policy.spend_forecast import SpendForecast, SpendForecaster, TrajectoryState

logger = logging.getLogger(__name__)

COUNTS = ("prompt_tokens", "reused_exact", "reused_factored", "reused_repositioned",
          "recomputed", "completion_tokens")


@dataclass(frozen=True)
class Turn:
    """One finished request of a workflow, at ``t`` (seconds, the ledger's clock).

    Attributes:
        in_flight: the workflow's requests still running when it finished (set by the ledger).
        kv_bytes_per_token: the server's KV bytes per pool slot (0: unknown).
    """

    t: float
    agent: str | None
    prompt_tokens: int
    reused_exact: int
    reused_factored: int
    reused_repositioned: int
    recomputed: int
    completion_tokens: int
    in_flight: int = 0
    kv_bytes_per_token: int = 0

    @classmethod
    def of_record(cls, t: float, record: dict[str, Any], completion_tokens: int) -> Turn:
        """A turn from a reuse record (``meta_info.kvcmas_reuse[0]``)."""
        return cls(t=t, agent=record.get("agent"),
                   completion_tokens=max(0, int(completion_tokens or 0)),
                   kv_bytes_per_token=max(0, int(record.get("kv_bytes_per_token", 0) or 0)),
                   **{k: int(record.get(k, 0) or 0) for k in COUNTS[:-1]})

    @property
    def computed(self) -> int:
        return self.recomputed + self.completion_tokens

    @property
    def kv_bytes_written(self) -> int:
        """KV bytes of the pool slots this turn filled (prefill + decode)."""
        return self.computed * self.kv_bytes_per_token

    @property
    def kv_bytes_read(self) -> int:
        """KV bytes of the prompt this turn attended over."""
        return self.prompt_tokens * self.kv_bytes_per_token


@dataclass
class WorkflowTotals:
    """One workflow's totals and its recent trajectory."""

    workflow: str
    first_t: float
    last_t: float
    requests: int = 0
    prompt_tokens: int = 0
    reused_exact: int = 0
    reused_factored: int = 0
    reused_repositioned: int = 0
    recomputed: int = 0
    completion_tokens: int = 0
    agents: set[str] = field(default_factory=set)
    turns: deque[Turn] = field(default_factory=deque)
    state: TrajectoryState = field(default_factory=TrajectoryState)
    forecast: SpendForecast | None = None
    budget: Budget | None = None
    in_flight: int = 0
    kv_bytes_written: int = 0
    kv_bytes_read: int = 0
    fidelity: Tally | None = None

    @property
    def computed(self) -> int:
        return self.recomputed + self.completion_tokens

    def add(self, turn: Turn, max_turns: int) -> None:
        self.state = self.state.add(turn.prompt_tokens, turn.recomputed, turn.completion_tokens,
                                    turn.agent is not None and turn.agent not in self.agents,
                                    turn.in_flight)
        self.requests += 1
        self.last_t = max(self.last_t, turn.t)
        for k in COUNTS:
            setattr(self, k, getattr(self, k) + getattr(turn, k))
        self.kv_bytes_written += turn.kv_bytes_written
        self.kv_bytes_read += turn.kv_bytes_read
        if turn.agent is not None:
            self.agents.add(turn.agent)
        self.turns.append(turn)
        while len(self.turns) > max_turns:
            self.turns.popleft()

    def to_json(self, with_turns: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"workflow": self.workflow, "requests": self.requests,
                               "agents": len(self.agents), "first_t": self.first_t,
                               "last_t": self.last_t, "computed": self.computed,
                               "in_flight": self.in_flight,
                               "kv_bytes_written": self.kv_bytes_written,
                               "kv_bytes_read": self.kv_bytes_read}
        out.update({k: getattr(self, k) for k in COUNTS})
        reused = self.reused_exact + self.reused_factored + self.reused_repositioned
        out["reused_fraction"] = reused / self.prompt_tokens if self.prompt_tokens else 0.0
        out["forecast"] = self.forecast.to_json() if self.forecast else None
        out["budget"] = ({"tokens": self.budget.tokens, "enforce": self.budget.enforce}
                         if self.budget else None)
        out["fidelity"] = self.fidelity.to_json() if self.fidelity else None
        if with_turns:
            out["turns"] = [{**asdict(t), "kv_bytes_written": t.kv_bytes_written}
                            for t in self.turns]
        return out


class WorkflowLedger:
    """The most recently active workflows' totals (see the module docstring); ``forecaster``
    updates each workflow's spend forecast per finished turn (None: no forecasts)."""

    def __init__(self, max_workflows: int = 1024, max_turns: int = 256,
                 forecaster: SpendForecaster | None = None) -> None:
        if max_workflows < 1 or max_turns < 1:
            raise ValueError("max_workflows and max_turns must be >= 1")
        self.max_workflows, self.max_turns = max_workflows, max_turns
        self.forecaster = forecaster
        self._flows: OrderedDict[str, WorkflowTotals] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._flows)

    def begin(self, workflow: str, t: float, n: int = 1) -> None:
        """``n`` requests of ``workflow`` were admitted (each ends in :meth:`add` or
        :meth:`abandon`)."""
        self._held(workflow, t).in_flight += n

    def abandon(self, workflow: str, n: int = 1) -> None:
        """``n`` admitted requests of ``workflow`` ended without finishing (aborted, failed)."""
        totals = self._flows.get(workflow)
        if totals is not None:
            totals.in_flight = max(0, totals.in_flight - n)

    def add(self, workflow: str, turn: Turn) -> WorkflowTotals:
        """One finished request: its turn joins the totals with the workflow's requests still in
        flight (those begun and not finished)."""
        totals = self._held(workflow, turn.t)
        totals.in_flight = max(0, totals.in_flight - 1)
        totals.add(replace(turn, in_flight=totals.in_flight), self.max_turns)
        if self.forecaster is not None:
            try:
                totals.forecast = self.forecaster.forecast(totals.state)
            except Exception:  # a forecast is advisory: never fail the accounting
                logger.exception("sglang-kvcmas: spend forecast failed for workflow %r",
                                 workflow)
                totals.forecast = None
        return totals

    def _held(self, workflow: str, t: float) -> WorkflowTotals:
        """The workflow's totals, created (and the oldest dropped past the limit) if new."""
        totals = self._flows.get(workflow)
        if totals is None:
            totals = self._flows[workflow] = WorkflowTotals(workflow, t, t)
            while len(self._flows) > self.max_workflows:
                self._flows.popitem(last=False)
                self.dropped += 1
        else:
            self._flows.move_to_end(workflow)
        return totals

    def add_fidelity(self, workflow: str, score: TurnScore) -> None:
        """A sampled turn of ``workflow`` checked against exact serving (the fidelity monitor;
        a workflow no longer held is not held again for it)."""
        totals = self._flows.get(workflow)
        if totals is not None:
            if totals.fidelity is None:
                totals.fidelity = Tally()
            totals.fidelity.add(score)

    def set_budget(self, workflow: str, budget: Budget, t: float) -> None:
        """Give ``workflow`` a budget (a request named it; the latest given wins)."""
        self._held(workflow, t).budget = budget

    def budget_status(self, workflow: str, default: Budget | None = None) -> BudgetStatus | None:
        """Where ``workflow`` stands against its budget (its own, else ``default``), or None
        when it has none."""
        totals = self._flows.get(workflow)
        budget = (totals.budget if totals is not None else None) or default
        if budget is None:
            return None
        return BudgetStatus(budget, totals.computed if totals else 0,
                            totals.forecast if totals else None)

    def get(self, workflow: str) -> WorkflowTotals | None:
        return self._flows.get(workflow)

    def recent(self, limit: int | None = None) -> list[WorkflowTotals]:
        """Workflows, most recently active first."""
        flows = list(reversed(self._flows.values()))
        return flows if limit is None else flows[:limit]

    def snapshot(self, limit: int | None = 100) -> dict[str, Any]:
        return {"workflows": [w.to_json() for w in self.recent(limit)],
                "held": len(self._flows), "dropped": self.dropped,
                "max_workflows": self.max_workflows}
