"""Query-rotation decode equals the reference: rotate the borrowed keys, then SDPA."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.rope import ShiftRope, rope_inv_freq
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.span_reads import rotate_keys, transform_spans
from sglang_kvcmas.attention.spans import BatchRow, KeyShifts, RowSpans, SharedSpan


def test_key_shifts_of_a_row_put_zero_first_and_keep_runs():
    ks = KeyShifts.of_row(2, torch.tensor([3, 3, 0, -5, -5, 3]))
    assert ks.shifts.tolist() == [0, -5, 3]
    assert ks.index.tolist() == [0, 0, 2, 2, 0, 1, 1, 2]
    assert ks.index_upto(10).tolist() == [0, 0, 2, 2, 0, 1, 1, 2, 0, 0]
    assert ks.spans() == (SharedSpan(2, 2, 3), SharedSpan(5, 2, -5), SharedSpan(7, 1, 3))
    assert KeyShifts.of_spans(ks.spans()).spans() == ks.spans()
    assert not KeyShifts.of_row(4, torch.zeros(6, dtype=torch.int64)).any


def test_grouped_order_is_a_permutation_with_one_group_per_shift():
    ks = KeyShifts.of_row(2, torch.tensor([3, 3, 0, -5, -5, 3]))
    order, groups = ks.grouped(10)
    assert sorted(order.tolist()) == list(range(10))
    index = ks.index_upto(10)
    for lo, hi, i in groups:
        assert (index[order[lo:hi]] == i).all()
    assert groups[-1] == (5, 10, 0) and order[-2:].tolist() == [8, 9]  # own tokens last
    with pytest.raises(ValueError, match="shorter"):
        ks.grouped(5)


CASES = [
    # n_kv, heads, kv heads, spans (start, length, shift)
    (1, 3, 3, []),
    (17, 9, 3, [(2, 7, -5)]),
    (130, 6, 2, [(5, 40, 11), (45, 50, -29), (95, 35, 11)]),
    (257, 4, 1, [(0, 100, 3), (100, 1, -1), (200, 80, 250)]),  # last span clipped by n_kv
    # exact leaves scattered through borrowed spans: a hundred runs, two owners
    (987, 9, 3, [(100 + 9 * j, 8, -40 if j % 3 else 17) for j in range(90)]),
]


@pytest.mark.parametrize("n_kv,h,hkv,spans", CASES)
def test_grouped_decode_equals_rotated_keys(n_kv, h, hkv, spans):
    torch.manual_seed(n_kv)
    d, inv = 64, rope_inv_freq(64, 1e5)
    q = torch.randn(h, 1, d)
    k, v = torch.randn(n_kv, hkv, d), torch.randn(n_kv, hkv, d)
    row = RowSpans.of_reads("r", tuple(SharedSpan(*s) for s in spans))
    k_ref, v_ref = transform_spans(k.clone(), row, inv), v
    ref = scaled_dot_product_attention(
        q[None], k_ref.movedim(0, 1)[None], v_ref.movedim(0, 1)[None], enable_gqa=True
    )[0]
    full = row.key_shifts
    ks = KeyShifts.of_row(0, full.shifts[full.index_upto(n_kv)])  # the row clipped to n_kv
    order, groups = ks.grouped(n_kv)
    out = grouped_shift_decode(q, k[order].movedim(0, 1), v[order].movedim(0, 1), ks.shifts,
                               groups, inv, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    rotated = rotate_keys(k, row.key_shifts, inv)  # the extend path's one-gather rotation
    torch.testing.assert_close(rotated, k_ref, atol=1e-5, rtol=1e-5)


def test_backend_decode_takes_the_grouped_path_and_matches_the_reference():
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    torch.manual_seed(0)
    be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the math only; no model runner
    be._layer_id, be._cos_sin, be._groups = 0, {}, {}
    be.shift_rope = ShiftRope.full(rope_inv_freq(64, 1e5))
    d, h, hkv, lens = 64, 6, 2, [40, 75]
    k_cache, v_cache = torch.randn(256, hkv, d), torch.randn(256, hkv, d)
    req_to_token = torch.zeros(4, 128, dtype=torch.int64)
    req_to_token[1, :40], req_to_token[3, :75] = torch.randperm(256)[:40], torch.randperm(256)[:75]
    query = torch.randn(2, h, d)
    row = RowSpans.of_reads("r", (SharedSpan(3, 30, -8), SharedSpan(33, 20, 5)))
    be._batch_rows = (None, BatchRow(row))  # the first row has no spans: the parent's path
    out = torch.empty_like(query)
    be._run_sdpa_forward_decode(query, out, k_cache, v_cache, req_to_token,
                                torch.tensor([1, 3]), torch.tensor(lens), scaling=d**-0.5,
                                enable_gqa=True)
    for i, (idx, n, r) in enumerate([(1, 40, None), (3, 75, row)]):
        k, v = k_cache[req_to_token[idx, :n]], v_cache[req_to_token[idx, :n]]
        if r is not None:
            k = transform_spans(k, r, be.shift_rope)
        ref = scaled_dot_product_attention(query[i][:, None][None], k.movedim(0, 1)[None],
                                           v.movedim(0, 1)[None], enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[i], ref, atol=2e-6, rtol=1e-5)
    # the shifted row went through the batched query rotation, the plain one through SDPA
    plan = be._groups[("decode", (False, True))]
    assert plan.rest == (0,) and [b.rows.tolist() for b in plan.buckets] == [[1]]
