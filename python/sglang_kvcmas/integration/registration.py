"""Everything sglang-kvcmas registers with SGLang, in one idempotent call.

Called by ``sglang_kvcmas.plugin:register`` in every SGLang process that loads plugins. It only
registers: no model load, no device initialisation, no environment changes.
"""

from __future__ import annotations

from sglang.srt.mem_cache.registry import (
    get_radix_cache_factory,
    register_radix_cache_backend,
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvcmas.integration.radix_cache_backend import BACKEND_NAME, build_kvcmas_cache
from sglang_kvcmas.integration.server_state import (
    INTERNAL_STATE_TARGET,
    add_tree_cache_to_internal_state,
)


def register_cache_backend() -> None:
    """Register ``build_kvcmas_cache`` as radix cache backend ``"kvcmas"`` (once).

    Raises:
        RuntimeError: if another factory already holds the name ``"kvcmas"``.
    """
    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is build_kvcmas_cache:
        return
    if existing is not None:
        raise RuntimeError(
            f"radix cache backend {BACKEND_NAME!r} is already registered by "
            f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}"
        )
    register_radix_cache_backend(BACKEND_NAME, build_kvcmas_cache)


def register_server_state_hook() -> None:
    """Register the ``/server_info`` hook that names the instantiated tree cache (once)."""
    # HookRegistry.register appends; re-registering would wrap the method twice.
    registered = HookRegistry._hooks.get(INTERNAL_STATE_TARGET, [])
    if any(hook is add_tree_cache_to_internal_state for _, hook, _ in registered):
        return
    HookRegistry.register(INTERNAL_STATE_TARGET, add_tree_cache_to_internal_state, HookType.AFTER)


def register_all() -> None:
    """Register every sglang-kvcmas extension with SGLang. Idempotent."""
    register_cache_backend()
    register_server_state_hook()
