"""Per-request reuse accounting: exact, corrected and recomputed prompt tokens.

Reported three ways:

- ``meta_info["kvcmas_reuse"] = [{...}]`` on every response (SGLang's per-request customized
  info channel: the record is attached to the scheduler's ``Req`` and travels with its output);
- ``usage.prompt_tokens_details`` of OpenAI responses gains ``kvcmas_reused_exact``,
  ``kvcmas_reused_corrected``, ``kvcmas_recomputed`` (see :func:`add_reuse_to_usage`);
- Prometheus counters ``kvcmas:prompt_tokens_total{kind="exact"|"corrected"|"recomputed"}`` beside
  SGLang's own ``sglang:`` metrics (multiprocess mode: any process's counters reach ``/metrics``).

A request that was never accounted has no record: an absent value never reads as zero.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

META_KEY = "kvcmas_reuse"


@dataclass(frozen=True)
class ReuseRecord:
    """How one request's prompt was served.

    Attributes:
        agent: agent id, or None for a request without an agent head.
        prompt_tokens: prompt length.
        reused_exact: tokens read from KV computed exactly in this request's own context.
        reused_corrected: tokens read from another agent's KV, re-positioned (and corrected by a
            delta when ``correction`` is not ``"none"``).
        recomputed: tokens prefilled by this request.
        correction: correction method applied to ``reused_corrected`` (``"none"`` = naive reuse).
    """

    agent: str | None
    prompt_tokens: int
    reused_exact: int
    reused_corrected: int
    recomputed: int
    correction: str = "none"

    def __post_init__(self) -> None:
        if self.reused_exact + self.reused_corrected + self.recomputed != self.prompt_tokens:
            raise ValueError(f"reuse counts do not add up: {self}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_COUNTER = None


def _counter():
    global _COUNTER
    if _COUNTER is None:
        try:
            from prometheus_client import Counter
        except ImportError:  # metrics are optional, like SGLang's --enable-metrics
            _COUNTER = False
            return None
        _COUNTER = Counter(
            "kvcmas:prompt_tokens",
            "Prompt tokens by how sglang-kvcmas served them (exact reuse, corrected reuse, "
            "recomputed).",
            ["kind"],
        )
    return _COUNTER or None


def attach(req: Any, record: ReuseRecord) -> None:
    """Attach ``record`` to a scheduler ``Req`` (meta_info) and count it (Prometheus)."""
    info = req.customized_info if isinstance(getattr(req, "customized_info", None), dict) else {}
    info[META_KEY] = [record.to_json()]
    req.customized_info = info
    counter = _counter()
    if counter is not None:
        counter.labels(kind="exact").inc(record.reused_exact)
        counter.labels(kind="corrected").inc(record.reused_corrected)
        counter.labels(kind="recomputed").inc(record.recomputed)


def records_of(responses: list[dict]) -> list[dict] | None:
    """The reuse records of a list of ``/generate``-style outputs, or None if any lacks one."""
    out = []
    for r in responses:
        rec = (r.get("meta_info") or {}).get(META_KEY)
        if not rec:
            return None
        out.append(rec[0] if isinstance(rec, list) else rec)
    return out


def add_reuse_to_usage(usage: Any, responses: list[dict], n_choices: int = 1) -> Any:
    """Add our three counts to ``usage.prompt_tokens_details`` (creating it, with
    ``cached_tokens`` = exact + corrected, when SGLang did not)."""
    records = records_of([responses[i] for i in range(0, len(responses), n_choices)])
    if usage is None or records is None:
        return usage
    from sglang.srt.entrypoints.openai.protocol import PromptTokensDetails

    details = usage.prompt_tokens_details
    if details is None:
        cached = sum(r["reused_exact"] + r["reused_corrected"] for r in records)
        details = PromptTokensDetails(cached_tokens=cached)
    extra = {
        "kvcmas_reused_exact": sum(r["reused_exact"] for r in records),
        "kvcmas_reused_corrected": sum(r["reused_corrected"] for r in records),
        "kvcmas_recomputed": sum(r["recomputed"] for r in records),
        "kvcmas_correction": records[0]["correction"],
    }
    usage.prompt_tokens_details = _details_with(details, extra)
    return usage


_DETAILS_CLS = None


def _details_with(details: Any, extra: dict[str, Any]) -> Any:
    """A ``PromptTokensDetails`` that also serializes ``extra`` (a subclass allowing extras)."""
    global _DETAILS_CLS
    if _DETAILS_CLS is None:
        from sglang.srt.entrypoints.openai.protocol import PromptTokensDetails

        class KvcmasPromptTokensDetails(PromptTokensDetails):
            model_config = {"extra": "allow"}

        _DETAILS_CLS = KvcmasPromptTokensDetails
    return _DETAILS_CLS(**details.model_dump(), **extra)


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
