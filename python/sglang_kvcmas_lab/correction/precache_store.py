"""PReCache's shared state: one base cache plus every agent's thin low-rank cache.

For a shared token with layer input x (after the layer's input norm), agent i's pre-RoPE key and
value are ``K_i = x W_k + s (x A_k,i) B_k,i`` and ``V_i = x W_v + s (x A_v,i) B_v,i``. The store
keeps ``K0 = x W_k``, ``V0 = x W_v`` once and ``a_k = x [A_k,1 .. A_k,N]``,
``a_v = x [A_v,1 .. A_v,N]`` (r numbers per agent per token instead of H_kv * d). Which x the
store was computed from (adapter-free, or the first reader's) is the method's business.

``view(i)`` materializes agent i's K/V (the naive read); ``precache_read`` reads without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT, AdapterSet
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["KEY_MODES", "LowRankKVCache"]

# How an agent's keys are read: "lowrank" K0 + s a_k B_k (exact for the store's x);
# "base" K0 only (LRAgent's code: keys stay shared, only values are decomposed).
KEY_MODES = ("lowrank", "base")


@dataclass
class LowRankKVCache:
    """base: pre-RoPE K0/V0 + positions, num_layers x [T, H_kv, d].
    a_k, a_v: num_layers x ([T, num_agents * r] or None where the target is not adapted).
    """

    base: KVCache
    a_k: list[torch.Tensor | None]
    a_v: list[torch.Tensor | None]

    def __len__(self) -> int:
        return len(self.base)

    @classmethod
    def concat(cls, parts: list[LowRankKVCache]) -> LowRankKVCache:
        parts = [p for p in parts if len(p)] or parts[:1]
        n = parts[0].base.num_layers

        def cat(xs):
            return None if xs[0] is None else torch.cat(xs)

        return cls(KVCache.concat([p.base for p in parts]),
                   [cat([p.a_k[i] for p in parts]) for i in range(n)],
                   [cat([p.a_v[i] for p in parts]) for i in range(n)])

    def slice(self, start: int, end: int) -> LowRankKVCache:
        def sl(x):
            return None if x is None else x[start:end]

        return LowRankKVCache(self.base.slice(start, end), [sl(a) for a in self.a_k],
                              [sl(a) for a in self.a_v])

    def agent_a(self, layer: int, which: str, agent: int, rank: int) -> torch.Tensor | None:
        """[T, r]: agent's columns of a_k / a_v at ``layer``."""
        a = (self.a_k if which == "k" else self.a_v)[layer]
        return None if a is None else a[:, agent * rank : (agent + 1) * rank]

    def view(self, adapters: AdapterSet, agent: int | None, *, keys: str = "lowrank") -> KVCache:
        """Agent's materialized pre-RoPE K/V (None: the base itself). The naive read."""
        if keys not in KEY_MODES:
            raise ValueError(f"keys must be one of {KEY_MODES}")
        if agent is None:
            return self.base
        if agent == MEAN_AGENT:
            return self._mean_view(adapters, keys)
        ks, vs = [], []
        r = adapters.rank
        for layer in range(self.base.num_layers):
            k0, v0 = self.base.k[layer], self.base.v[layer]
            shape = k0.shape
            ak, av = self.agent_a(layer, "k", agent, r), self.agent_a(layer, "v", agent, r)
            fk, fv = adapters.get(layer, "k_proj", agent), adapters.get(layer, "v_proj", agent)
            if keys == "lowrank" and ak is not None:
                k0 = k0 + (fk.scale * (ak @ fk.b)).view(shape)
            if av is not None:
                v0 = v0 + (fv.scale * (av @ fv.b)).view(shape)
            ks.append(k0)
            vs.append(v0)
        return KVCache(ks, vs, self.base.positions)

    def _mean_view(self, adapters: AdapterSet, keys: str) -> KVCache:
        """K/V under the mean of all agents' adapters (what a MEAN_AGENT pass attends to)."""
        ks, vs = [], []
        for layer in range(self.base.num_layers):
            k, v = self.base.k[layer], self.base.v[layer]
            if keys == "lowrank" and self.a_k[layer] is not None:
                k = k + (self.a_k[layer] @ adapters.mean_b(layer, "k_proj")).view_as(k)
            if self.a_v[layer] is not None:
                v = v + (self.a_v[layer] @ adapters.mean_b(layer, "v_proj")).view_as(v)
            ks.append(k)
            vs.append(v)
        return KVCache(ks, vs, self.base.positions)

    def nbytes(self) -> int:
        low = sum(a.numel() * a.element_size() for a in (*self.a_k, *self.a_v) if a is not None)
        return self.base.nbytes() + low

    def lowrank_nbytes(self) -> int:
        return self.nbytes() - self.base.nbytes()
