"""The PReCache store pass: one forward that writes the base cache and every agent's low-rank cache.

Per layer, for the new tokens' normed input x: ``K0 = x W_k``, ``V0 = x W_v`` (base weights) and
``a = x [A_1 .. A_N]`` (all agents' A stacked: one [D, N*r] matmul for k and one for v). The pass
itself runs as ``writer``: ``None`` is the neutral pass (adapters off, attending the base cache;
PreLRShared / ReBaseShared's x), ``MEAN_AGENT`` runs the mean of all agents' adapters (a
centroid base), an agent index is that agent's own pass (it attends its own view
and its hidden states carry its adapter; LRAgent's first-reader base). The writer's own K/V are
recovered from the same products (``K0 + s a_w B_w``), so no projection is computed twice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_kvcmas_lab.correction.lora_forward import LoraForward
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT
from sglang_kvcmas_lab.correction.precache_store import LowRankKVCache
from sglang_kvcmas_lab.models.reference_llama import KVCache, keys_with_past

__all__ = ["StorePassOut", "store_pass"]


class StorePassOut(NamedTuple):
    """logits: [T, vocab] of the writer; store: the new tokens' LowRankKVCache;
    hidden: per-layer inputs [T, D] x (num_layers + 1) when asked (DroidSpeak needs them)."""

    logits: torch.Tensor
    store: LowRankKVCache
    hidden: list[torch.Tensor] | None


def _lowrank(lora: LoraForward, layer: int, target: str, x: torch.Tensor):
    if lora.adapters.num_agents == 0 or not lora.adapters.has(layer, target):
        return None
    return x @ lora.adapters.stacked_a(layer, target)


@torch.inference_mode()
def store_pass(lora: LoraForward, ids: torch.Tensor, positions: torch.Tensor,
               past_view: KVCache | None, *, writer: int | None,
               return_hidden: bool = False) -> StorePassOut:
    """Prefill ``ids: [T]`` at ``positions: [T]`` as ``writer`` on top of ``past_view`` (the
    writer's materialized view of earlier tokens), storing base + stacked low-rank caches."""
    spec, ref, ad = lora.spec, lora.ref, lora.adapters
    h = ref.embed(ids)
    hidden = [h] if return_hidden else None
    k0s, v0s, aks, avs = [], [], [], []
    for layer in range(spec.num_layers):
        blk = ref.decoder.layers[layer]
        att = blk.self_attn
        x = blk.input_layernorm(h)
        q = lora.proj(layer, "q_proj", att.q_proj, x, writer).view(-1, spec.num_heads,
                                                                      spec.head_dim)
        k0 = att.k_proj(x).view(-1, spec.num_kv_heads, spec.head_dim)
        v0 = att.v_proj(x).view(-1, spec.num_kv_heads, spec.head_dim)
        ak, av = _lowrank(lora, layer, "k_proj", x), _lowrank(lora, layer, "v_proj", x)
        k, v = k0, v0
        if writer == MEAN_AGENT:
            if ak is not None:
                k = k0 + (ak @ ad.mean_b(layer, "k_proj")).view_as(k0)
            if av is not None:
                v = v0 + (av @ ad.mean_b(layer, "v_proj")).view_as(v0)
        elif writer is not None:
            r = ad.rank
            if ak is not None:
                f = ad.get(layer, "k_proj", writer)
                k = k0 + (f.scale * (ak[:, writer * r:(writer + 1) * r] @ f.b)).view_as(k0)
            if av is not None:
                f = ad.get(layer, "v_proj", writer)
                v = v0 + (f.scale * (av[:, writer * r:(writer + 1) * r] @ f.b)).view_as(v0)
        k0s.append(k0)
        v0s.append(v0)
        aks.append(ak)
        avs.append(av)
        k_all, v_all, pos_all = keys_with_past(past_view, layer, k, v, positions)
        h = lora.finish_layer(layer, h, ref.attend(q, positions, k_all, v_all, pos_all), writer)
        if hidden is not None:
            hidden.append(h)
    store = LowRankKVCache(KVCache(k0s, v0s, positions), aks, avs)
    return StorePassOut(ref.logits(h), store, hidden)
