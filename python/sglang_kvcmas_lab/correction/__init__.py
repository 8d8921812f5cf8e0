"""Cache-sharing methods behind one interface (``base.CacheBuilder``) and a registry.

Importing the package registers every method: no_sharing, prefix_caching, naive, cacheblend,
kvcomm, oracle, kvcmas. ``fidelity`` holds the metrics every lab shares.
"""

from sglang_kvcmas_lab.correction import (  # noqa: F401  (registration side effects)
    cacheblend,
    dense,
    kvcmas,
    kvcomm,
    naive,
    oracle,
    prefix_caching,
)
from sglang_kvcmas_lab.correction.base import (
    BuildResult,
    CacheBuilder,
    ReadRequest,
    SharedRead,
    create_builder,
    register,
    registered,
)

__all__ = ["BuildResult", "CacheBuilder", "ReadRequest", "SharedRead", "create_builder",
           "register", "registered"]
