"""``--kvcmas-lora-share rebase``: an adapter request's prompt is prefilled by the centroid first.

In the HTTP process, before a single (non-batch) request that names an adapter goes to the
scheduler, the same prompt is sent under the centroid adapter (``policy.lora_share.CENTROID``,
built at launch by ``server/lora_centroid.py``) with one greedy output token, and the request
follows it. The centroid request computes what the shared tree lacks of the transcript and
writes it there (an exact owner: it is the only writer under ``rebase``), so the adapter request
that follows reads the whole transcript as a borrower: its head exact, the centroid's KV
re-positioned, the tokens the recompute policy picks recomputed with its own adapter.

With ``--kvcmas-lora-centroid-handoff scheduler`` the request does not wait for the centroid's
response: it goes to the scheduler once the centroid request has been sent (SGLang's one socket
keeps them in order), and the scheduler's turn order holds it while the centroid prefill is
queued or running (``turn_order_hook.queued_writers``), so it is admitted in the pass after the
centroid's, a round trip sooner. The turn order holds a request only for at least
``turn_min_gain`` tokens, so behind a shorter new segment the request computes that segment
itself (exactly, in its own cache). The default, ``response``, waits here for the response.

Identical prompts in flight at once (agents of one workflow that answer together) share one
centroid prefill. Skipped for requests that ask to read no other agent's KV
(``kvcmas_exact``), for the centroid itself, and for batches.

Ahead of the next turn (``--kvcmas-lora-centroid-ahead N``, the lab's schedule of rebuilding
the base alongside the writer's decode): while an adapter request streams its answer, every N
answer tokens the centroid prefills the prompt plus the answer so far (its shared transcript
ending there: ``kvcmas_shared_end`` beside the request's explicit ``kvcmas_head_len``, which
the chat route sets; a request without one gets nothing ahead), one such prefill in flight per
answer at a time, so the next turn's centroid prefill finds all but the answer's last tokens
computed. Nothing is sent
when the answer ends: the next turn's own centroid prefill computes the rest in the same pass
as what follows the answer (a separate prefill of it would be one more pass before the next
reader). So a request that does not stream gets nothing ahead, nor does a prompt given as text
(its ids are the scheduler's; the chat route sends ids). A centroid prefill waits for the ahead
prefills in flight of a prompt its own extends (it would compute the same tokens beside them).
Of the requests that share one centroid prefill only the first to arrive prefills ahead: the
order in which their answers join the transcript is unknown, and the first is the likeliest to
come first. Ahead prefills are centroid prefills (their rids under ``AHEAD_RID``, a prefix of
the centroid's; the same token counters; ``TOTALS["ahead"]`` and
``kvcmas:lora_centroid_ahead_requests_total`` count them); the tree marks where each
ended (``SharedNode.open_end``), so the rest of the answer continues the answer's segment
rather than starting one whose first tokens every reader would recompute.

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
from sglang_kvcmas.integration.prefill_requests import (
    mode,
    one_token_request,
    run_counted,
    serving_config,
)
from sglang_kvcmas.policy.lora_share import AHEAD_RID, CENTROID, CENTROID_RID
from sglang_kvcmas.policy.request_options import SHARED_END_FIELD, RequestOptions

logger = logging.getLogger(__name__)

TOTALS = {"requests": 0, "prompt": 0, "prefilled": 0, "failed": 0, "coalesced": 0, "ahead": 0}
"""What centroid prefills have cost in this process: requests, their prompt tokens, tokens
prefilled; failed ones, adapter requests that joined one already in flight, and how many of the
requests were ahead prefills of an answer."""
_IN_FLIGHT: dict[tuple, tuple[asyncio.Future, str]] = {}
"""Prompt key -> the centroid prefill in flight for it, and its rid."""
_AHEAD: dict[tuple, dict[tuple, asyncio.Future]] = {}
"""(cache_salt, extra_key) -> the latest ahead prefill in flight there of each answered prompt,
by the prompt's ids."""
SENT_POLL_S = 0.001
"""How often an adapter request looks whether its centroid prefill has been sent."""


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


def ahead_every() -> int:
    """``--kvcmas-lora-centroid-ahead`` as the launcher set it (0: off)."""
    return serving_config().lora_centroid_ahead


def handoff() -> str:
    """``--kvcmas-lora-centroid-handoff`` as the launcher set it."""
    return serving_config().lora_centroid_handoff


def _namespace(obj: Any) -> tuple:
    return (getattr(obj, "cache_salt", None), getattr(obj, "extra_key", None))


def _prompt_key(obj: Any) -> tuple:
    ids = getattr(obj, "input_ids", None)
    return (*_namespace(obj), tuple(ids) if isinstance(ids, list) else getattr(obj, "text", None))


def _aheads_under(obj: Any) -> list[asyncio.Future]:
    """The ahead prefills in flight of answers to a prompt that ``obj``'s prompt extends (the
    answer itself may come back tokenized otherwise)."""
    ids = getattr(obj, "input_ids", None)
    if not isinstance(ids, list):
        return []
    return [f for prompt, f in _AHEAD.get(_namespace(obj), {}).items()
            if len(prompt) <= len(ids) and tuple(ids[: len(prompt)]) == prompt]


