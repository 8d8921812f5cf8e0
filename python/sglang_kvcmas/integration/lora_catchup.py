"""``--kvcmas-lora-share catchup``: exact per-adapter catch-up prefills alongside the writer.

In the HTTP process, on every single (non-batch) request that names an adapter and a workflow
(``kvcmas_workflow``, ``X-KVCMAS-Workflow`` or the router's routing key): the other adapters that
have spoken in that workflow (``policy.lora_catchup.CatchupPlanner``) each get a background
request with the same prompt and one output token, sent to the scheduler once this request has
streamed its first chunk (a non-streamed one: at once) and a grace period (:data:`GRACE_S`) later,
unless that adapter has a request of its own in flight in the workflow by then, so their prefills
run in the batches beside this request's decode. Nothing of the client's request changes.

Background requests go through SGLang's unhooked ``generate_request`` (no ledger entry, no
catch-up of their own); their tokens are counted in ``kvcmas:lora_catchup_tokens_total``
(Prometheus, ``kind`` = ``prompt`` | ``prefilled``) and :data:`TOTALS`. A failed catch-up is
logged and dropped: it never fails the client's request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.prefill_requests import mode, one_token_request, run_counted
from sglang_kvcmas.policy.lora_catchup import CatchupPlanner
from sglang_kvcmas.policy.request_options import RequestOptions

logger = logging.getLogger(__name__)

PLANNER = CatchupPlanner()
TOTALS = {"requests": 0, "prompt": 0, "prefilled": 0, "failed": 0, "skipped": 0}
"""What catch-ups have cost in this process: requests, their prompt tokens, tokens prefilled;
failed ones, and ones skipped because the adapter's own request was in flight."""
RID_PREFIX = "kvcmas-catchup-"
GRACE_S = 0.05
"""How long a catch-up waits for the adapter's own request of the same step (agents that answer
together arrive within milliseconds of each other)."""
_TASKS: set[asyncio.Task] = set()


def _counter() -> Any:
    return metrics.counter("kvcmas:lora_catchup_tokens", "Tokens of background per-adapter "
                           "catch-up prefills (prompt, prefilled).", ["kind"])


def _speaker(obj: Any, options: list[RequestOptions | None]) -> tuple[str, str] | None:
    """(workflow, adapter) of a single adapter request of a workflow under ``catchup``."""
    if mode() != "catchup" or len(options) != 1 or options[0] is None:
        return None
    workflow, adapter = options[0].workflow, getattr(obj, "lora_path", None)
    if workflow is None or not isinstance(adapter, str) or not adapter:
        return None
    return workflow, adapter


def around_request(original: Any, manager: Any, obj: Any,
                   options: list[RequestOptions | None], outputs: Any) -> Any:
    """Start the catch-ups ``obj`` calls for (see the module docstring) and return ``outputs``,
    tracked as the adapter's request in flight until it ends."""
    speaker = _speaker(obj, options)
    if speaker is None:
        return outputs
    workflow, adapter = speaker
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not called from the server's event loop (tests): nothing to start
        return outputs
    PLANNER.started(workflow, adapter)
    others = PLANNER.on_request(workflow, adapter)

    def start() -> None:
        for other in others:
            task = loop.create_task(_catch_up(original, manager, obj, workflow, other))
            _TASKS.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(_TASKS.discard)

    if not getattr(obj, "stream", False):
        start()  # no first chunk to wait for: after the grace period
        start = None
    return _tracked(outputs, workflow, adapter, start)


async def _tracked(outputs: Any, workflow: str, adapter: str, start: Any) -> Any:
    """``outputs``, with the adapter's request in flight until it ends; a streamed request's
    catch-ups start after its first chunk: started with it, their prefill would run in the
    batch after its own and, with SGLang's overlap scheduler, delay its first token."""
    try:
        async for out in outputs:
            yield out
            if start is not None:
                start()
                start = None
    finally:
        PLANNER.finished(workflow, adapter)


def catchup_request(obj: Any, adapter: str) -> Any:
    """The background request: ``obj``'s prompt under ``adapter``, one greedy output token."""
    return one_token_request(obj, adapter, RID_PREFIX, keep_custom=False)


async def _catch_up(original: Any, manager: Any, obj: Any, workflow: str, adapter: str) -> None:
    await asyncio.sleep(GRACE_S)
    if PLANNER.in_flight(workflow, adapter):
        TOTALS["skipped"] += 1
        return  # its own request of this step is being served: nothing to catch up
    try:
        await run_counted(original, manager, catchup_request(obj, adapter), TOTALS, _counter())
    except Exception:  # noqa: BLE001 - background work must never fail anything else
        TOTALS["failed"] += 1
        logger.exception("sglang-kvcmas: LoRA catch-up for adapter %s failed", adapter)
