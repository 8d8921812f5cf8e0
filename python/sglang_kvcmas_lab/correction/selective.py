"""Layer-wise selective recompute of a reused block, with an optional per-layer correction.

The pass CacheBlend-style recompute and KVCMAS share. Over the reader's prefix, for a block of
reused tokens (the concatenated reads, base K/V re-positioned) and the suffix:

1. layer 0 for every block + suffix token (block K/V at layer 0 are prefix-free: the base's);
   this yields the exact layer-1 K/V of every block token in the reader's context;
2. ``select(ctx)`` picks block tokens from the layer-1 deviation (exact - base);
3. layers >= 1 run only for the selected tokens + suffix. At each layer >= 2 the other block
   tokens use the base K/V, optionally corrected by ``correct(ctx, layer, sel_k, sel_v)`` from
   the exact K/V the selected tokens just produced (a query at p sees keys at positions <= p).

Cost: one layer of the block + all layers of (selected + suffix). ``naive_selective`` beside it
recomputes the same thing layer by layer from the full cache, the plain way (tests compare).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama, keys_with_past

__all__ = ["BlockContext", "SelectiveOut", "naive_selective", "selective_prefill"]


@dataclass
class BlockContext:
    """What selection and correction may look at (all exact, no reference).

    base: the block's base cache at reader positions [T tokens]. dev1_k, dev1_v: [T, H_kv, d]
    layer-1 deviation (exact in the reader's context - base). seg_starts: [num_reads] offsets of
    each read in the block. sel: [n] selected block indices (sorted), set after selection.
    scratch: per-build state a correction may keep (features, fits).
    """

    base: KVCache
    dev1_k: torch.Tensor
    dev1_v: torch.Tensor
    seg_starts: torch.Tensor
    sel: torch.Tensor | None = None
    scratch: dict | None = None


Select = Callable[[BlockContext], torch.Tensor]
Correct = Callable[[BlockContext, int, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]


class SelectiveOut(NamedTuple):
    """cache: prefix + block view + suffix; last_logits: [vocab]; block_view: [T tokens];
    sel: [n] recomputed block indices; ctx: the BlockContext (for leaves / diagnostics)."""

    cache: KVCache
    last_logits: torch.Tensor
    block_view: KVCache
    sel: torch.Tensor
    ctx: BlockContext


@torch.inference_mode()
def selective_prefill(
    model: RefLlama,
    prefix: KVCache,
    block_ids: torch.Tensor,
    block_base: KVCache,
    seg_starts: torch.Tensor,
    suffix_ids: torch.Tensor,
    suffix_pos: torch.Tensor,
    select: Select,
    correct: Correct | None = None,
    scratch: dict | None = None,
) -> SelectiveOut:
    """block_ids: [T]; block_base: base K/V at reader positions [T]; suffix_ids/pos: [S].
    scratch: extra entries for ``ctx.scratch`` (e.g. an attention probe a selector reads)."""
    n_layers = model.spec.num_layers
    T = block_ids.numel()
    bpos = block_base.positions
    ids = torch.cat([block_ids, suffix_ids])
    pos = torch.cat([bpos, suffix_pos])
    has_prefix = len(prefix) > 0

    def keys(layer, k_blk, v_blk, k_suf, v_suf):
        parts_k = [prefix.k[layer], k_blk, k_suf] if has_prefix else [k_blk, k_suf]
        parts_v = [prefix.v[layer], v_blk, v_suf] if has_prefix else [v_blk, v_suf]
        kp = torch.cat([prefix.positions, pos]) if has_prefix else pos
        return torch.cat(parts_k), torch.cat(parts_v), kp

    # Layer 0: every token. Block K/V at layer 0 are the base's (prefix-free identity).
    h = model.embed(ids)
    q, k, v = model.qkv(0, h)
    k_blk, v_blk = block_base.k[0], block_base.v[0]
    kk, vv, kp = keys(0, k_blk, v_blk, k[T:], v[T:])
    h = model.finish_layer(0, h, model.attend(q, pos, kk, vv, kp))
    out_k, out_v = [k_blk], [v_blk]
    suf_k, suf_v = [k[T:]], [v[T:]]

    # Layer 1: exact K/V for every block token; select from their deviation.
    q, k, v = model.qkv(1, h)
    kk1, vv1, kp1 = keys(1, k[:T], v[:T], k[T:], v[T:])
    # Layer-1 queries of the suffix and every layer-1 key: lets a selector weigh a token's
    # deviation by the attention the suffix pays it (no extra forward work).
    ctx = BlockContext(block_base, k[:T] - block_base.k[1], v[:T] - block_base.v[1], seg_starts,
                       scratch={"q1_suffix": q[T:], "suffix_pos": suffix_pos, "k1": kk1,
                                "k1_pos": kp1, "block_offset": len(prefix), **(scratch or {})})
    sel = torch.unique(select(ctx))  # sorted
    ctx.sel = sel
    act = torch.cat([sel, torch.arange(T, T + suffix_ids.numel())])
    k_blk, v_blk = k[:T], v[:T]
    h = model.finish_layer(1, h[act], model.attend(q[act], pos[act], kk1, vv1, kp1))
    out_k.append(k_blk)
    out_v.append(v_blk)
    suf_k.append(k[T:])
    suf_v.append(v[T:])
    act_pos = pos[act]
    n_sel = sel.numel()

    for layer in range(2, n_layers):
        q, k, v = model.qkv(layer, h)
        k_blk, v_blk = block_base.k[layer], block_base.v[layer]
        if correct is not None:
            k_blk, v_blk = correct(ctx, layer, k[:n_sel], v[:n_sel])
        if n_sel:
            k_blk = k_blk.index_copy(0, sel, k[:n_sel])
            v_blk = v_blk.index_copy(0, sel, v[:n_sel])
        kk, vv, kp = keys(layer, k_blk, v_blk, k[n_sel:], v[n_sel:])
        h = model.finish_layer(layer, h, model.attend(q, act_pos, kk, vv, kp))
        out_k.append(k_blk)
        out_v.append(v_blk)
        suf_k.append(k[n_sel:])
        suf_v.append(v[n_sel:])

    logits = model.logits(h[-1:])[0]
    view = KVCache(out_k, out_v, bpos)
    suffix = KVCache(suf_k, suf_v, suffix_pos)
    cache = KVCache.concat([prefix, view, suffix]) if has_prefix else KVCache.concat([view, suffix])
    return SelectiveOut(cache, logits, view, sel, ctx)


def block_of(reads) -> tuple[torch.Tensor, KVCache, torch.Tensor]:
    """Concatenate reads into one block: (ids [T], base at reader positions, seg_starts)."""
    ids = torch.cat([r.ids for r in reads])
    base = KVCache.concat([r.rebased() for r in reads])
    lens = torch.tensor([r.ids.numel() for r in reads])
    starts = torch.cumsum(lens, 0) - lens
    return ids, base, starts


@torch.inference_mode()
def naive_selective(
    model: RefLlama,
    prefix: KVCache,
    block_ids: torch.Tensor,
    block_base: KVCache,
    suffix_ids: torch.Tensor,
    suffix_pos: torch.Tensor,
    sel: torch.Tensor,
) -> tuple[KVCache, torch.Tensor]:
    """The plain way to compute what ``selective_prefill`` computes for a fixed selection.

    Every block + suffix token runs through every layer; the block K/V attention reads are the
    base's at layer 0, the exact ones at layer 1, and at layers >= 2 the base's except on ``sel``
    ([n] block indices). Returns (prefix + view + suffix cache, last logits [vocab]).
    """
    T = block_ids.numel()
    ids = torch.cat([block_ids, suffix_ids])
    pos = torch.cat([block_base.positions, suffix_pos])
    h = model.embed(ids)
    ks, vs = [], []
    for layer in range(model.spec.num_layers):
        q, k, v = model.qkv(layer, h)
        if layer != 1:
            keep = torch.ones(T, dtype=torch.bool)
            keep[sel] = layer == 0  # layer 0: base everywhere (prefix-free, equal to exact)
            k = torch.cat([torch.where(keep[:, None, None], block_base.k[layer], k[:T]), k[T:]])
            v = torch.cat([torch.where(keep[:, None, None], block_base.v[layer], v[:T]), v[T:]])
        ks.append(k)
        vs.append(v)
        kk, vv, kp = keys_with_past(prefix, layer, k, v, pos)
        h = model.finish_layer(layer, h, model.attend(q, pos, kk, vv, kp))
    cache = KVCache.concat([prefix, KVCache(ks, vs, pos)]) if len(prefix) else KVCache(ks, vs, pos)
    return cache, model.logits(h[-1:])[0]
