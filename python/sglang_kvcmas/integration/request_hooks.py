"""Requests checked and labelled where they enter SGLang, before they reach the scheduler.

Two hooks on SGLang's tokenizer manager (the HTTP process), so a bad ``kvcmas_*`` field is
answered with a 400 that names it and never reaches the scheduler, whose loop must not raise:

- AROUND ``TokenizerManager.generate_request``: the request is scoped to its credential's tenant
  (``policy/tenancy.py``); the ``X-KVCMAS-Workflow`` header becomes
  ``custom_params.kvcmas_workflow`` of every prompt (a body that names another workflow is an
  error); without it, the router's ``X-SMG-Routing-Key`` names the workflow of prompts whose
  body names none (the router forwards that header and drops ours); every prompt's
  ``custom_params`` is parsed strictly (``RequestOptions.parse``), and SGLang turns the
  ``ValueError`` into a 400. The request then passes through the per-workflow ledger
  (``workflow_accounting.py``), the fidelity monitor (``fidelity_monitor.py``), the head
  prefill (``head_first.py``) and the stream's reuse collection (``usage_stream.py``).
- AROUND ``TokenizerManager._validate_one_request``: with the prompt's token ids known, an
  explicit head or shared end past the prompt is refused the same way.

SGLang's own ``custom_params`` keys pass through untouched.
"""

from __future__ import annotations

from typing import Any

from sglang_kvcmas.integration import (
    fidelity_monitor,
    head_first,
    usage_stream,
    workflow_accounting,
)
from sglang_kvcmas.policy import tenancy
from sglang_kvcmas.policy.request_options import (
    SERVER_ONLY_FIELDS,
    WORKFLOW_FIELD,
    WORKFLOW_HEADER,
    RequestOptionError,
    RequestOptions,
    check_name,
    workflow_from_headers,
)

GENERATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def _sampling_dicts(obj: Any, create: bool) -> list[dict]:
    """The request's sampling-params dicts (one per prompt); one is created where absent when
    ``create`` (a header must be applied)."""
    params = getattr(obj, "sampling_params", None)
    if params is None and create and hasattr(obj, "sampling_params"):
        params = obj.sampling_params = {}
    if isinstance(params, dict):
        return [params]
    if isinstance(params, list):
        return [p for p in params if isinstance(p, dict)]
    return []


def label_and_check(obj: Any, headers: Any) -> list[RequestOptions]:
    r"""Scope the request by its credential's tenant (``policy/tenancy.py``), apply the
    workflow header (ours, else the gateway's routing key), then parse every prompt's
    ``kvcmas_*`` fields; returns them, one per prompt.

    Raises:
        RequestOptionError, TenancyError: (``ValueError``\ s) naming the field.
    """
    tenant = tenancy.tenant_of(headers)
    tenancy.scope_request(obj, tenant)
    workflow, ours = workflow_from_headers(headers)
    parsed = []
    for params in _sampling_dicts(obj, create=workflow is not None):
        custom = params.get("custom_params")
        for name in SERVER_ONLY_FIELDS:
            if isinstance(custom, dict) and name in custom:
                raise RequestOptionError(f"custom_params.{name} is set by the server only")
        if workflow is not None:
            if custom is None:
                custom = params["custom_params"] = {}
            if isinstance(custom, dict):
                given = custom.get(WORKFLOW_FIELD)
                if given is not None and given != workflow and ours:
                    raise RequestOptionError(
                        f"custom_params.{WORKFLOW_FIELD}={given!r} disagrees with the "
                        f"{WORKFLOW_HEADER} header ({workflow!r})")
                if given is None:  # a body's own name wins over the router's key
                    custom[WORKFLOW_FIELD] = workflow
        if isinstance(custom, dict) and isinstance(custom.get(WORKFLOW_FIELD), str):
            check_name(WORKFLOW_FIELD, custom[WORKFLOW_FIELD])
            custom[WORKFLOW_FIELD] = tenancy.scoped_workflow(tenant, custom[WORKFLOW_FIELD])
        parsed.append(RequestOptions.parse(custom))
    return parsed


def generate_around(original: Any, manager: Any, obj: Any, request: Any = None, *args: Any,
                    **kwargs: Any) -> Any:
    """AROUND hook for ``TokenizerManager.generate_request`` (an async generator function):
    raises before the generator exists, so SGLang's callers answer 400."""
    options = label_and_check(obj, getattr(request, "headers", None))
    workflow_accounting.admit_options(options)  # budgets: recorded, and enforced (a 400)
    ticket = fidelity_monitor.before_request(obj, options)
    head_first.before_request(original, manager, obj, options)
    outputs = original(manager, obj, request, *args, **kwargs)
    outputs = fidelity_monitor.watching(outputs, ticket, original, manager)
    workflows = [opts.workflow if opts is not None else None for opts in options]
    return usage_stream.collecting(workflow_accounting.observing(outputs, workflows))


def validate_around(original: Any, manager: Any, obj: Any, input_ids: Any, *args: Any,
                    **kwargs: Any) -> Any:
    """AROUND hook for ``TokenizerManager._validate_one_request(obj, input_ids)``."""
    result = original(manager, obj, input_ids, *args, **kwargs)
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict) and input_ids is not None:
        RequestOptions.parse(params.get("custom_params")).check_prompt(len(input_ids))
    return result
