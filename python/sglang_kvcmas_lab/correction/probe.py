"""Attention probe: where the reader's suffix attends, layer by layer, over the uncorrected cache.

A selector that only sees layer 1 (``selection.py``'s "impact") misses what deep layers attend:
on short debate segments its picks overlap the tokens that matter in deep layers far less than on
long essays. The probe runs the suffix once through every layer over prefix + the block's base
(what naive reuse would build) and records, per layer, the attention mass the suffix's queries put
on each block token. It uses no reference: only the base, the reader's prefix and its suffix.

Cost: one naive suffix pass (the suffix is a few tokens; attention over the whole context), i.e.
naive reuse's build time again; it is part of the reader's TTFT.
"""

from __future__ import annotations

import math

import torch

from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama, rotate

__all__ = ["suffix_attention_profile"]


@torch.inference_mode()
def suffix_attention_profile(model: RefLlama, prefix: KVCache, block: KVCache,
                             suffix_ids: torch.Tensor, suffix_pos: torch.Tensor) -> torch.Tensor:
    """[num_layers, T] attention mass on each block token, summed over suffix queries and averaged
    over query heads, from a suffix pass over ``prefix | block`` (block: base at reader positions,
    [T tokens]); suffix_ids, suffix_pos: [S]. Rows sum to at most S."""
    s = model.spec
    past = KVCache.concat([prefix, block]) if len(prefix) else block
    P, T = len(prefix), len(block)
    group = s.num_heads // s.num_kv_heads
    kp = torch.cat([past.positions, suffix_pos])
    mask = kp[None, None, :] > suffix_pos[None, :, None]  # [1, S, K]
    h = model.embed(suffix_ids)
    rows = []
    for layer in range(s.num_layers):
        q, k, v = model.qkv(layer, h)
        kk, vv = torch.cat([past.k[layer], k]), torch.cat([past.v[layer], v])
        qr = rotate(q, suffix_pos, s.rope_theta).transpose(0, 1)  # [H, S, d]
        kr = rotate(kk, kp, s.rope_theta).repeat_interleave(group, dim=1).transpose(0, 1)
        logits = (qr @ kr.transpose(1, 2) / math.sqrt(s.head_dim)).masked_fill(mask, -math.inf)
        probs = torch.softmax(logits, dim=-1)  # [H, S, K]
        rows.append(probs[:, :, P:P + T].mean(dim=0).sum(dim=0))
        vr = vv.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, d]
        attn = (probs @ vr).transpose(0, 1).reshape(q.shape[0], s.num_heads * s.head_dim)
        h = model.finish_layer(layer, h, attn)
    return torch.stack(rows)
