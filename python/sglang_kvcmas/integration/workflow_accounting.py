"""Per-workflow accounting in the HTTP process: a route and Prometheus counters.

Every response passes through the tokenizer manager's ``generate_request`` (our AROUND hook,
``request_hooks.generate_around``); :func:`observing` wraps its output generator and adds each
finished request that names a workflow (``kvcmas_workflow``, the ``X-KVCMAS-Workflow`` header or
the router's routing key) to one :class:`~sglang_kvcmas.policy.workflow_ledger.WorkflowLedger`:

- ``GET /kvcmas/workflows?limit=N``: the most recently active workflows' totals (the ledger's
  counts, requests in flight, the spend forecast and the budget);
- ``GET /kvcmas/workflows/{workflow}``: one workflow with its recent turns; 404 for a workflow the
  ledger does not hold;
- Prometheus ``kvcmas:workflow_tokens_total{workflow, kind}`` (``kind``: ``prompt``, ``exact``,
  ``factored``, ``repositioned``, ``recomputed``, ``completion``) and
  ``kvcmas:workflow_kv_bytes_total{workflow, kind}`` (``written``, ``read``), with at most
  ``METRIC_WORKFLOWS`` workflow label values per server process: later workflows are counted
  under ``workflow="_other"``, so the series count stays bounded.

Each finished turn also updates the workflow's spend forecast (``policy/spend_forecast.py``, its
artifact loaded once; missing or bad: a log line and no forecasts). A workflow with a budget
(``policy/spend_budget.py``) gets a ``budget`` entry in each finished request's reuse record,
which ``reuse_accounting.usage_fields`` turns into ``prompt_tokens_details.kvcmas_budget_*``;
under enforcement :func:`admit` refuses its further turns. Once the fidelity monitor has scored a
turn of the workflow, its scores ride the same way as ``kvcmas_fidelity_*``.

Requests without a workflow are not in the ledger (SGLang's own metrics count them). Accounting
never fails a response: an error here is logged and the output passes on unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.reuse_accounting import BUDGET_KEY, FIDELITY_KEY, META_KEY
from sglang_kvcmas.policy import spend_forecast
from sglang_kvcmas.policy.request_options import RequestOptions
from sglang_kvcmas.policy.spend_budget import Budget
from sglang_kvcmas.policy.workflow_ledger import Turn, WorkflowLedger

logger = logging.getLogger(__name__)

ROUTE = "/kvcmas/workflows"
METRIC_WORKFLOWS = 64
OTHER = "_other"
KIND_FIELDS = {"prompt": "prompt_tokens", "exact": "reused_exact",
               "factored": "reused_factored", "repositioned": "reused_repositioned",
               "recomputed": "recomputed", "completion": "completion_tokens"}


def load_forecaster(path: Any = None) -> spend_forecast.SpendForecaster | None:
    """The spend forecaster from its artifact (default: the ``--kvcmas-forecast-artifact`` the
    launcher chose, else the generic one), or None (logged) when it is missing or bad."""
    if path is None:
        from sglang_kvcmas.config import knob

        path = os.environ.get(knob("forecast_artifact").env) or None
    try:
        return spend_forecast.load(path)
    except spend_forecast.ForecastArtifactError as e:
        logger.warning("sglang-kvcmas: no workflow spend forecasts: %s", e)
        return None


LEDGER = WorkflowLedger(forecaster=load_forecaster())
_labelled: set[str] = set()
_DEFAULT_BUDGET: list[Budget | None] = []


def default_budget() -> Budget | None:
    """The server's budget for workflows that give none (``--kvcmas-budget-tokens``, read from
    the environment once), or None."""
    if not _DEFAULT_BUDGET:
        from sglang_kvcmas.config import ServingConfig

        cfg = ServingConfig.from_env()
        _DEFAULT_BUDGET.append(Budget(cfg.budget_tokens, cfg.budget_enforce)
                               if cfg.budget_tokens is not None else None)
    return _DEFAULT_BUDGET[0]


def admit(obj: Any, now: float | None = None) -> None:
    """:func:`admit_options` of the options ``obj``'s prompts give (parsed here)."""
    params = getattr(obj, "sampling_params", None)
    admit_options([RequestOptions.lenient(p.get("custom_params"))
                   for p in (params if isinstance(params, list) else [params])
                   if isinstance(p, dict)], now)


def admit_options(options: list[RequestOptions | None], now: float | None = None) -> None:
    """Before a request is served: record the budgets its prompts' options give their
    workflows, then refuse it when a workflow it names is past an enforced budget.

    Raises:
        BudgetExceeded: (a ``ValueError``: SGLang answers 400) naming the workflow, its spend
            and forecast.
    """
    for opts in options:
        if opts is None or opts.workflow is None:
            continue
        default = default_budget()
        if opts.budget_tokens is not None or opts.budget_enforce is not None:
            held = LEDGER.get(opts.workflow)
            base = (held.budget if held is not None else None) or default
            tokens = opts.budget_tokens or (base.tokens if base else None)
            if tokens is not None:
                enforce = opts.budget_enforce if opts.budget_enforce is not None else \
                    bool(base and base.enforce)
                LEDGER.set_budget(opts.workflow, Budget(tokens, enforce),
                                  time.time() if now is None else now)
        status = LEDGER.budget_status(opts.workflow, default)
        if status is not None and status.refuses:
            raise status.refusal(opts.workflow)


