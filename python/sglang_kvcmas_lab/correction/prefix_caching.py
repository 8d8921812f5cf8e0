"""SGLang prefix caching: only identical prefixes are reused.

With a per-agent head in front of the transcript, an agent reuses only its own earlier turns and
prefills every segment other agents produced since, exactly. It persists one full private copy
of what it read (counted as a leaf overriding every token in every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas_lab.correction.base import (
    BuildResult,
    CacheBuilder,
    ReadRequest,
    register,
    split_views,
)
from sglang_kvcmas_lab.delta.leaf import DeltaLeaf, TokenOverride
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = ["PrefixCaching", "full_copy_leaf"]


def full_copy_leaf(agent: str, segment_id: int, view: KVCache) -> DeltaLeaf:
    """A leaf that stores every token of ``view`` exactly (what a private copy costs)."""
    idx = torch.arange(len(view))
    ov = tuple(TokenOverride(idx, k, v) for k, v in zip(view.k, view.v))
    none = (None,) * view.num_layers
    return DeltaLeaf(agent, segment_id, none, none, ov)


@register("prefix_caching")
@dataclass
class PrefixCaching(CacheBuilder):
    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        ids = torch.cat([*(r.ids for r in req.reads), req.suffix_ids])
        out = model.forward(ids, past=req.prefix)
        cache = KVCache.concat([req.prefix, out.kv])
        views = split_views(cache, req)
        leaves = tuple(full_copy_leaf(req.agent, r.segment_id, v) for r, v in zip(req.reads, views))
        return BuildResult(cache, out.logits[-1], views, leaves, req.num_read_tokens, {})
