"""Per-request reuse accounting: how each prompt token was served.

Every prompt token is counted once, in one of four kinds:

- ``reused_exact``: read from KV computed in the request's own context (its radix path, or its
  agent's exact leaves on shared nodes: ``exact_from_leaves`` of them);
- ``reused_factored``: read from another agent's KV, re-positioned, plus the deviation the
  reader agent keeps of that token in its factored leaves (0 under leaf mode ``exact``);
- ``reused_repositioned``: read from another agent's KV, re-positioned to the reader's positions
  only;
- ``recomputed``: prefilled by this request (``recomputed_borrowed`` of them were available
  borrowed and recomputed in the request's own context).

Reported three ways, with the same fields:

- ``meta_info["kvcmas_reuse"] = [{...}]`` on every ``/generate`` response (SGLang's per-request
  customized info channel: the record is attached to the scheduler's ``Req``);
- ``usage.prompt_tokens_details.kvcmas_<field>`` of OpenAI responses, streamed
  (``stream_options.include_usage``) and not (:func:`add_reuse_to_usage`,
  ``usage_stream.py``);
- Prometheus counters ``kvcmas:prompt_tokens_total{kind="exact"|"factored"|"repositioned"|
  "recomputed"}`` beside SGLang's own ``sglang:`` metrics.

A request that was never accounted has no record: an absent value never reads as zero.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from sglang_kvcmas.integration import metrics

logger = logging.getLogger(__name__)

META_KEY = "kvcmas_reuse"
BUDGET_KEY = "budget"
"""A record's entry with its workflow's budget fields (``kvcmas_budget_*``), added in the HTTP
process when the workflow has a budget (``workflow_accounting.observe``)."""
FIDELITY_KEY = "fidelity"
"""A record's entry with its workflow's fidelity fields so far (``kvcmas_fidelity_*``), added in
the HTTP process once the monitor has sampled a turn of the workflow."""


@dataclass(frozen=True)
class ReuseRecord:
    """How one request's prompt was served (see the module docstring for each kind).

    Attributes:
        agent: agent id, or None for a request without an agent head.
        workflow: the request's workflow (``kvcmas_workflow`` / ``X-KVCMAS-Workflow``), or None.
        prompt_tokens: prompt length = the four kinds added up.
        kv_bytes_per_token: KV bytes one pool slot holds in this server (all layers, K and V;
            0 when unknown), so the HTTP process can turn token counts into bytes.
    """

    agent: str | None
    workflow: str | None
    prompt_tokens: int
    reused_exact: int
    reused_factored: int
    reused_repositioned: int
    recomputed: int
    recomputed_borrowed: int = 0
    exact_from_leaves: int = 0
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        kinds = (self.reused_exact, self.reused_factored, self.reused_repositioned,
                 self.recomputed)
        if sum(kinds) != self.prompt_tokens or min(kinds) < 0 or not (
                0 <= self.recomputed_borrowed <= self.recomputed
                and 0 <= self.exact_from_leaves <= self.reused_exact):
            raise ValueError(f"reuse counts do not add up: {self}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


COUNTED = ("reused_exact", "reused_factored", "reused_repositioned", "recomputed",
           "recomputed_borrowed", "exact_from_leaves")
"""The record's token counts, each reported in usage as ``kvcmas_<name>`` (summed over
prompts)."""
KINDS = {"exact": "reused_exact", "factored": "reused_factored",
         "repositioned": "reused_repositioned", "recomputed": "recomputed"}
"""Prometheus ``kind`` label -> record field."""


def _counter():
    return metrics.counter(
        "kvcmas:prompt_tokens",
        "Prompt tokens by how sglang-kvcmas served them (exact reuse, factored reuse, "
        "re-positioned reuse, recomputed).",
        ["kind"],
    )


def attach(req: Any, record: ReuseRecord) -> None:
    """Attach ``record`` to a scheduler ``Req`` (meta_info) and count it (Prometheus)."""
    info = req.customized_info if isinstance(getattr(req, "customized_info", None), dict) else {}
    info[META_KEY] = [record.to_json()]
    req.customized_info = info
    counter = _counter()
    if counter is not None:
        for kind, name in KINDS.items():
            counter.labels(kind=kind).inc(getattr(record, name))


STREAMER_TARGET = (
    "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class")
_STREAMERS: dict[type, type] = {}


def request_level_streamer(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook for ``Scheduler.get_output_streamer_class``: the scheduler's output streamer
    class, with our record (``meta_info.kvcmas_reuse``) emitted once per request rather than
    sliced per output token, so that a request that generates no token (``max_new_tokens=0``:
    scoring, a frontend ``select``) still reports how its prompt was served."""
    if not isinstance(result, type):
        return result
    if result not in _STREAMERS:
        base_check = result.is_request_level_customized_info_key

        def is_request_level_customized_info_key(self: Any, key: str) -> bool:
            return key == META_KEY or base_check(self, key)

        _STREAMERS[result] = type(f"Kvcmas{result.__name__}", (result,), {
            "__slots__": (),
            "is_request_level_customized_info_key": is_request_level_customized_info_key})
    return _STREAMERS[result]


