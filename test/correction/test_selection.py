"""Token selection: boundary tokens always kept, sizes honoured, impact uses suffix attention."""

from __future__ import annotations

import torch
from conftest import make_request

from sglang_kvcmas.correction.selection import select_tokens, suffix_attention
from sglang_kvcmas.correction.selective import block_of, selective_prefill


def context(tiny):
    req, _, _ = make_request(tiny, seg_lens=(30, 20))
    ids, base, starts = block_of(req.reads)
    seen = {}

    def grab(ctx):
        seen["ctx"] = ctx
        return torch.arange(0)

    selective_prefill(tiny, req.prefix, ids, base, starts, req.suffix_ids,
                      req.suffix_positions(), grab)
    return seen["ctx"]


def test_boundaries_and_budget(tiny):
    ctx = context(tiny)
    for score in ("v", "kv", "impact"):
        sel = select_tokens(ctx, 0.2, 3, score, num_last=2, theta=tiny.spec.rope_theta)
        assert sel.unique().numel() == sel.numel() == 3 + 3 + 2 + 10
        assert {0, 1, 2, 30, 31, 32, 48, 49} <= set(sel.tolist())


def test_suffix_attention_is_a_partial_distribution(tiny):
    ctx = context(tiny)
    att = suffix_attention(ctx, tiny.spec.rope_theta)
    assert att.shape == (50, tiny.spec.num_kv_heads)
    assert (att >= 0).all() and (att.sum(0) <= 1 + 1e-9).all() and att.sum() > 0
