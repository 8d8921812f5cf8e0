"""Token selection: boundary tokens always kept, sizes honoured, impact uses suffix attention,
attn uses the deep-layer attention probe."""

from __future__ import annotations

import pytest
import torch
from conftest import make_request

from sglang_kvcmas_lab.correction.probe import suffix_attention_profile
from sglang_kvcmas_lab.correction.selection import select_tokens, suffix_attention
from sglang_kvcmas_lab.correction.selective import block_of, selective_prefill


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
    ctx.scratch["attn_profile"] = torch.rand(tiny.spec.num_layers, 50, dtype=torch.float64)
    for score in ("v", "kv", "impact", "attn", "attn_v"):
        sel = select_tokens(ctx, 0.2, 3, score, num_last=2, theta=tiny.spec.rope_theta)
        assert sel.unique().numel() == sel.numel() == 3 + 3 + 2 + 10
        assert {0, 1, 2, 30, 31, 32, 48, 49} <= set(sel.tolist())


def test_suffix_attention_is_a_partial_distribution(tiny):
    ctx = context(tiny)
    att = suffix_attention(ctx, tiny.spec.rope_theta)
    assert att.shape == (50, tiny.spec.num_kv_heads)
    assert (att >= 0).all() and (att.sum(0) <= 1 + 1e-9).all() and att.sum() > 0


def test_attention_probe_is_the_naive_suffix_pass(tiny):
    """The probe's rows are the suffix's attention mass on the block: at most S per layer, and
    with nothing before or after the block (no prefix) plus the suffix itself, exactly S."""
    req, _, _ = make_request(tiny, seg_lens=(30, 20))
    ids, base, starts = block_of(req.reads)
    S = req.suffix_ids.numel()
    prof = suffix_attention_profile(tiny, req.prefix, base, req.suffix_ids, req.suffix_positions())
    assert prof.shape == (tiny.spec.num_layers, 50)
    assert (prof >= 0).all() and (prof.sum(1) <= S + 1e-9).all()
    no_prefix = suffix_attention_profile(tiny, req.prefix.slice(0, 0), base, req.suffix_ids,
                                         req.suffix_positions())
    assert (no_prefix.sum(1) < S).all()  # the rest sits on the suffix's own keys


def test_attn_score_ranks_by_deep_attention(tiny):
    ctx = context(tiny)
    prof = torch.zeros(tiny.spec.num_layers, 50, dtype=torch.float64)
    prof[3, [7, 41, 44]] = torch.tensor([0.5, 0.9, 0.7], dtype=torch.float64)
    prof[1, 20] = 5.0  # layer 1 is not "deep": ignored
    ctx.scratch["attn_profile"] = prof
    sel = select_tokens(ctx, 0.06, 0, "attn", theta=tiny.spec.rope_theta)
    assert set(sel.tolist()) == {7, 41, 44}
    del ctx.scratch["attn_profile"]
    with pytest.raises(ValueError, match="probe"):
        select_tokens(ctx, 0.06, 0, "attn", theta=tiny.spec.rope_theta)
