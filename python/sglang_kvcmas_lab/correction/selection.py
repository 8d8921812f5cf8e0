"""Which shared tokens a reader recomputes exactly (policy over layer-1 signals).

All scores use only what the layer-0 pass of ``selective.py`` yields for every block token: the
exact layer-1 deviation (exact - base) and the suffix's layer-1 queries. Scores, larger = more
worth recomputing:

- "v":      ||dev1_v[t]|| (CacheBlend's signal);
- "kv":     relative K + V deviation at layer 1;
- "impact": sum over KV heads of (attention the suffix pays t at layer 1) * ||dev1_v[t, h]||
            -- the first-order change of the suffix's layer-1 attention output due to token t;
- "attn":   attention mass the suffix pays t in layers >= 2 over the uncorrected cache, from
            ``probe.suffix_attention_profile`` (``ctx.scratch["attn_profile"]``: [L, T]);
- "attn_v": "attn" * ||dev1_v[t]|| (deep attention weighted by the layer-1 deviation).
Always kept: the first ``num_first`` tokens of every segment (boundary/sink tokens, where the
deviation concentrates) and the last ``num_last`` tokens of the block (what the suffix attends).

These signals need a reference pass the server does not have; the served selector, which needs
none (span boundaries and the owner's recorded head mass), is ``sglang_kvcmas.policy.recompute``.
"""

from __future__ import annotations

import math

import torch

from sglang_kvcmas_lab.correction.selective import BlockContext
from sglang_kvcmas_lab.models.reference_llama import rotate

__all__ = ["PROBED", "SCORES", "select_tokens", "suffix_attention"]

SCORES = ("v", "kv", "impact", "attn", "attn_v")
PROBED = ("attn", "attn_v")  # scores that need the attention probe


def suffix_attention(ctx: BlockContext, theta: float) -> torch.Tensor:
    """[T, H_kv]: mean attention probability the suffix's layer-1 queries put on each block token
    (query heads averaged within their KV group)."""
    sc = ctx.scratch
    q, qp, k, kp = sc["q1_suffix"], sc["suffix_pos"], sc["k1"], sc["k1_pos"]
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[2]
    qr = rotate(q, qp, theta).transpose(0, 1)  # [H, S, d]
    kr = rotate(k, kp, theta).repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, K, d]
    logits = qr @ kr.transpose(1, 2) / math.sqrt(d)
    logits = logits.masked_fill(kp[None, None, :] > qp[None, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).mean(dim=1)  # [H, K]
    T = ctx.dev1_v.shape[0]
    off = sc["block_offset"]
    blk = probs[:, off:off + T].T  # [T, H]
    return blk.view(T, Hkv, H // Hkv).mean(dim=2)


def token_scores(ctx: BlockContext, score: str, theta: float) -> torch.Tensor:
    if score == "v":
        return ctx.dev1_v.flatten(1).norm(dim=1)
    if score == "kv":
        return (ctx.dev1_v.flatten(1).norm(dim=1) / ctx.base.v[1].flatten(1).norm(dim=1)
                + ctx.dev1_k.flatten(1).norm(dim=1) / ctx.base.k[1].flatten(1).norm(dim=1))
    if score == "impact":
        return (suffix_attention(ctx, theta) * ctx.dev1_v.norm(dim=2)).sum(dim=1)
    if score in PROBED:
        if "attn_profile" not in (ctx.scratch or {}):
            raise ValueError(f"score {score!r} needs scratch['attn_profile'] (the probe)")
        deep = ctx.scratch["attn_profile"][2:].sum(dim=0).to(ctx.dev1_v.dtype)
        return deep if score == "attn" else deep * ctx.dev1_v.flatten(1).norm(dim=1)
    raise ValueError(f"score must be one of {SCORES}")


def select_tokens(ctx: BlockContext, rho: float, num_first: int, score: str, *,
                  num_last: int = 0, theta: float = 1e4) -> torch.Tensor:
    """Indices (unsorted) of the kept tokens plus the top ``rho * T`` of the rest by ``score``."""
    T = ctx.dev1_v.shape[0]
    keep = [torch.arange(int(s), min(int(s) + num_first, T)) for s in ctx.seg_starts]
    if num_last:
        keep.append(torch.arange(max(0, T - num_last), T))
    keep = torch.unique(torch.cat(keep)) if keep else torch.empty(0, dtype=torch.long)
    s = token_scores(ctx, score, theta).clone()
    s[keep] = -float("inf")
    n = min(T - keep.numel(), int(round(rho * T)))
    top = torch.topk(s, n).indices if n > 0 else keep[:0]
    return torch.cat([keep, top])
