"""Register the shared-context serving path with SGLang, in one idempotent call.

``register()`` adds, in the calling process:

- radix cache backend ``kvcmas-shared`` -> :class:`KvcmasSharedTreeCache`;
- attention backend ``kvcmas_delta`` (torch_native + shared-span re-positioning / deltas), also
  added to ``--attention-backend``'s choices;
- scheduler hook: agent-turn ordering (AROUND ``Scheduler._get_new_batch_prefill_raw``);
- OpenAI usage hooks: reuse accounting in ``usage.prompt_tokens_details`` (and its JSON).

Registration only: no model load, no device init. Hooks take effect when SGLang's
``load_plugins()`` applies them, so call this before it (``shared_launch`` does, in every process).
"""

from __future__ import annotations

from sglang.srt.layers.attention.attention_registry import (
    ATTENTION_BACKENDS,
    register_attention_backend,
)
from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

from sglang_kvcmas.integration import reuse_accounting, turn_order_hook
from sglang_kvcmas.integration.delta_attention_backend import BACKEND_NAME as ATTN_NAME
from sglang_kvcmas.integration.delta_attention_backend import create_delta_backend
from sglang_kvcmas.integration.shared_tree_cache import (
    SHARED_BACKEND_NAME,
    build_shared_tree_cache,
)

USAGE_TARGET = (
    "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_response_usage"
)


def _register_hook(target: str, hook, hook_type: HookType) -> None:
    if any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
        return
    HookRegistry.register(target, hook, hook_type)


def register() -> None:
    """Register everything the shared-context serving path needs. Idempotent.

    Raises:
        RuntimeError: if another factory already holds the name ``kvcmas-shared``.
    """
    existing = get_radix_cache_factory(SHARED_BACKEND_NAME)
    if existing is None:
        register_radix_cache_backend(SHARED_BACKEND_NAME, build_shared_tree_cache)
    elif existing is not build_shared_tree_cache:
        raise RuntimeError(f"radix cache backend {SHARED_BACKEND_NAME!r} is taken by {existing}")
    if ATTENTION_BACKENDS.get(ATTN_NAME) is not create_delta_backend:
        register_attention_backend(ATTN_NAME)(create_delta_backend)
    if ATTN_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTN_NAME])
    _register_hook(turn_order_hook.TARGET, turn_order_hook.turn_order_around, HookType.AROUND)
    _register_hook(USAGE_TARGET, reuse_accounting.usage_hook, HookType.AFTER)
    _register_hook(reuse_accounting.JSON_RESPONSE_TARGET, reuse_accounting.json_response_around,
                   HookType.AROUND)
