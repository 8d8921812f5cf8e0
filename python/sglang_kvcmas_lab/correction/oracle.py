"""Oracle rank-r: truncated SVD of the true deviation (needs the reader's dense reference).

The ceiling of any rank-r correction: per layer >= 1 and KV head, the best rank-r approximation
of (reference - base) on pre-RoPE keys and on values. Its TTFT excludes the reference prefill it
cheats with; it is a bound, not a method.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvcmas_lab.correction.base import (
    BuildResult,
    CacheBuilder,
    ReadRequest,
    register,
    suffix_on,
)
from sglang_kvcmas_lab.delta.leaf import DeltaLeaf, svd_factors
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = ["OracleLowRank"]


@register("oracle")
@dataclass
class OracleLowRank(CacheBuilder):
    rank: int = 8

    def __post_init__(self):
        self.needs_reference = True

    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        if req.reference is None:
            raise ValueError("the oracle needs req.reference")
        views, leaves = [], []
        for r, ref in zip(req.reads, req.reference, strict=True):
            ks, vs = [None], [None]
            for layer in range(1, r.base.num_layers):
                ks.append(svd_factors(ref.k[layer] - r.base.k[layer], self.rank))
                vs.append(svd_factors(ref.v[layer] - r.base.v[layer], self.rank))
            leaf = DeltaLeaf(req.agent, r.segment_id, tuple(ks), tuple(vs),
                             (None,) * r.base.num_layers)
            leaves.append(leaf)
            views.append(leaf.apply(r.base).with_positions(r.positions))
        cache, logits = suffix_on(model, KVCache.concat([req.prefix, *views]), req)
        return BuildResult(cache, logits, tuple(views), tuple(leaves), 0, {"rank": self.rank})
