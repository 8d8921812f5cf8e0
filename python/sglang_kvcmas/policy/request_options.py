"""What one request asks of sglang-kvcmas: its ``custom_params.kvcmas_*`` fields, typed.

Fields (every one optional; SGLang's own ``custom_params`` keys pass through untouched):

======================================  ==========================================================
``kvcmas_agent``: str                   names the agent (with ``kvcmas_head_len``); two requests
                                        are one agent only with the same name *and* head tokens
``kvcmas_head_len``: int >= 1           tokens ``[0, head_len)`` are the agent head
``kvcmas_shared_end``: int              tokens ``[head_len, shared_end)`` are the shared
                                        transcript (default: the whole prompt)
``kvcmas_exact``: bool                  read no other agent's KV (computed exactly, as radix)
``kvcmas_read_leaves``: bool            read the agent's leaves (and keep what it recomputes
                                        as new ones) whether or not the request sets its own
                                        knobs (default: only a request that sets none does)
``kvcmas_workflow``: str                the workflow the request belongs to (also the HTTP
                                        header ``X-KVCMAS-Workflow``, or else the router's
                                        ``X-SMG-Routing-Key``); reported with its usage
``kvcmas_budget_tokens``: int >= 1      the workflow's budget in computed tokens (prefill +
                                        decode, the whole run; needs a workflow; the latest
                                        given wins): see ``policy/spend_budget.py``
``kvcmas_budget_enforce``: bool         refuse the workflow's further turns once its budget
                                        is spent or forecast to be (needs a workflow)
``kvcmas_head_first``: bool             set by the server only (``integration/head_first.py``):
                                        the agent's head is being prefilled on its own, so the
                                        request may wait to borrow (a client's is refused)
``kvcmas_fidelity_level``: int         set by the server only (``integration/fidelity_monitor.py``):
                                        the fidelity loop's level the request is served at
                                        (``policy/fidelity.py``; a client's is refused)
``kvcmas_<knob>``                       a per-request knob of ``config.ServingConfig``
                                        (``kvcmas_recompute_boundary``, ...)
======================================  ==========================================================

:meth:`RequestOptions.parse` is strict and raises :class:`RequestOptionError` naming the field;
the server calls it before a request reaches the scheduler and answers 400. The scheduler parses
again (it must never raise there) with :meth:`RequestOptions.lenient`. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_kvcmas.config import (
    BY_REQUEST_FIELD,
    REMOVED,
    ConfigError,
    Knob,
    removed_message,
)
from sglang_kvcmas.policy import tenancy

PREFIX = "kvcmas_"
AGENT_FIELD = "kvcmas_agent"
HEAD_LEN_FIELD = "kvcmas_head_len"
SHARED_END_FIELD = "kvcmas_shared_end"
EXACT_FIELD = "kvcmas_exact"
WORKFLOW_FIELD = "kvcmas_workflow"
BUDGET_TOKENS_FIELD = "kvcmas_budget_tokens"
BUDGET_ENFORCE_FIELD = "kvcmas_budget_enforce"
READ_LEAVES_FIELD = "kvcmas_read_leaves"
HEAD_FIRST_FIELD = "kvcmas_head_first"
FIDELITY_LEVEL_FIELD = "kvcmas_fidelity_level"
SERVER_ONLY_FIELDS = (HEAD_FIRST_FIELD, FIDELITY_LEVEL_FIELD)
"""Fields the HTTP process sets on requests it forwards; a client's request is refused."""
WORKFLOW_HEADER = "x-kvcmas-workflow"
"""HTTP header naming a request's workflow (routers can hash it to keep a workflow on one
server); same meaning as ``custom_params.kvcmas_workflow``."""
ROUTING_KEY_HEADER = "x-smg-routing-key"
"""The header SGLang's router places requests by (and the only one of ours it forwards): a
request without ``X-KVCMAS-Workflow`` or ``kvcmas_workflow`` takes it as its workflow."""
MAX_NAME_CHARS = 128
"""Longest agent or workflow name: names are echoed in usage and logs."""

