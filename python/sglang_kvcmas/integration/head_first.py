"""An agent's first request borrows too: its head is prefilled on its own, beside the leader.

A reader borrows only once its head is in the radix cache (the borrowed span continues its own
exact prefix). Without help, an agent's first request therefore computes its whole prompt, and a
panel whose agents all open on the same document computes that document once per agent.

In the HTTP process, a single request with an explicit head and shared end (the chat route sets
both) whose shared part could be borrowed (at least ``policy.recompute.MIN_BORROWED`` tokens) and
whose head this process has not sent before gets a **head request**: the head's tokens alone,
one greedy output token, exact, sent through SGLang's unhooked ``generate_request`` at the same
time as the request itself (never awaited: nothing the client sees waits for it). The request
is marked ``custom_params.kvcmas_head_first``; the turn-order hook (``turn_order_hook.py``) may
then hold it behind a leader over the same transcript although its head is not cached yet, and
when the leader has published the transcript the head is cached too (its prefill ran in the
leader's batch), so the request borrows. Held by nobody, it is served as before.

Head requests are counted in ``kvcmas:head_prefill_tokens_total`` (``kind`` = ``prompt`` |
``prefilled``) and :data:`TOTALS`: the cost of the feature, about one head per agent and
namespace. A failed head request is logged and dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.prefill_requests import run_counted, serving_config
from sglang_kvcmas.policy.recompute import MIN_BORROWED
from sglang_kvcmas.policy.request_options import (
    EXACT_FIELD,
    HEAD_FIRST_FIELD,
    HEAD_LEN_FIELD,
    SHARED_END_FIELD,
    RequestOptions,
)

logger = logging.getLogger(__name__)

RID_PREFIX = "kvcmas-head-"
MAX_REMEMBERED = 4096
"""Heads this process remembers having sent (least recently used forgotten first): a head sent
once stays cached while its agent is active, and a forgotten one costs one more head request."""
TOTALS = {"requests": 0, "prompt": 0, "prefilled": 0, "failed": 0}
"""What head requests have cost in this process: requests, prompt tokens, tokens prefilled
(0 for a head already cached), failed ones."""
_SENT: OrderedDict[bytes, None] = OrderedDict()
_TASKS: set[asyncio.Task] = set()


def _counter() -> Any:
    return metrics.counter("kvcmas:head_prefill_tokens", "Tokens of agent heads prefilled on "
                           "their own so first requests can borrow (prompt, prefilled).", ["kind"])


def _head_key(obj: Any, head: list[int]) -> bytes:
    parts = (getattr(obj, "cache_salt", None), getattr(obj, "extra_key", None),
             getattr(obj, "lora_path", None), head)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def wants_head(obj: Any, options: list[RequestOptions | None]) -> int:
    """The head length to prefill on its own for ``obj``, or 0: not a single request with an
    explicit head and a borrowable shared part, an exact one, or sharing off."""
    if len(options) != 1 or options[0] is None or not serving_config().share_context:
        return 0
    opts = options[0]
    ids = getattr(obj, "input_ids", None)
    if opts.exact or opts.head_len is None or not isinstance(ids, list) or not ids \
            or not isinstance(ids[0], int):
        return 0
    shared_end = opts.shared_end if opts.shared_end is not None else len(ids)
    if shared_end - opts.head_len < MIN_BORROWED or opts.head_len > len(ids):
        return 0
    return opts.head_len


def head_request(obj: Any, head_len: int) -> Any:
    """``obj``'s head alone: exact, one greedy output token, its namespace and adapter kept."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    custom = {HEAD_LEN_FIELD: head_len, SHARED_END_FIELD: head_len, EXACT_FIELD: True}
    return GenerateReqInput(
        input_ids=list(obj.input_ids[:head_len]), lora_path=getattr(obj, "lora_path", None),
        sampling_params={"max_new_tokens": 1, "temperature": 0, "custom_params": custom},
        rid=f"{RID_PREFIX}{uuid.uuid4().hex}", cache_salt=getattr(obj, "cache_salt", None),
        extra_key=getattr(obj, "extra_key", None))


def remember(key: bytes) -> bool:
    """Record ``key`` as sent; False when it already was (then it is only refreshed)."""
    if key in _SENT:
        _SENT.move_to_end(key)
        return False
    _SENT[key] = None
    if len(_SENT) > MAX_REMEMBERED:
        _SENT.popitem(last=False)
    return True


def before_request(original: Any, manager: Any, obj: Any,
                   options: list[RequestOptions | None]) -> None:
    """Send ``obj``'s head request and mark ``obj`` (see the module docstring), when it wants
    one; call before ``obj`` itself is sent."""
    head_len = wants_head(obj, options)
    if not head_len or not remember(_head_key(obj, list(obj.input_ids[:head_len]))):
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not called from the server's event loop (tests): nothing to start
        return
    obj.sampling_params["custom_params"][HEAD_FIRST_FIELD] = True
    task = loop.create_task(_run(original, manager, head_request(obj, head_len)))
    _TASKS.add(task)  # held until done (the loop keeps only weak references)
    task.add_done_callback(_TASKS.discard)


async def _run(original: Any, manager: Any, req: Any) -> None:
    try:
        await run_counted(original, manager, req, TOTALS, _counter())
    except Exception:
        TOTALS["failed"] += 1
        logger.exception("sglang-kvcmas: head request %s failed", req.rid)
