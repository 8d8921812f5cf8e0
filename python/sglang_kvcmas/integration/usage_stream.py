"""Reuse accounting in the usage chunk of streamed OpenAI responses.

A streamed chat or completion (``stream_options.include_usage``) ends with a usage chunk that
SGLang builds from per-prompt counts alone and serializes itself, so neither the reuse records
nor our ``prompt_tokens_details`` fields would reach it. Two AROUND hooks bring them:

- on ``OpenAIServingChat._generate_chat_stream`` / ``OpenAIServingCompletion.
  _generate_completion_stream``: the stream runs with a fresh record table in a context
  variable; its usage chunk (a ``data:`` line with ``usage`` and no choices) is re-written with
  :func:`reuse_accounting.usage_fields` of the records, the same fields a non-streamed
  response carries;
- :func:`collecting` (called by ``request_hooks.generate_around``) copies each output's
  ``meta_info.kvcmas_reuse`` into that table, by choice index.

Each streamed response is served by its own task, so the context variable is per response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from sglang_kvcmas.integration.reuse_accounting import META_KEY, cached_tokens, usage_fields

logger = logging.getLogger(__name__)

CHAT_TARGET = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream"
COMPLETION_TARGET = ("sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion."
                     "_generate_completion_stream")

_RECORDS: ContextVar[dict[int, dict] | None] = ContextVar("kvcmas_stream_records", default=None)


def collecting(outputs: Any) -> Any:
    """``outputs`` (the tokenizer manager's async generator), copying reuse records into the
    current stream's table; unchanged when no stream is collecting."""
    records = _RECORDS.get()
    if records is None:
        return outputs
    return _collect(outputs, records)


async def _collect(outputs: AsyncIterator[Any], records: dict[int, dict]) -> AsyncIterator[Any]:
    async for out in outputs:
        if isinstance(out, dict):
            rec = (out.get("meta_info") or {}).get(META_KEY)
            if rec:
                records[int(out.get("index") or 0)] = rec[0] if isinstance(rec, list) else rec
        yield out


def stream_around(original: Any, serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for the OpenAI stream generators."""
    return _stream(original, serving, args, kwargs)


async def _stream(original: Any, serving: Any, args: tuple, kwargs: dict) -> AsyncIterator[str]:
    records: dict[int, dict] = {}
    _RECORDS.set(records)
    request = args[1] if len(args) > 1 else kwargs.get("request")  # the OpenAI request
    n = max(1, int(getattr(request, "n", 1) or 1))
    async for chunk in original(serving, *args, **kwargs):
        yield with_usage(chunk, records, n) if records else chunk


def with_usage(chunk: Any, records: dict[int, dict], n_choices: int = 1) -> Any:
    """The SSE line ``chunk`` with our fields added to its usage, if it is the usage chunk."""
    if not isinstance(chunk, str) or '"usage"' not in chunk or not chunk.startswith("data: "):
        return chunk
    try:
        body = json.loads(chunk[len("data: "):])
        usage = body.get("usage")
        if not isinstance(usage, dict) or body.get("choices"):
            return chunk
        firsts = [records[i] for i in sorted(records) if i % n_choices == 0]
        details = usage.get("prompt_tokens_details") or {"cached_tokens": cached_tokens(firsts)}
        usage["prompt_tokens_details"] = {**details, **usage_fields(firsts)}
        return f"data: {json.dumps(body)}\n\n"
    except Exception:  # accounting must never fail a response
        logger.exception("sglang-kvcmas: could not add reuse accounting to a stream's usage")
        return chunk
