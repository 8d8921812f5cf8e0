"""The factory SGLang calls for ``--radix-cache-backend kvcmas``: checks, config, the cache.

Each scheduler process calls :func:`build_shared_tree_cache` once; it reads the serving knobs
from the environment the launcher set (``config.ServingConfig.from_env``, parsed here once) and
refuses model or cache features the shared tree does not support, with a message saying what to
drop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration.chat_template_markers import markers_for_server
from sglang_kvcmas.integration.delta_attention_backend import BACKEND_NAME as DELTA_BACKEND_NAME
from sglang_kvcmas.integration.radix_cache_backend import KvcmasRadixCache
from sglang_kvcmas.integration.shared_backends import SHARED_BACKENDS
from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def build_shared_tree_cache(ctx: TreeCacheBuildContext) -> KvcmasSharedTreeCache:
    """Factory registered as radix cache backend ``kvcmas``: SGLang calls it once per scheduler.

    Raises:
        ValueError: for model or cache features the Python radix tree does not implement
            (SGLang's default backend handles those, so the message says to drop
            ``--radix-cache-backend``); with sharing on, for page size > 1 or an attention
            backend that would read borrowed KV without re-positioning it.
    """
    config = ServingConfig.from_env()
    share = config.share_context
    features = (("hybrid sliding-window attention", ctx.is_hybrid_swa),
                ("hybrid state-space (mamba) layers", ctx.is_hybrid_ssm),
                ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
                ("DSA sparse attention", ctx.is_dsa))
    unsupported = [name for name, on in features if on]
    if unsupported:
        raise ValueError(
            f"--radix-cache-backend {KvcmasRadixCache.backend_name} does not support "
            f"{', '.join(unsupported)} yet; run without --radix-cache-backend to use SGLang's "
            "default tree cache."
        )
    args = getattr(ctx, "server_args", None)
    if share:
        if ctx.params.page_size != 1:
            raise ValueError(
                f"--kvcmas-share-context needs --page-size 1 (got {ctx.params.page_size}): the "
                "shared tree and the delta read path address borrowed KV token by token"
            )
        backends = set(attention_backends_of(resolved_view(args))) if args is not None else set()
        served = {DELTA_BACKEND_NAME, *SHARED_BACKENDS}
        if args is not None and not backends <= served:
            raise ValueError(
                f"--kvcmas-share-context reads other agents' KV re-positioned, which the "
                f"attention backends {sorted(served)} do; got {sorted(map(str, backends))}"
            )
    markers = markers_for_server(args)
    chunk = getattr(args, "chunked_prefill_size", None)
    cache = KvcmasSharedTreeCache(ctx.params, markers=markers, config=config,
                                  chunk_limit=int(chunk) if chunk and chunk > 0 else 0)
    cls = type(cache)
    logger.info(
        "sglang-kvcmas: tree cache %s.%s in use (radix cache backend %r, page_size=%d, "
        "disabled=%s, tp_rank=%d, share_context=%s, template=%s, boundary_recompute=%d)",
        cls.__module__, cls.__qualname__, cls.backend_name, ctx.params.page_size,
        ctx.disable_radix_cache, ctx.tp_rank, share, markers.name if markers else None,
        cache.recompute_config.boundary_tokens,
    )
    return cache
