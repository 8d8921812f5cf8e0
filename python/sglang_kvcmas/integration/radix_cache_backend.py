"""``KvcmasRadixCache``: SGLang's Python ``RadixCache`` under our name, the base class of the
shared-context tree cache that ``--radix-cache-backend kvcmas`` builds
(``tree_cache_factory.build_shared_tree_cache``).

It adds nothing to ``RadixCache`` (token-prefix sharing only), so tests can hold the tree cache's
sharing-off behaviour against SGLang's own class.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

BACKEND_NAME = "kvcmas"
"""The name passed to ``--radix-cache-backend``."""


class KvcmasRadixCache(RadixCache):
    """SGLang's ``RadixCache`` unchanged, under the backend name ``kvcmas``.

    NOTE: keep this a plain subclass with no behaviour of its own; tests compare it against
    ``RadixCache`` and expect identical matches.
    """

    backend_name = BACKEND_NAME

    @classmethod
    def create_simulated(
        cls, disable: bool = False, mock_allocator: Any | None = None, page_size: int = 1
    ) -> KvcmasRadixCache:
        """Build one without memory pools (unit tests), like ``RadixCache.create_simulated``
        (which hard-codes ``RadixCache(...)``, so it cannot build a subclass)."""
        return cls(CacheInitParams(disable=disable, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=mock_allocator, page_size=page_size))
