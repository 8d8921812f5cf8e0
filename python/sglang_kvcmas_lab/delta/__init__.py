"""Per-agent low-rank delta leaves of the lab (factors of the K/V deviation + exact overrides)."""

from sglang_kvcmas_lab.delta.leaf import (
    DeltaLeaf,
    LowRankFactors,
    TokenOverride,
    svd_factors,
    tensors_nbytes,
)

__all__ = ["DeltaLeaf", "LowRankFactors", "TokenOverride", "svd_factors", "tensors_nbytes"]