_OWN_FIELDS = (AGENT_FIELD, HEAD_LEN_FIELD, SHARED_END_FIELD, EXACT_FIELD, WORKFLOW_FIELD,
               BUDGET_TOKENS_FIELD, BUDGET_ENFORCE_FIELD, READ_LEAVES_FIELD, HEAD_FIRST_FIELD,
               FIDELITY_LEVEL_FIELD)


class RequestOptionError(ValueError):
    """A ``kvcmas_*`` field of a request is unknown, ill-typed or out of range."""


@dataclass(frozen=True)
class RequestOptions:
    """The ``kvcmas_*`` fields of one request (the module docstring's table), None where not
    given (``head_len``: template detection decides); ``knobs``: the per-request knob overrides,
    ``(knob name, value)`` in declaration order."""

    agent: str | None = None
    head_len: int | None = None
    shared_end: int | None = None
    exact: bool = False
    workflow: str | None = None
    budget_tokens: int | None = None
    budget_enforce: bool | None = None
    knobs: tuple[tuple[str, Any], ...] = ()
    read_leaves: bool | None = None
    head_first: bool = False
    fidelity_level: int = 0

    @classmethod
    def parse(cls, custom_params: Any) -> RequestOptions:
        """Strictly parse a request's ``custom_params``; raises RequestOptionError naming the
        field (``custom_params.kvcmas_...``)."""
        if custom_params is None:
            return cls()
        if not isinstance(custom_params, Mapping):
            raise RequestOptionError(
                f"custom_params must be an object, got {type(custom_params).__name__}")
        ours = {k: v for k, v in custom_params.items() if isinstance(k, str) and
                k.startswith(PREFIX)}
        for k in ours:
            if k[len(PREFIX):] in REMOVED:
                raise RequestOptionError(removed_message(f"custom_params.{k}",
                                                         REMOVED[k[len(PREFIX):]]))
        unknown = sorted(k for k in ours if k not in _OWN_FIELDS and k not in BY_REQUEST_FIELD)
        if unknown:
            known = ", ".join(sorted((*_OWN_FIELDS, *BY_REQUEST_FIELD)))
            raise RequestOptionError(f"unknown field custom_params.{unknown[0]} (known: {known})")
        try:
            head_len = _field(ours, HEAD_LEN_FIELD, int, low=1)
            shared_end = _field(ours, SHARED_END_FIELD, int, low=1)
            exact = bool(_field(ours, EXACT_FIELD, bool))
            agent = _name(ours, AGENT_FIELD)
            workflow = _name(ours, WORKFLOW_FIELD, MAX_NAME_CHARS + tenancy.SCOPE_CHARS)
            budget_tokens = _field(ours, BUDGET_TOKENS_FIELD, int, low=1)
            budget_enforce = _field(ours, BUDGET_ENFORCE_FIELD, bool)
            read_leaves = _field(ours, READ_LEAVES_FIELD, bool)
            head_first = bool(_field(ours, HEAD_FIRST_FIELD, bool))
            fidelity_level = _field(ours, FIDELITY_LEVEL_FIELD, int, low=0) or 0
            knobs = tuple((k.name, k.parse(ours[f], f"custom_params.{f}"))
                          for f, k in BY_REQUEST_FIELD.items() if f in ours)
        except ConfigError as e:
            raise RequestOptionError(str(e)) from None
        if shared_end is not None and head_len is None:
            raise RequestOptionError(f"custom_params.{SHARED_END_FIELD} needs "
                                     f"custom_params.{HEAD_LEN_FIELD}")
        if shared_end is not None and shared_end < head_len:
            raise RequestOptionError(
                f"custom_params.{SHARED_END_FIELD}={shared_end} is before the head's end "
                f"(custom_params.{HEAD_LEN_FIELD}={head_len})")
        if agent is not None and head_len is None:
            raise RequestOptionError(f"custom_params.{AGENT_FIELD} needs "
                                     f"custom_params.{HEAD_LEN_FIELD}")
        if workflow is None and (budget_tokens is not None or budget_enforce is not None):
            name = BUDGET_TOKENS_FIELD if budget_tokens is not None else BUDGET_ENFORCE_FIELD
            raise RequestOptionError(f"custom_params.{name} needs a workflow "
                                     f"(custom_params.{WORKFLOW_FIELD} or the "
                                     f"{WORKFLOW_HEADER} header)")
        return cls(agent=agent, head_len=head_len, shared_end=shared_end, exact=exact,
                   workflow=workflow, budget_tokens=budget_tokens,
                   budget_enforce=budget_enforce, knobs=knobs, read_leaves=read_leaves,
                   head_first=head_first, fidelity_level=fidelity_level)

    @classmethod
    def lenient(cls, custom_params: Any) -> RequestOptions | None:
        """:meth:`parse`, or None when it would raise (the scheduler then serves the request
        without sharing; the server has already answered such requests with 400)."""
        try:
            return cls.parse(custom_params)
        except RequestOptionError:
            return None

    def check_prompt(self, num_tokens: int) -> None:
        """Raises RequestOptionError when the explicit head or shared end lies past the prompt's
        ``num_tokens``."""
        if self.head_len is not None and self.head_len > num_tokens:
            raise RequestOptionError(
                f"custom_params.{HEAD_LEN_FIELD}={self.head_len} is past the prompt's end "
                f"({num_tokens} tokens)")
        if self.shared_end is not None and self.shared_end > num_tokens:
            raise RequestOptionError(
                f"custom_params.{SHARED_END_FIELD}={self.shared_end} is past the prompt's end "
                f"({num_tokens} tokens)")

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.knobs)

    @property
    def reads_leaves(self) -> bool:
        """Whether the request reads its agent's leaves: as asked, else unless it sets its own
        knobs (a request that does measures the owner's KV under them)."""
        return self.read_leaves if self.read_leaves is not None else not self.knobs


