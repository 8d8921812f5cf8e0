"""Naive reuse: the owner's cache re-positioned to the reader's positions, uncorrected."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvcmas_lab.correction.base import (
    BuildResult,
    CacheBuilder,
    ReadRequest,
    register,
    suffix_on,
)
from sglang_kvcmas_lab.delta.leaf import DeltaLeaf
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = ["NaiveReuse"]


@register("naive")
@dataclass
class NaiveReuse(CacheBuilder):
    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        views = tuple(r.rebased() for r in req.reads)
        cache, logits = suffix_on(model, KVCache.concat([req.prefix, *views]), req)
        n = model.spec.num_layers
        leaves = tuple(DeltaLeaf.empty(req.agent, r.segment_id, n) for r in req.reads)
        return BuildResult(cache, logits, views, leaves, 0, {})
