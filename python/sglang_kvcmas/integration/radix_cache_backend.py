"""The ``kvcmas`` radix cache backend: our tree cache, selected with ``--radix-cache-backend``.

For now it behaves exactly like SGLang's Python ``RadixCache`` (token-prefix sharing only); it
exists so that the server runs *our* class from day one, and so that the agent-aware shared tree
(issue 6) can replace its internals without touching the launcher, registration or tests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvcmas"
"""The name passed to ``--radix-cache-backend``."""


class KvcmasRadixCache(RadixCache):
    """sglang-kvcmas's tree cache. Today: SGLang's ``RadixCache`` unchanged.

    NOTE: keep this a plain subclass with no behaviour of its own until the shared-context tree
    lands; tests compare it against ``RadixCache`` and expect identical matches.
    """

    backend_name = BACKEND_NAME

    @classmethod
    def create_simulated(
        cls,
        disable: bool = False,
        mock_allocator: Any | None = None,
        page_size: int = 1,
    ) -> KvcmasRadixCache:
        """Build one without memory pools (unit tests), like ``RadixCache.create_simulated``.

        SGLang's classmethod hard-codes ``RadixCache(...)``, so it cannot build a subclass.
        """
        return cls(
            CacheInitParams(
                disable=disable,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=mock_allocator,
                page_size=page_size,
            )
        )


def build_kvcmas_cache(ctx: TreeCacheBuildContext) -> KvcmasRadixCache:
    """Factory registered under ``"kvcmas"``: SGLang calls it once per scheduler (TP rank).

    Raises:
        ValueError: for model or cache features the Python radix tree does not implement
            (hybrid sliding-window or state-space models, hierarchical cache); SGLang's default
            backend handles those, so the message says to drop ``--radix-cache-backend``.
    """
    unsupported = [
        flag
        for flag, on in (
            ("hybrid sliding-window attention", ctx.is_hybrid_swa),
            ("hybrid state-space (mamba) layers", ctx.is_hybrid_ssm),
            ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
            ("DSA sparse attention", ctx.is_dsa),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} does not support {', '.join(unsupported)} "
            "yet; run without --radix-cache-backend to use SGLang's default tree cache."
        )
    cache = KvcmasRadixCache(ctx.params)
    logger.info(
        "sglang-kvcmas: tree cache %s.%s in use (radix cache backend %r, page_size=%d, "
        "disabled=%s, tp_rank=%d)",
        type(cache).__module__,
        type(cache).__qualname__,
        BACKEND_NAME,
        ctx.params.page_size,
        ctx.disable_radix_cache,
        ctx.tp_rank,
    )
    return cache
