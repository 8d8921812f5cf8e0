"""Apply the agent-turn ordering policy (``policy/turn_order.py``) inside SGLang's scheduler.

An AROUND hook on ``Scheduler._get_new_batch_prefill_raw``: before SGLang builds a prefill batch,
the requests the policy defers are taken out of ``waiting_queue``; after, they are put back at
its front, unchanged. Nothing else in the scheduler changes. Active only when the tree cache is
:class:`KvcmasSharedTreeCache` with sharing on. Leaders are the exact owners in flight. A request
whose head is not cached waits only when its head is being prefilled on its own
(``head_first.py``); otherwise it could not borrow after the wait.

A pass with prefill to spare (``policy.turn_order.is_spare``: the waiting requests, computed
exactly, fit in one prefill batch, and few requests run) holds nobody back and marks every
waiting request to be served exactly (``SPARE_ATTR``), as under radix; counted in
:data:`SPARE`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from sglang_kvcmas.integration.agent_requests import SPARE_ATTR
from sglang_kvcmas.policy.turn_order import (
    SPARE_RUNNING_ROWS,
    TurnCandidate,
    TurnLeader,
    TurnPlan,
    is_spare,
    plan_turns,
)

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"

HEAD_WAIT_S = 10.0
"""Longest a request waits for its own head request (``head_first.py``), counted from when the
transcript it would borrow is there; past it, it computes its head itself (and the transcript
with it)."""

_head_wait_since: dict[str, float] = {}
"""rid -> when the request started waiting for its head request alone."""

_held_since: dict[str, float] = {}
"""rid -> when the hook first held the request back. The wait bound counts from there, not from
arrival: under load a request can queue for longer than the bound before its leader is even
admitted, and a bound from arrival would release its readers to recompute what their leader is
computing."""

_prefix_memo: dict[tuple[int, int], tuple] = {}
"""Common shared prefixes of (leader, candidate) pairs for ``plan_turns``, keyed by their token
views (``cache.requests.shared_tokens``, one object per request): each pair is compared once while
both are queued or in flight."""

SPARE = {"passes": 0, "requests": 0}
"""Scheduling passes with prefill to spare, and the requests they served exactly."""
_SPARE_ON: list[bool] = []
"""Whether spare passes serve exactly (``envs.KVCMAS_SPARE_PREFILL``, read once)."""


def spare_on() -> bool:
    if not _SPARE_ON:
        from sglang_kvcmas.envs import KVCMAS_SPARE_PREFILL

        _SPARE_ON.append(KVCMAS_SPARE_PREFILL.get_bool())
    return _SPARE_ON[0]


def _spare(scheduler: Any, cache: Any, waiting: list[Any]) -> bool:
    """Whether this pass has prefill to spare (``policy.turn_order.is_spare``); if so, every
    waiting request is marked to be served exactly."""
    budget = getattr(scheduler, "chunked_prefill_size", None) or getattr(
        scheduler, "max_prefill_tokens", 0)
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or []
    if len(running) > SPARE_RUNNING_ROWS or not spare_on():
        return False  # the usual case under load: no need to price the queue
    exact, total = [], 0
    for r in waiting:  # priced until the queue is past the budget
        exact.append(len(r.origin_input_ids) - cache.radix_peek(r, len(r.origin_input_ids)))
        total += exact[-1]
        if total > (budget or 0):
            return False
    if not is_spare(exact, len(running), budget or 0):
        return False
    SPARE["passes"] += 1
    for req in waiting:
        if not getattr(req, SPARE_ATTR, False):
            setattr(req, SPARE_ATTR, True)
            SPARE["requests"] += 1
    return True


def held_count() -> int:
    """Requests the hook is holding back right now (for ``/server_info``)."""
    return len(_held_since)


def _candidates(cache: Any, waiting: list[Any], now: float,
                ) -> tuple[list[TurnCandidate], dict[str, int]]:
    """The waiting agent requests as the policy sees them, and those whose head is being
    prefilled on its own (``head_first.py``) and not cached yet: rid -> shared tokens the tree
    holds for them."""
    out, head_pending = [], {}
    for req in waiting:
        split = cache.requests.split(req)
        if split is None or cache.requests.wants_exact(req):
            continue  # not an agent request, or asked not to borrow: never held back
        exact = cache.radix_peek(req, split.shared_end)  # its own exact prefix
        ns = cache.requests.namespace(req)
        if ns in cache.broken_namespaces:
            continue  # sharing is off there: nothing to wait for
        available = cache.shared_available(req)
        if exact < split.head_len:
            if not cache.requests.options(req).head_first:
                continue  # its head is not cached: it cannot borrow anyway
            head_pending[req.rid] = available
            exact = split.head_len
        out.append(
            TurnCandidate(req.rid, ns, split.agent, cache.requests.shared_tokens(req),
                          available, now - _held_since.get(req.rid, now),
                          exact - split.head_len)
        )
    return out, head_pending


def _waiting_for_heads(head_pending: dict[str, int], plan: TurnPlan, min_gain: int,
                       now: float) -> dict[str, str]:
    """Requests the plan lets go although their head is not cached yet while the tree already
    holds enough of their transcript to borrow: they wait for their head request (rid -> itself),
    at most :data:`HEAD_WAIT_S` from when that wait began."""
    out = {}
    for rid, available in head_pending.items():
        if rid in plan.deferred or available < min_gain:
            continue
        if now - _head_wait_since.setdefault(rid, now) < HEAD_WAIT_S:
            out[rid] = rid
    return out


def _heads_first(waiting: list[Any]) -> list[Any]:
    """``waiting`` with head requests (``head_first.py``) first, each in its order: a few
    tokens each, and requests wait for them."""
    from sglang_kvcmas.integration.head_first import RID_PREFIX

    heads = [r for r in waiting if str(r.rid).startswith(RID_PREFIX)]
    if not heads:
        return waiting
    return heads + [r for r in waiting if not str(r.rid).startswith(RID_PREFIX)]


def note_readers(held: list[Any], leader_of: dict[str, str]) -> None:
    """Record on each held request how many wait for its leader this pass (the most seen
    over its passes): the readers of one new segment, among whom ``policy.recompute.SEGMENT_SHARE``
    is split (``policy/recompute.py``)."""
    from sglang_kvcmas.integration.agent_requests import READERS_ATTR

    per_leader = Counter(leader_of.values())
    for req in held:
        n = per_leader[leader_of[req.rid]]
        if n > getattr(req, READERS_ATTR, 1):
            setattr(req, READERS_ATTR, n)


def turn_order_around(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: hold back deferred requests for one prefill-batch decision."""
    from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache

    cache = getattr(scheduler, "tree_cache", None)
    waiting = scheduler.waiting_queue
    if not isinstance(cache, KvcmasSharedTreeCache) or not cache.share_context or not waiting:
        return original(scheduler, *args, **kwargs)
    # Waiting pays only for tokens the request will then borrow (``policy.recompute.borrow_pays``).
    config = replace(cache.turn_config,
                     min_gain=max(cache.turn_config.min_gain, cache.recompute_config.min_borrowed))
    now = time.monotonic()
    live = {r.rid for r in waiting}
    for held_at in (_held_since, _head_wait_since):
        for rid in [r for r in held_at if r not in live]:
            del held_at[rid]
    waiting = scheduler.waiting_queue = _heads_first(waiting)
    try:
        if _spare(scheduler, cache, waiting):
            return original(scheduler, *args, **kwargs)
    except Exception:  # our bug must not take the scheduler down: the pass goes on as usual
        cache.faults += 1
        logger.exception("sglang-kvcmas: the spare-prefill check failed")
    in_flight = [TurnLeader(p.rid, p.namespace, p.shared) for p in cache.pending_owners.values()]
    try:
        candidates, head_pending = _candidates(cache, waiting, now)
        views = {id(c.shared) for c in candidates} | {id(p.shared) for p in in_flight}
        for pair in [p for p in _prefix_memo if p[0] not in views or p[1] not in views]:
            del _prefix_memo[pair]
        plan = plan_turns(candidates, in_flight, config, _prefix_memo)
        heads = _waiting_for_heads(head_pending, plan, config.min_gain, now)
        if heads:
            plan = TurnPlan(plan.deferred | frozenset(heads), {**plan.leader_of, **heads})
    except Exception:  # our bug must not take the scheduler down: nobody waits this pass
        cache.faults += 1
        logger.exception("sglang-kvcmas: turn order failed; this pass holds nobody back")
        return original(scheduler, *args, **kwargs)
    if not plan.deferred:
        return original(scheduler, *args, **kwargs)
    for rid in plan.deferred:
        _held_since.setdefault(rid, now)
    held = [r for r in waiting if r.rid in plan.deferred]
    note_readers(held, plan.leader_of)
    scheduler.waiting_queue = [r for r in waiting if r.rid not in plan.deferred]
    logger.debug("sglang-kvcmas: turn order holds back %s", dict(plan.leader_of))
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.waiting_queue = held + list(scheduler.waiting_queue)