def _counter() -> Any:
    return metrics.counter("kvcmas:workflow_tokens",
                           "Tokens per workflow by how sglang-kvcmas served them (prompt, "
                           "exact / factored / re-positioned reuse, recomputed, completion).",
                           ["workflow", "kind"])


def _kv_counter() -> Any:
    return metrics.counter("kvcmas:workflow_kv_bytes",
                           "KV bytes per workflow: written (the pool slots its prefill and "
                           "decode filled) and read (the prompts its turns attended over).",
                           ["workflow", "kind"])


def metric_label(workflow: str) -> str:
    """The workflow's label value: itself for the first ``METRIC_WORKFLOWS`` workflows seen,
    ``_other`` after."""
    if workflow in _labelled:
        return workflow
    if len(_labelled) < METRIC_WORKFLOWS:
        _labelled.add(workflow)
        return workflow
    return OTHER


def observe(out: Any, now: float | None = None) -> list[str]:
    """Add one generator output to the ledger when it is a finished request of a workflow;
    returns the workflows of the requests it finished."""
    finished = []
    for item in out if isinstance(out, list) else (out,):
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info") or {}
        if meta.get("finish_reason") is None:
            continue  # a stream's intermediate chunk
        rec = meta.get(META_KEY)
        rec = rec[0] if isinstance(rec, list) and rec else rec
        if not isinstance(rec, dict) or not rec.get("workflow"):
            continue
        workflow = rec["workflow"]
        turn = Turn.of_record(time.time() if now is None else now, rec,
                              meta.get("completion_tokens", 0))
        LEDGER.add(workflow, turn)
        finished.append(workflow)
        status = LEDGER.budget_status(workflow, default_budget())
        if status is not None:
            rec[BUDGET_KEY] = status.usage_fields()
        tally = LEDGER.get(workflow).fidelity
        if tally is not None:
            rec[FIDELITY_KEY] = {f"kvcmas_fidelity_{k}": v for k, v in tally.to_json().items()}
        counter, kv = _counter(), _kv_counter()
        label = metric_label(workflow)
        if counter is not None:
            for kind, name in KIND_FIELDS.items():
                if (value := getattr(turn, name)) > 0:
                    counter.labels(workflow=label, kind=kind).inc(value)
        if kv is not None:
            for kind, value in (("written", turn.kv_bytes_written),
                                ("read", turn.kv_bytes_read)):
                if value > 0:
                    kv.labels(workflow=label, kind=kind).inc(value)
    return finished


def observing(outputs: Any, workflows: Sequence[str | None] = ()) -> Any:
    """``outputs`` (an async generator of the tokenizer manager) with each output observed.

    ``workflows``: the workflow of each of the request's prompts (None: none). They are counted
    in flight from now until each finishes; those still unfinished when the generator ends
    (aborted, failed) are taken out of flight then."""
    if not hasattr(outputs, "__aiter__"):
        return outputs
    begun = Counter(w for w in workflows if w)
    for w, n in begun.items():
        LEDGER.begin(w, time.time(), n)
    return _observe(outputs, begun)


async def _observe(outputs: AsyncIterator[Any], begun: Counter) -> AsyncIterator[Any]:
    try:
        async for out in outputs:
            try:
                begun.subtract(observe(out))
            except Exception:  # accounting must never fail a response
                logger.exception("sglang-kvcmas: could not account a workflow's request")
            yield out
    finally:
        for w, n in begun.items():
            if n > 0:
                LEDGER.abandon(w, n)


def add_routes(app: Any) -> None:
    """Add the ledger's routes to SGLang's FastAPI ``app`` (once)."""
    if any(getattr(r, "path", None) == ROUTE for r in getattr(app, "routes", ())):
        return
    from fastapi.responses import JSONResponse

    async def workflows(limit: int = 100) -> Any:
        return JSONResponse(LEDGER.snapshot(limit=max(1, min(limit, LEDGER.max_workflows))))

    async def workflow(workflow: str) -> Any:
        totals = LEDGER.get(workflow)
        if totals is None:
            return JSONResponse({"error": f"no workflow {workflow!r} in the ledger (it holds "
                                          f"the {LEDGER.max_workflows} most recent)"},
                                status_code=404)
        return JSONResponse(totals.to_json(with_turns=True))

    app.add_api_route(ROUTE, workflows, methods=["GET"])
    app.add_api_route(ROUTE + "/{workflow}", workflow, methods=["GET"])
