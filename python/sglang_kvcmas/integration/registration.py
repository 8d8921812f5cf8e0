"""Everything sglang-kvcmas registers with SGLang, in one idempotent call.

Called by ``sglang_kvcmas.plugin:register`` in every SGLang process that loads plugins (the
launcher, the tokenizer manager and every scheduler), before SGLang applies plugin hooks. It only
registers — no model load, no device initialisation, no environment changes:

- radix cache backend ``kvcmas`` (``tree_cache_factory``);
- attention backend ``kvcmas_delta``, also added to ``--attention-backend``'s choices, and
  SGLang's ``triton``, ``flashinfer`` and ``torch_native`` factories wrapped for sharing
  (``shared_backends``); the LoRA ``torch_native`` backend made CPU-safe (``cpu_lora``);
- scheduler hooks (``turn_order_hook``, ``admission_hook``, ``batch_rows``, ``dispatch_counts``,
  ``server_state``) and HTTP-process hooks (``request_hooks``, ``chat_split_hook``,
  ``fidelity_monitor``, ``lora_hooks``, ``usage_stream``, ``reuse_accounting``); each module's
  docstring says what its hook does.

Every hook is inert unless the tree cache in use is ours with sharing on (or, for usage, a
response carries our reuse record), so stock-cache servers are unchanged.
"""

from __future__ import annotations

from sglang.srt.layers.attention.attention_registry import (
    ATTENTION_BACKENDS,
    register_attention_backend,
)
from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

from sglang_kvcmas.integration import (
    admission_hook,
    batch_rows,
    chat_split_hook,
    dispatch_counts,
    fidelity_monitor,
    lora_hooks,
    request_hooks,
    reuse_accounting,
    turn_order_hook,
    usage_stream,
)
from sglang_kvcmas.integration.cpu_lora import register_cpu_lora_backend
from sglang_kvcmas.integration.delta_attention_backend import BACKEND_NAME as ATTN_NAME
from sglang_kvcmas.integration.delta_attention_backend import create_delta_backend
from sglang_kvcmas.integration.radix_cache_backend import BACKEND_NAME
from sglang_kvcmas.integration.server_state import (
    INTERNAL_STATE_TARGET,
    add_tree_cache_to_internal_state,
)
from sglang_kvcmas.integration.shared_backends import (
    GRAPH_GATE_TARGETS,
    graph_gate,
    wrap_registry,
)
from sglang_kvcmas.integration.tree_cache_factory import build_shared_tree_cache

USAGE_TARGET = (
    "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_response_usage"
)


def _register_hook(target: str, hook, hook_type: HookType) -> None:
    # HookRegistry.register appends; re-registering would wrap the method twice.
    if any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
        return
    HookRegistry.register(target, hook, hook_type)


def register_cache_backend() -> None:
    """Register ``build_shared_tree_cache`` as radix cache backend ``"kvcmas"`` (once).

    Raises:
        RuntimeError: if another factory already holds the name ``"kvcmas"``.
    """
    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is build_shared_tree_cache:
        return
    if existing is not None:
        raise RuntimeError(
            f"radix cache backend {BACKEND_NAME!r} is already registered by "
            f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}"
        )
    register_radix_cache_backend(BACKEND_NAME, build_shared_tree_cache)


def register_attention_backend_once() -> None:
    """Register attention backend ``kvcmas_delta`` and make it a valid ``--attention-backend``;
    wrap SGLang's factories that serve sharing (``shared_backends.SHARED_BACKENDS``)."""
    if ATTENTION_BACKENDS.get(ATTN_NAME) is not create_delta_backend:
        register_attention_backend(ATTN_NAME)(create_delta_backend)
    if ATTN_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTN_NAME])
    wrap_registry(ATTENTION_BACKENDS)


def register_all() -> None:
    """Register every sglang-kvcmas extension with SGLang. Idempotent."""
    register_cache_backend()
    register_attention_backend_once()
    register_cpu_lora_backend()
    _register_hook(INTERNAL_STATE_TARGET, add_tree_cache_to_internal_state, HookType.AFTER)
    _register_hook(turn_order_hook.TARGET, turn_order_hook.turn_order_around, HookType.AROUND)
    _register_hook(admission_hook.TARGET, admission_hook.admission_around, HookType.AROUND)
    _register_hook(batch_rows.TARGET, batch_rows.attach_rows, HookType.AFTER)
    for target in GRAPH_GATE_TARGETS:
        _register_hook(target, graph_gate, HookType.AFTER)
    _register_hook(dispatch_counts.TARGET, dispatch_counts.count_forward, HookType.AFTER)
    _register_hook(request_hooks.GENERATE_TARGET, request_hooks.generate_around, HookType.AROUND)
    _register_hook(request_hooks.VALIDATE_TARGET, request_hooks.validate_around, HookType.AROUND)
    _register_hook(fidelity_monitor.INTERNAL_STATE_TARGET, fidelity_monitor.internal_state_around,
                   HookType.AROUND)
    _register_hook(lora_hooks.TARGET, lora_hooks.load_around, HookType.AROUND)
    _register_hook(chat_split_hook.TARGET, chat_split_hook.convert_around, HookType.AROUND)
    _register_hook(usage_stream.CHAT_TARGET, usage_stream.stream_around, HookType.AROUND)
    _register_hook(usage_stream.COMPLETION_TARGET, usage_stream.stream_around, HookType.AROUND)
    _register_hook(USAGE_TARGET, reuse_accounting.usage_hook, HookType.AFTER)
    _register_hook(reuse_accounting.STREAMER_TARGET, reuse_accounting.request_level_streamer,
                   HookType.AFTER)
    _register_hook(reuse_accounting.JSON_RESPONSE_TARGET, reuse_accounting.json_response_around,
                   HookType.AROUND)
