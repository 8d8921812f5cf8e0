"""The delta attention backend's span transform equals the kernels issue's torch reference."""

from __future__ import annotations

import torch

from sglang_kvcmas.attention.batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors
from sglang_kvcmas.attention.reference import reader_kv
from sglang_kvcmas.attention.rope import apply_rope, rope_inv_freq
from sglang_kvcmas.integration.delta_attention_backend import transform_spans
from sglang_kvcmas.integration.span_registry import RowSpans, SpanRead


def test_shift_equals_reference_and_recomputation():
    torch.manual_seed(0)
    inv = rope_inv_freq(64, 1e5)
    pool_k, pool_v = torch.randn(50, 3, 64), torch.randn(50, 3, 64)
    idx = torch.randperm(50)[:30]
    spans = (SharedSpan(4, 9, shift=-7), SharedSpan(13, 5, shift=11))
    k, v = transform_spans(pool_k[idx].clone(), pool_v[idx].clone(),
                           RowSpans("r", tuple(SpanRead(s) for s in spans)), 0, inv, {})
    ref_k, ref_v = reader_kv(pool_k, pool_v, DeltaRequest(idx, 3, spans), None, inv)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, ref_v)
    # a key rotated at owner position p, shifted by d, equals the key rotated at p + d
    raw = torch.randn(9, 3, 64)
    owner = apply_rope(raw, torch.arange(20, 29), inv)
    row = RowSpans("r", (SpanRead(SharedSpan(0, 9, shift=-15)),))
    shifted, _ = transform_spans(owner.clone(), torch.zeros(9, 3, 64), row, 0, inv)
    torch.testing.assert_close(shifted, apply_rope(raw, torch.arange(5, 14), inv), atol=1e-4,
                               rtol=1e-4)


def test_deltas_match_reference():
    torch.manual_seed(1)
    inv = rope_inv_freq(64, 1e5)
    pool_k, pool_v = torch.randn(40, 3, 64), torch.randn(40, 3, 64)
    idx = torch.arange(20)
    span = SharedSpan(2, 8, shift=5)
    f = SpanFactors(LowRankDelta(torch.randn(8, 3, 4), torch.randn(3, 64, 4)),
                    LowRankDelta(torch.randn(8, 3, 4), torch.randn(3, 64, 4)))
    row = RowSpans("r", (SpanRead(span, factors=lambda layer: f),))
    k, v = transform_spans(pool_k[idx].clone(), pool_v[idx].clone(), row, 3, inv)
    ref_k, ref_v = reader_kv(pool_k, pool_v, DeltaRequest(idx, 2, (span,)), [f], inv)
    torch.testing.assert_close(k, ref_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, ref_v, atol=1e-4, rtol=1e-4)
