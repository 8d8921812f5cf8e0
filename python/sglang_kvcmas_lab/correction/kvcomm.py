"""KVCOMM-style anchors (baseline, after arXiv 2510.12872).

Anchors per template slot. An anchor stores the slot's base K/V (the owner's, pre-RoPE) and, per
agent, the dense delta real - base, where "real" comes from a dense reference prefill of that
agent's whole prompt. A reader of a new segment in a slot weights the slot's anchors per token by
a softmax over negative distances between the new base and each anchor's base, and adds the
weighted deltas (layer 0 left exact). It falls back to a dense prefill of its prompt (counted in
its TTFT; the result becomes a new anchor) when fewer than two anchors hold a delta for it or the
weights are too flat (mean entropy > gamma * log2(#anchors)). Pool cap per slot; evict the least
used of the oldest five.

Simplification (documented): a fallback records the delta of the agent that fell back only; other
agents add theirs when they fall back on the same segment (KVCOMM prefills every agent at once).
Tokens of an anchor shorter than the new segment are matched to its last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sglang_kvcmas_lab.correction.base import (
    BuildResult,
    CacheBuilder,
    ReadRequest,
    register,
    split_views,
    suffix_on,
)
from sglang_kvcmas_lab.delta.leaf import tensors_nbytes
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = ["Anchor", "KvcommAnchors"]


@dataclass
class Anchor:
    """tokens: the slot content (anchor identity); base: its base K/V [T_a tokens]; deltas: agent -> (k, v) per layer
    [T_a, H_kv, d] dense; key: [T_a, F] distance features; uses: times it was used."""

    tokens: tuple[int, ...]
    base: KVCache
    key: torch.Tensor
    deltas: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    uses: int = 0

    def tensors(self):
        out = [*self.base.k, *self.base.v, self.key]
        for ks, vs in self.deltas.values():
            out.extend(ks)
            out.extend(vs)
        return out


def _key(base: KVCache) -> torch.Tensor:
    """Distance features per token: layer-1 pre-RoPE K and V (context-dependent, cheap)."""
    return torch.cat([base.k[1].flatten(1), base.v[1].flatten(1)], dim=1)


@register("kvcomm")
@dataclass
class KvcommAnchors(CacheBuilder):
    gamma: float = 0.3
    pool_cap: int = 20
    pools: dict[str, list[Anchor]] = field(default_factory=dict)

    def state_nbytes(self) -> int:
        return tensors_nbytes(t for pool in self.pools.values() for a in pool
                              for t in a.tensors())

    def _weights(self, key: torch.Tensor, anchors: list[Anchor]) -> torch.Tensor:
        """[T, A] softmax over anchors of -distance, per token of the new segment."""
        T = key.shape[0]
        dists = []
        for a in anchors:
            idx = torch.clamp(torch.arange(T), max=a.key.shape[0] - 1)
            dists.append((key - a.key[idx]).norm(dim=1))
        d = torch.stack(dists, dim=1)
        return torch.softmax(-d, dim=1)

    def _estimate(self, agent: str, read, anchors: list[Anchor], w: torch.Tensor) -> KVCache:
        T = read.ids.numel()
        ks, vs = [read.base.k[0]], [read.base.v[0]]
        for layer in range(1, read.base.num_layers):
            dk = torch.zeros_like(read.base.k[layer])
            dv = torch.zeros_like(read.base.v[layer])
            for j, a in enumerate(anchors):
                idx = torch.clamp(torch.arange(T), max=len(a.base) - 1)
                ak, av = a.deltas[agent]
                dk += w[:, j, None, None] * ak[layer][idx]
                dv += w[:, j, None, None] * av[layer][idx]
            ks.append(read.base.k[layer] + dk)
            vs.append(read.base.v[layer] + dv)
        return KVCache(ks, vs, read.positions)

    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        views, fallback = [], False
        for r in req.reads:
            pool = [a for a in self.pools.get(r.slot, []) if req.agent in a.deltas]
            if len(pool) < 2:
                fallback = True
                break
            w = self._weights(_key(r.base), pool)
            ent = -(w * torch.log2(w.clamp_min(1e-30))).sum(1).mean()
            if float(ent) > self.gamma * math.log2(len(pool)):
                fallback = True
                break
            for j, a in enumerate(pool):
                a.uses += int((w[:, j] > 1.0 / len(pool)).any())
            views.append(self._estimate(req.agent, r, pool, w))
        if fallback:
            out = model.forward(req.all_ids())
            views = split_views(out.kv, req)
            for r, v in zip(req.reads, views):
                self._record(req.agent, r, v)
            return BuildResult(out.kv, out.logits[-1], views, (), req.num_read_tokens,
                               {"fallback": 1})
        cache, logits = suffix_on(model, KVCache.concat([req.prefix, *views]), req)
        return BuildResult(cache, logits, tuple(views), (), 0, {"fallback": 0})

    def _record(self, agent: str, r, view: KVCache) -> None:
        pool = self.pools.setdefault(r.slot, [])
        tokens = tuple(int(t) for t in r.ids)
        anchor = next((a for a in pool if a.tokens == tokens), None)
        if anchor is None:
            if len(pool) >= self.pool_cap:
                oldest = pool[:5]
                pool.remove(min(oldest, key=lambda a: a.uses))
            anchor = Anchor(tokens, r.base, _key(r.base))
            pool.append(anchor)
        anchor.deltas[agent] = ([k - b for k, b in zip(view.k, r.base.k)],
                                [v - b for v, b in zip(view.v, r.base.v)])
