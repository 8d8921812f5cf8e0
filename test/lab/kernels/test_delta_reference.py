"""The torch reference of the delta read path against independently recomputed attention.

Tolerances (float32 on CPU): ``atol=rtol=1e-5`` where both sides do the same arithmetic in a
different order; ``atol=rtol=1e-4`` where one side goes through an SVD.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from delta_cases import ReqSpec, make_case
from sglang_kvcmas.attention.delta_batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors
from sglang_kvcmas_lab.attention.reference import (
    delta_attention,
    lora_value_read,
    plain_attention,
    reader_kv,
)
from sglang_kvcmas.attention.rope import apply_rope, rope_inv_freq

TOL = dict(atol=1e-5, rtol=1e-5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention by torch's SDPA (an implementation independent of ours).

    q: [n_q, H, d] (last n_q positions), k/v: [n_kv, H_kv, d] -> [n_q, H, d]
    """
    n_q, n_kv = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(n_kv)[None, :] <= torch.arange(n_kv - n_q, n_kv)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(),
        k.repeat_interleave(group, 1).transpose(0, 1)[None].float(),
        v.repeat_interleave(group, 1).transpose(0, 1)[None].float(),
        attn_mask=mask,
    )
    return out[0].transpose(0, 1)


def test_rope_rotations_compose():
    inv = rope_inv_freq(64, 1e5)
    x = torch.randn(50, 3, 64)
    p = torch.arange(50) * 7
    for delta in (-13, 0, 29):
        shifted = apply_rope(apply_rope(x, p, inv), torch.full((50,), delta), inv)
        torch.testing.assert_close(shifted, apply_rope(x, p + delta, inv), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(apply_rope(apply_rope(x, p, inv), -p, inv), x, atol=1e-5, rtol=1e-5)


def test_no_spans_equals_sdpa():
    case = make_case([ReqSpec(81, 17), ReqSpec(17, 17), ReqSpec(1, 1)], 2, 3, 32, page_size=16)
    out = plain_attention(case.q, case.k_buffer, case.v_buffer, case.requests)
    row = 0
    for req in case.requests:
        rows = slice(row, row + req.num_queries)
        k, v = case.k_buffer[req.kv_indices], case.v_buffer[req.kv_indices]
        torch.testing.assert_close(out[rows], sdpa(case.q[rows], k, v), **TOL)
        row += req.num_queries


def test_zero_delta_and_zero_shift_is_plain_attention():
    specs = [ReqSpec(81, 5, ((3, 40, 0), (50, 10, 0)), (4, 8))]
    case = make_case(specs, 2, 3, 32)
    zero = [
        [SpanFactors(LowRankDelta(f.k.u * 0, f.k.c), LowRankDelta(f.v.u, f.v.c * 0)) for f in facs]
        for facs in case.factors
    ]
    inv = rope_inv_freq(32)
    got = delta_attention(case.q, case.k_buffer, case.v_buffer, case.requests, zero, inv)
    want = plain_attention(case.q, case.k_buffer, case.v_buffer, case.requests)
    torch.testing.assert_close(got, want, **TOL)


def _owner_and_reader(rank: int | None, seed: int = 0):
    """A reader whose shared span was computed by an owner at other positions.

    Returns (q, k_buffer, v_buffer, request, factors, k_true, v_true, inv_freq): k_true/v_true are
    the reader's own recomputed KV ([seq_len, H_kv, d], keys rotated at reader positions), which
    the delta read must reproduce. rank=None: the deviation is full rank, factored exactly by SVD.
    """
    g = torch.Generator().manual_seed(seed)
    h_kv, group, d, inv = 2, 3, 32, rope_inv_freq(32)
    head, span_len, tail, n_q, owner_start = 7, 40, 5, 6, 19  # δ = 7 − 19 = −12
    seq_len = head + span_len + tail + n_q
    k_pre = torch.randn(seq_len, h_kv, d, generator=g)  # reader's own tokens, pre-RoPE
    v = torch.randn(seq_len, h_kv, d, generator=g)
    k_owner = torch.randn(span_len, h_kv, d, generator=g)  # owner's pre-RoPE keys of the span
    v_owner = torch.randn(span_len, h_kv, d, generator=g)
    if rank is None:
        dk, dv = (torch.randn(span_len, h_kv, d, generator=g) * 0.3 for _ in range(2))

        def factor(dev: torch.Tensor) -> LowRankDelta:
            u, s, vh = torch.linalg.svd(dev.transpose(0, 1), full_matrices=False)  # per head
            return LowRankDelta((u * s[:, None, :]).transpose(0, 1), vh.transpose(1, 2))

        fk, fv = factor(dk), factor(dv)
    else:
        fk, fv = (
            LowRankDelta(
                torch.randn(span_len, h_kv, rank, generator=g),
                torch.randn(h_kv, d, rank, generator=g) * 0.2,
            )
            for _ in range(2)
        )
        dk, dv = fk.dense(), fv.dense()
    sl = slice(head, head + span_len)
    reader_pos = torch.arange(seq_len)
    # What the reader would compute itself:
    k_true_pre, v_true = k_pre.clone(), v.clone()
    k_true_pre[sl], v_true[sl] = k_owner + dk, v_owner + dv
    k_true = apply_rope(k_true_pre, reader_pos, inv)
    # What the pool holds: the reader's own tokens at reader positions, the span at owner positions.
    pool_k = apply_rope(k_pre, reader_pos, inv)
    pool_k[sl] = apply_rope(k_owner, owner_start + torch.arange(span_len), inv)
    pool_v = v.clone()
    pool_v[sl] = v_owner
    perm = torch.randperm(seq_len, generator=g)  # scatter into a pool in random slot order
    k_buffer, v_buffer = torch.empty_like(pool_k), torch.empty_like(pool_v)
    k_buffer[perm], v_buffer[perm] = pool_k, pool_v
    request = DeltaRequest(perm, n_q, (SharedSpan(head, span_len, head - owner_start),))
    q = apply_rope(torch.randn(n_q, h_kv * group, d, generator=g), reader_pos[-n_q:], inv)
    return q, k_buffer, v_buffer, request, [SpanFactors(fk, fv)], k_true, v_true, inv


def test_exact_low_rank_delta_equals_recomputed_kv():
    q, kb, vb, req, facs, k_true, v_true, inv = _owner_and_reader(rank=5)
    k, v = reader_kv(kb, vb, req, facs, inv)
    torch.testing.assert_close(k, k_true, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_true, **TOL)
    got = delta_attention(q, kb, vb, [req], [facs], inv)
    torch.testing.assert_close(got, sdpa(q, k_true, v_true), atol=1e-4, rtol=1e-4)


def test_full_rank_delta_reproduces_exact():
    q, kb, vb, req, facs, k_true, v_true, inv = _owner_and_reader(rank=None)
    assert facs[0].k.rank == 32
    got = delta_attention(q, kb, vb, [req], [facs], inv)
    torch.testing.assert_close(got, sdpa(q, k_true, v_true), atol=1e-4, rtol=1e-4)


def test_uncorrected_reuse_differs_from_recomputed():
    """Guards the two tests above: without the delta the read is measurably wrong."""
    q, kb, vb, req, facs, k_true, v_true, inv = _owner_and_reader(rank=5)
    got = delta_attention(q, kb, vb, [req], [[SpanFactors()]], inv)
    assert (got - sdpa(q, k_true, v_true)).abs().max() > 1e-2


def test_lora_value_read_matches_materialized():
    g = torch.Generator().manual_seed(3)
    h_kv, n_q, n_kv, d, r, s = 3, 5, 40, 32, 8, 0.5
    probs = torch.softmax(torch.randn(h_kv, n_q, n_kv, generator=g), -1)
    v0 = torch.randn(n_kv, h_kv, d, generator=g)
    a = torch.randn(n_kv, h_kv, r, generator=g)
    b = torch.randn(h_kv, r, d, generator=g)
    v_agent = v0 + s * torch.einsum("khr,hrd->khd", a, b)
    want = torch.einsum("hqk,khd->qhd", probs, v_agent)
    torch.testing.assert_close(lora_value_read(probs, v0, a, b, s), want, **TOL)
    # The same read as a LowRankDelta: U = a, C = s·Bᵀ.
    dense = LowRankDelta(a, s * b.transpose(1, 2)).dense()
    torch.testing.assert_close(v0 + dense, v_agent, **TOL)


def test_planned_torch_path_equals_reference():
    from sglang_kvcmas_lab.attention.torch_delta import plan_torch_delta, run_torch_delta

    specs = [
        ReqSpec(81, 17, ((3, 40, 6), (45, 19, -9)), (8, 0)),
        ReqSpec(40, 1, ((0, 39, 2),), (16,)),
        ReqSpec(17, 17),
        ReqSpec(1, 1),
    ]
    case = make_case(specs, 3, 3, 64, page_size=16)
    inv = rope_inv_freq(64, 1e5)
    want = delta_attention(case.q, case.k_buffer, case.v_buffer, case.requests, case.factors, inv)
    plan = plan_torch_delta(case.requests, inv)
    got = run_torch_delta(case.q, case.k_buffer, case.v_buffer, plan, case.factors)
    torch.testing.assert_close(got, want, **TOL)
    plain = run_torch_delta(
        case.q,
        case.k_buffer,
        case.v_buffer,
        plan_torch_delta([DeltaRequest(r.kv_indices, r.num_queries) for r in case.requests], inv),
        None,
    )
    torch.testing.assert_close(
        plain, plain_attention(case.q, case.k_buffer, case.v_buffer, case.requests), **TOL
    )
