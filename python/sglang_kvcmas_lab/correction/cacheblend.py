"""CacheBlend-style selective recompute (baseline).

Layers 0-1 in full for every reused token; rank tokens by value deviation at layer 1 and
recompute only the top-rho fraction (plus the suffix) in deeper layers; the rest keep the base's
K/V re-positioned. Persists the layer-1 K/V of every token and the recomputed tokens' K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas_lab.correction.base import BuildResult, CacheBuilder, ReadRequest, register
from sglang_kvcmas_lab.correction.selective import BlockContext, block_of, selective_prefill
from sglang_kvcmas_lab.delta.leaf import DeltaLeaf, TokenOverride
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = ["CacheBlend", "leaves_from_view", "split_block"]


def top_value_deviation(ctx: BlockContext, rho: float) -> torch.Tensor:
    """Indices of the ceil(rho * T) block tokens with the largest layer-1 value deviation."""
    T = ctx.dev1_v.shape[0]
    n = min(T, int(round(rho * T)))
    score = ctx.dev1_v.flatten(1).norm(dim=1)
    return torch.topk(score, n).indices if n else torch.empty(0, dtype=torch.long)


def split_block(view: KVCache, reads) -> tuple[KVCache, ...]:
    out, start = [], 0
    for r in reads:
        out.append(view.slice(start, start + r.ids.numel()))
        start += r.ids.numel()
    return tuple(out)


def leaves_from_view(agent, reads, view: KVCache, sel: torch.Tensor, factors=None):
    """Per-read leaves: layer 1 exact for every token, layers >= 2 exact on ``sel`` (+ factors).

    factors: optional per-read (k, v) tuples of per-layer LowRankFactors for unselected tokens.
    """
    leaves, start = [], 0
    n_layers = view.num_layers
    for i, r in enumerate(reads):
        T = r.ids.numel()
        local = sel[(sel >= start) & (sel < start + T)] - start
        ov = [None, TokenOverride(torch.arange(T), view.k[1][start:start + T],
                                  view.v[1][start:start + T])]
        for layer in range(2, n_layers):
            if local.numel():
                g = local + start
                ov.append(TokenOverride(local, view.k[layer][g], view.v[layer][g]))
            else:
                ov.append(None)
        fk, fv = factors[i] if factors is not None else ((None,) * n_layers, (None,) * n_layers)
        leaves.append(DeltaLeaf(agent, r.segment_id, tuple(fk), tuple(fv), tuple(ov)))
        start += T
    return tuple(leaves)


@register("cacheblend")
@dataclass
class CacheBlend(CacheBuilder):
    rho: float = 0.15

    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        ids, base, starts = block_of(req.reads)
        out = selective_prefill(model, req.prefix, ids, base, starts, req.suffix_ids,
                                req.suffix_positions(), lambda c: top_value_deviation(c, self.rho))
        leaves = leaves_from_view(req.agent, req.reads, out.block_view, out.sel)
        return BuildResult(out.cache, out.last_logits, split_block(out.block_view, req.reads),
                           leaves, int(out.sel.numel()), {"rho": self.rho})