def _field(ours: Mapping[str, Any], name: str, kind: type, low: int | None = None) -> Any:
    if name not in ours:
        return None
    return Knob(name, kind, None, "", low=low).parse(ours[name], f"custom_params.{name}")


def workflow_from_headers(headers: Mapping[str, Any] | None) -> tuple[str | None, bool]:
    """The workflow an HTTP request's headers name, and whether it was named by our own header.

    ``X-KVCMAS-Workflow`` wins (taken as given; :meth:`RequestOptions.parse` checks it); else the
    router's ``X-SMG-Routing-Key`` when it is a valid name (a key that is not one is the router's
    business, never an error of the request: it is ignored).
    """
    if headers is None:
        return None, False
    ours = headers.get(WORKFLOW_HEADER)
    if ours is not None:
        return ours, True
    key = headers.get(ROUTING_KEY_HEADER)
    if isinstance(key, str) and 0 < len(key) <= MAX_NAME_CHARS and key.isprintable():
        return key, False
    return None, False


def _name(ours: Mapping[str, Any], name: str, limit: int = MAX_NAME_CHARS) -> str | None:
    value = _field(ours, name, str)
    if value is None:
        return None
    check_name(name, value, limit)
    return value


def check_name(name: str, value: str, limit: int = MAX_NAME_CHARS) -> None:
    """Raises :class:`RequestOptionError` unless ``value`` is 1 to ``limit`` printable
    characters (a workflow's name as scoped by its tenant may take
    :data:`~sglang_kvcmas.policy.tenancy.SCOPE_CHARS` more than a client's)."""
    if not value or len(value) > limit or not value.isprintable():
        raise RequestOptionError(
            f"custom_params.{name} must be 1-{limit} printable characters, got "
            f"{len(value)} characters")
