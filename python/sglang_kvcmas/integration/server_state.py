"""Report which tree cache the scheduler actually built, through ``/server_info``.

``/server_info`` shows the ``--radix-cache-backend`` the server was *asked* for; this adds what
each scheduler *instantiated*. An AFTER hook on the scheduler's internal-state readback adds a
``kvcmas`` entry to every element of ``/server_info``'s ``internal_states``: the tree cache's
class and state (:func:`describe_tree_cache`) and ``dispatch``, the scheduler process's forward
batches and tokens by attention path and reason (``dispatch_counts``; empty with sharing off).
"""

from __future__ import annotations

from typing import Any

import sglang_kvcmas
from sglang_kvcmas.attention.deviation_factors import MaterializedBytes
from sglang_kvcmas.integration import dispatch_counts, turn_order_hook

INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)
"""The SGLang method our hook wraps (checked by test/test_sglang_contract.py)."""

STATE_KEY = "kvcmas"


def describe_tree_cache(tree_cache: object) -> dict[str, Any]:
    """The ``kvcmas`` entry for one scheduler's tree cache: its class, the KV pool's slots
    (``pool``), and with sharing on the shared tree's sizes, the leaders in flight, the
    scheduling passes with prefill to spare and the requests they served exactly, faults, the
    factored deviations running rows hold materialized (``materialized_leaf_bytes``: now and
    peak) and any bookkeeping drift (``invariants``, empty when consistent)."""
    cls = type(tree_cache)
    out: dict[str, Any] = {
        "tree_cache_class": f"{cls.__module__}.{cls.__qualname__}",
        "radix_cache_backend": getattr(tree_cache, "backend_name", None),
        "plugin_version": sglang_kvcmas.__version__,
    }
    pool = _pool(tree_cache)
    if pool is not None:
        out["pool"] = pool
    shared = getattr(tree_cache, "shared", None)
    if getattr(tree_cache, "share_context", False) and shared is not None:
        out["shared_tree"] = {**tree_cache.shared_stats(),
                              "pending_owners": len(tree_cache.pending_owners),
                              "held_back": turn_order_hook.held_count(),
                              "spare_passes": turn_order_hook.SPARE["passes"],
                              "spare_exact_requests": turn_order_hook.SPARE["requests"],
                              "faults": tree_cache.faults,
                              "namespaces_without_sharing": len(tree_cache.broken_namespaces),
                              "materialized_leaf_bytes": {"now": MaterializedBytes.now,
                                                          "peak": MaterializedBytes.peak},
                              "invariants": shared.check_invariants()}
    return out


def add_tree_cache_to_internal_state(result: Any, controller: Any, *args: Any, **kwargs: Any):
    """AFTER hook for ``SchedulerInternalStateController.get_internal_state``: extends the
    ``internal_state`` dict of SGLang's ``GetInternalStateReqOutput`` in place."""
    scheduler = getattr(controller, "scheduler", None)
    tree_cache = getattr(scheduler, "tree_cache", None)
    if tree_cache is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state[STATE_KEY] = {**describe_tree_cache(tree_cache),
                                            "dispatch": dispatch_counts.snapshot()}
    return result


def _pool(tree_cache: Any) -> dict[str, int] | None:
    """The KV pool's slots, read now: ``total`` = ``available`` + ``evictable`` (cached, free to
    evict) + ``protected`` (locked by running requests) + what running requests hold uncached.
    With nothing running, available + evictable == total, or slots leaked."""
    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    try:
        return {"total": int(allocator.size), "available": int(allocator.available_size()),
                "evictable": int(tree_cache.evictable_size()),
                "protected": int(tree_cache.protected_size())}
    except Exception:  # a cache without a pool (unit tests) or another allocator kind
        return None