def records_of(responses: list[dict]) -> list[dict] | None:
    """The reuse records of a list of ``/generate``-style outputs, or None if any lacks one."""
    out = []
    for r in responses:
        rec = (r.get("meta_info") or {}).get(META_KEY)
        if not rec:
            return None
        out.append(rec[0] if isinstance(rec, list) else rec)
    return out


def cached_tokens(records: list[dict]) -> int:
    """Prompt tokens read from any cache (exact, factored or re-positioned), over ``records``:
    ``cached_tokens`` when SGLang reported none."""
    return sum(r["reused_exact"] + r["reused_factored"] + r["reused_repositioned"]
               for r in records)


def usage_fields(records: list[dict]) -> dict[str, Any]:
    """``prompt_tokens_details`` fields for the records of one response (one per prompt)."""
    out: dict[str, Any] = {f"kvcmas_{name}": sum(r.get(name, 0) for r in records)
                           for name in COUNTED}
    out["kvcmas_workflow"] = records[0].get("workflow") if records else None
    for key in (BUDGET_KEY, FIDELITY_KEY):
        extra = records[-1].get(key) if records else None
        if isinstance(extra, dict):
            out.update(extra)
    return out


def add_reuse_to_usage(usage: Any, responses: list[dict], n_choices: int = 1) -> Any:
    """Add our fields to ``usage.prompt_tokens_details`` (creating it, with ``cached_tokens`` =
    every reused token, when SGLang did not)."""
    records = records_of([responses[i] for i in range(0, len(responses), n_choices)])
    if usage is None or records is None:
        return usage
    from sglang.srt.entrypoints.openai.protocol import PromptTokensDetails

    details = usage.prompt_tokens_details
    if details is None:
        details = PromptTokensDetails(cached_tokens=cached_tokens(records))
    usage.prompt_tokens_details = _details_cls()(**details.model_dump(), **usage_fields(records))
    return usage


_DETAILS_CLS = None


def _details_cls() -> type:
    """``PromptTokensDetails`` that also serializes extra fields (ours), made once."""
    global _DETAILS_CLS
    if _DETAILS_CLS is None:
        from sglang.srt.entrypoints.openai.protocol import PromptTokensDetails

        class KvcmasPromptTokensDetails(PromptTokensDetails):
            model_config = {"extra": "allow"}

        _DETAILS_CLS = KvcmasPromptTokensDetails
    return _DETAILS_CLS


def usage_hook(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook for ``UsageProcessor.calculate_response_usage(responses, n_choices, ...)``."""
    responses = args[0] if args else kwargs.get("responses")
    n_choices = args[1] if len(args) > 1 else kwargs.get("n_choices", 1)
    try:
        return add_reuse_to_usage(result, list(responses or []), n_choices or 1)
    except Exception:  # accounting must never fail a response
        logger.exception("sglang-kvcmas: could not add reuse accounting to usage")
        return result


JSON_RESPONSE_TARGET = "sglang.srt.entrypoints.http_server.model_json_response"


def json_response_around(original: Any, content: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for the HTTP server's ``model_json_response``: pydantic serializes a field by
    its declared type, which would drop our ``prompt_tokens_details`` fields; responses that carry
    them are serialized with ``serialize_as_any``. Every other response is left to SGLang."""
    usage = getattr(content, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None)
    if _DETAILS_CLS is None or not isinstance(details, _DETAILS_CLS):
        return original(content, *args, **kwargs)
    from starlette.responses import Response

    return Response(content=content.model_dump_json(by_alias=True, serialize_as_any=True),
                    media_type="application/json")
