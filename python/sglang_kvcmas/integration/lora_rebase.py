"""``--kvcmas-lora-share rebase``: an adapter request's prompt is prefilled by the centroid first.

In the HTTP process, before a single (non-batch) request that names an adapter goes to the
scheduler, the same prompt is sent under the centroid adapter (``policy.lora_share.CENTROID``,
built at launch by ``server/lora_centroid.py``) with one greedy output token, and the request
follows it. The centroid request computes what the shared tree lacks of the transcript and
writes it there (an exact owner: it is the only writer under ``rebase``), so the adapter request
that follows reads the whole transcript as a borrower: its head exact, the centroid's KV
re-positioned, the tokens the recompute policy picks recomputed with its own adapter.

The adapter request waits here for the centroid's response before it goes to the scheduler.

Identical prompts in flight at once (agents of one workflow that answer together) share one
centroid prefill. Skipped for requests that ask to read no other agent's KV
(``kvcmas_exact``), for the centroid itself, and for batches.

Centroid requests go through SGLang's unhooked ``generate_request`` (no ledger entry); their
tokens are counted in ``kvcmas:lora_centroid_tokens_total`` (``kind`` = ``prompt`` |
``prefilled``) and :data:`TOTALS`. A failed centroid prefill is logged and the adapter request
goes on (it then computes what is missing itself).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.prefill_requests import mode, one_token_request, run_counted
from sglang_kvcmas.policy.lora_share import CENTROID, CENTROID_RID
from sglang_kvcmas.policy.request_options import RequestOptions

logger = logging.getLogger(__name__)

TOTALS = {"requests": 0, "prompt": 0, "prefilled": 0, "failed": 0, "coalesced": 0}
"""What centroid prefills have cost in this process: requests, their prompt tokens, tokens
prefilled; failed ones, and adapter requests that joined one already in flight."""
_IN_FLIGHT: dict[tuple, asyncio.Future] = {}
"""Prompt key -> the centroid prefill in flight for it."""


def _counter() -> Any:
    return metrics.counter("kvcmas:lora_centroid_tokens", "Tokens of the centroid adapter's "
                           "prefills under lora_share=rebase (prompt, prefilled).", ["kind"])


def _wants_centroid(obj: Any, options: list[RequestOptions | None]) -> bool:
    if mode() != "rebase" or len(options) != 1:
        return False
    adapter = getattr(obj, "lora_path", None)
    if not isinstance(adapter, str) or not adapter or adapter == CENTROID:
        return False
    return options[0] is None or not options[0].exact


def centroid_request(obj: Any) -> Any:
    """``obj``'s prompt under the centroid adapter, one greedy output token, its ``kvcmas_*``
    fields (head and shared end) and namespace kept."""
    return one_token_request(obj, CENTROID, CENTROID_RID, keep_custom=True)


def _prompt_key(obj: Any) -> tuple:
    ids = getattr(obj, "input_ids", None)
    return (getattr(obj, "cache_salt", None), getattr(obj, "extra_key", None),
            tuple(ids) if isinstance(ids, list) else getattr(obj, "text", None))


def around_request(original: Any, manager: Any, obj: Any,
                   options: list[RequestOptions | None], outputs: Any) -> Any:
    """``outputs``, started only once the centroid has prefilled ``obj``'s prompt; untouched
    when ``obj`` needs no centroid prefill."""
    if not _wants_centroid(obj, options):
        return outputs
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not called from the server's event loop (tests): nothing to start
        return outputs
    key = _prompt_key(obj)
    fut = _IN_FLIGHT.get(key)
    if fut is None:
        fut = _IN_FLIGHT[key] = asyncio.ensure_future(
            _prefill(original, manager, centroid_request(obj)))
        fut.add_done_callback(lambda _: _IN_FLIGHT.pop(key, None))
    else:
        TOTALS["coalesced"] += 1
    return _after(fut, outputs)


async def _after(fut: asyncio.Future, outputs: Any) -> Any:
    await asyncio.shield(fut)  # never raises: _prefill logs its failures
    async for out in outputs:
        yield out


async def _prefill(original: Any, manager: Any, req: Any) -> None:
    """Run the centroid prefill ``req``."""
    try:
        await run_counted(original, manager, req, TOTALS, _counter())
    except Exception:  # noqa: BLE001 - the adapter request goes on without it
        TOTALS["failed"] += 1
        logger.exception("sglang-kvcmas: centroid prefill %s failed", req.rid)
