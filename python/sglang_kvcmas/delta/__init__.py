"""Per-agent delta leaves (low-rank factors + exact token overrides) and their store."""

from sglang_kvcmas.delta.leaf import (
    DeltaLeaf,
    LowRankFactors,
    TokenOverride,
    svd_factors,
    tensors_nbytes,
)
from sglang_kvcmas.delta.store import DeltaStore

__all__ = ["DeltaLeaf", "DeltaStore", "LowRankFactors", "TokenOverride", "svd_factors",
           "tensors_nbytes"]