def around_request(original: Any, manager: Any, obj: Any,
                   options: list[RequestOptions | None], outputs: Any) -> Any:
    """``outputs``, started only once the centroid has prefilled ``obj``'s prompt (``response``)
    or its prefill request has been sent (``scheduler``; see the module docstring); untouched
    when ``obj`` needs no centroid prefill."""
    if not _wants_centroid(obj, options):
        return outputs
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not called from the server's event loop (tests): nothing to start
        return outputs
    key = _prompt_key(obj)
    entry = _IN_FLIGHT.get(key)
    first = entry is None
    if first:
        req = centroid_request(obj)
        fut = asyncio.ensure_future(_prefill(original, manager, req, _aheads_under(obj)))
        entry = _IN_FLIGHT[key] = (fut, req.rid)
        fut.add_done_callback(lambda _: _IN_FLIGHT.pop(key, None))
    else:
        TOTALS["coalesced"] += 1
    fut, rid = entry
    ready = _sent(manager, rid, fut) if handoff() == "scheduler" else asyncio.shield(fut)
    outputs = _after(ready, outputs)
    every = ahead_every()
    if first and every > 0 and options[0] is not None and options[0].head_len is not None:
        outputs = _ahead(original, manager, obj, outputs, every)
    return outputs


async def _after(ready: Any, outputs: Any) -> Any:
    await ready  # never raises: _prefill logs its failures
    async for out in outputs:
        yield out


async def _sent(manager: Any, rid: str, fut: asyncio.Future) -> None:
    """Until the centroid prefill ``rid`` has been sent to the scheduler, or has ended (failed,
    or a manager without SGLang's request states: its response)."""
    states = getattr(manager, "rid_to_state", None)
    while not fut.done():
        state = states.get(rid) if isinstance(states, dict) else None
        if state is not None and getattr(state, "dispatched", False):
            return
        await asyncio.sleep(SENT_POLL_S)


async def _prefill(original: Any, manager: Any, req: Any,
                   first: list[asyncio.Future] | None = None) -> None:
    """Run the centroid prefill ``req`` once the ahead prefills ``first`` are done."""
    if first:
        await asyncio.wait(first)  # their failures are theirs: logged where they ran
    try:
        await run_counted(original, manager, req, TOTALS, _counter())
    except Exception:  # noqa: BLE001 - the adapter request goes on without it
        TOTALS["failed"] += 1
        logger.exception("sglang-kvcmas: centroid prefill %s failed", req.rid)


def ahead_request(obj: Any, answer: list[int]) -> Any:
    """The centroid prefill of ``obj``'s prompt ids followed by ``answer``'s, its shared
    transcript running to the end of the answer."""
    req = one_token_request(obj, CENTROID, AHEAD_RID, keep_custom=True)
    req.input_ids = list(req.input_ids) + list(answer)
    req.sampling_params.setdefault("custom_params", {})[SHARED_END_FIELD] = len(req.input_ids)
    return req


async def _ahead(original: Any, manager: Any, obj: Any, outputs: Any, every: int) -> Any:
    """``outputs``, with the centroid prefilling ``obj``'s prompt plus its answer so far every
    ``every`` answer tokens while a streamed answer decodes."""
    if not (getattr(obj, "stream", False) and isinstance(getattr(obj, "input_ids", None), list)):
        async for out in outputs:
            yield out
        return
    incremental = bool(getattr(getattr(manager, "server_args", None),
                               "incremental_streaming_output", False))
    answer: list[int] = []
    sent, running = 0, None
    async for out in outputs:
        if isinstance(out, dict):
            ids = out.get("output_ids")
            if isinstance(ids, list) and incremental:
                answer.extend(ids)
            elif isinstance(ids, list):
                answer = ids  # the whole answer so far (SGLang's list: sliced before use)
            ended = (out.get("meta_info") or {}).get("finish_reason") is not None
            if not ended and len(answer) - sent >= every and (running is None or running.done()):
                sent = len(answer) - len(answer) % every
                running = _start_ahead(original, manager, obj, answer[:sent])
        yield out


def _start_ahead(original: Any, manager: Any, obj: Any, answer: list[int]) -> asyncio.Future:
    """The ahead prefill of ``obj``'s prompt plus ``answer``."""
    space, prompt = _namespace(obj), tuple(obj.input_ids)
    fut = asyncio.ensure_future(_prefill(original, manager, ahead_request(obj, answer)))
    TOTALS["ahead"] += 1
    ahead_counter = metrics.counter("kvcmas:lora_centroid_ahead_requests", "Centroid prefills "
                                    "of a streamed answer ahead of the next turn.", [])
    if ahead_counter is not None:
        ahead_counter.inc()
    aheads = _AHEAD.setdefault(space, {})
    aheads[prompt] = fut

    def done(_: asyncio.Future) -> None:
        if aheads.get(prompt) is fut:
            del aheads[prompt]
        if not aheads and _AHEAD.get(space) is aheads:
            del _AHEAD[space]

    fut.add_done_callback(done)
    return fut
