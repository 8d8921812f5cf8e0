"""Triton delta-attention kernels against the torch reference.

On CPU the kernels run in Triton's interpreter (``conftest.py``); on a GPU the same tests run on
CUDA. The default grid keeps the big sizes (987 tokens) to a few cases; set
``KVCMAS_KERNEL_TESTS_FULL=1`` for the cross product.

Tolerances, written down:
  - float32: ``atol=rtol=2e-5`` on the interpreter (numpy float32 arithmetic, differing only in
    summation order); ``1e-4`` on CUDA (``ieee`` dots, different reduction order and ``exp2``).
  - bfloat16 (CUDA only): ``atol=rtol=3e-2``; the reference computes in float32 from the same
    bf16 inputs, the kernel rounds K/V tiles and probabilities to bf16 before its dots.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from conftest import FULL_GRID
from delta_cases import ReqSpec, make_case
from sglang_kvcmas.attention.delta_batch import DeltaRequest, LowRankDelta, SpanFactors
from sglang_kvcmas.attention.delta_plan import pack_delta_factors, plan_delta_batch
from sglang_kvcmas_lab.attention.reference import delta_attention, plain_attention
from sglang_kvcmas.attention.rope import rope_inv_freq
from sglang_kvcmas.attention.triton_delta import delta_decode_triton, delta_extend_triton


def tol(dtype: torch.dtype, device: str) -> dict:
    if dtype == torch.bfloat16:
        return dict(atol=3e-2, rtol=3e-2)
    return dict(atol=1e-4, rtol=1e-4) if device == "cuda" else dict(atol=2e-5, rtol=2e-5)


def run_both(case, block_n: int, decode: bool, num_splits: int | None = None, device="cpu"):
    d = case.q.shape[-1]
    inv = rope_inv_freq(d, 1e5).to(device)
    want = delta_attention(case.q, case.k_buffer, case.v_buffer, case.requests, case.factors, inv)
    plan = plan_delta_batch(case.requests, block_n, device)
    packed = pack_delta_factors(
        plan, case.factors, case.k_buffer.shape[1], d, case.q.dtype, device, case.requests
    )
    if decode:
        got = delta_decode_triton(
            case.q, case.k_buffer, case.v_buffer, plan, packed, inv, num_splits=num_splits
        )
    else:
        got = delta_extend_triton(case.q, case.k_buffer, case.v_buffer, plan, packed, inv)
    return got, want


# (specs, rank, group, num_kv_heads, head_dim, page_size, block_n)
EXTEND_CASES = {
    "len1": ([ReqSpec(1, 1)], 1, 1, 2, 32, 1, 16),
    "len17_prefill": ([ReqSpec(17, 17)], 2, 3, 2, 32, 16, 16),
    "len81_gqa7": ([ReqSpec(81, 17, ((5, 55, 9),), (8,))], 8, 7, 1, 32, 1, 16),
    "len987_two_spans": (
        [ReqSpec(987, 17, ((0, 500, 37), (600, 360, -120)), (16, 3))],
        16,
        3,
        1,
        32,
        64,
        64,
    ),
    "agents4_shared_span": (
        [
            ReqSpec(81, 9, ((4, 60, 2),), (4,)),
            ReqSpec(81, 3, ((9, 60, -3),), (1,)),
            ReqSpec(17, 1, ((1, 15, 0),), (13,)),
            ReqSpec(40, 40),
        ],
        4,
        3,
        2,
        64,
        16,
        32,
    ),
    "long_queries_naive_reuse": ([ReqSpec(120, 81, ((3, 32, 5),), (0,))], 0, 1, 2, 32, 1, 32),
}

DECODE_CASES = {
    "batch_1_17_81": (
        [ReqSpec(1, 1), ReqSpec(17, 1, ((0, 16, 3),), (8,)), ReqSpec(81, 1, ((10, 50, 4),), (8,))],
        1,
        7,
        1,
        32,
        1,
        16,
    ),
    "len987_splits": (
        [ReqSpec(987, 1, ((1, 900, 11),), (16,)), ReqSpec(81, 1, ((0, 80, -2),), (4,))],
        4,
        3,
        2,
        32,
        16,
        64,
    ),
    "agents5_mixed_ranks": (
        [
            ReqSpec(60, 1, ((5, 40, s),), (r,))
            for s, r in ((0, 1), (3, 2), (-4, 7), (8, 16), (1, 0))
        ],
        2,
        1,
        2,
        64,
        64,
        16,
    ),
}


@pytest.mark.parametrize("rank", [1, 3, 8, 16])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_extend_rank_gqa_grid(rank, group, device):
    """Every rank × GQA ratio at a modest size, two readers with their own shifts."""
    specs = [ReqSpec(81, 17, ((3, 60, 6),), (rank,)), ReqSpec(33, 1, ((0, 30, -4),), (rank,))]
    case = make_case(specs, 2, group, 32, page_size=16, seed=rank * 10 + group, device=device)
    got, want = run_both(case, 16, decode=False, device=device)
    torch.testing.assert_close(got, want, **tol(torch.float32, device))


def _full_grid():
    """Cross product for the opt-in extended run: a decode-like and an extend-like reader."""
    for n, r, g, ps in itertools.product((1, 17, 81, 987), (1, 4, 8, 16), (1, 3, 7), (1, 16)):
        specs = []
        for nq in (1, min(n, 17)):
            spans = ((0, n - nq, 5),) if n > nq else ()
            specs.append(ReqSpec(n, nq, spans, (r,) * len(spans)))
        yield f"n{n}_r{r}_g{g}_p{ps}", (specs, r, g, 1, 32, ps, 32)


@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_matches_reference(name, device):
    specs, _, group, h_kv, d, page, block_n = EXTEND_CASES[name]
    case = make_case(
        specs, h_kv, group, d, page_size=page, seed=zlib.crc32(name.encode()) % 1000, device=device
    )
    got, want = run_both(case, block_n, decode=False, device=device)
    torch.testing.assert_close(got, want, **tol(torch.float32, device))


@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(name, num_splits, device):
    specs, _, group, h_kv, d, page, block_n = DECODE_CASES[name]
    case = make_case(specs, h_kv, group, d, page_size=page, seed=7, device=device)
    got, want = run_both(case, block_n, decode=True, num_splits=num_splits, device=device)
    torch.testing.assert_close(got, want, **tol(torch.float32, device))


def test_zero_delta_kernel_is_plain_attention(device):
    specs = [ReqSpec(81, 5, ((2, 70, 0),), (8,)), ReqSpec(17, 1, ((0, 16, 0),), (8,))]
    case = make_case(specs, 2, 3, 32, page_size=16, device=device)
    zero = [
        [SpanFactors(LowRankDelta(f.k.u * 0, f.k.c), LowRankDelta(f.v.u * 0, f.v.c)) for f in facs]
        for facs in case.factors
    ]
    inv = rope_inv_freq(32).to(device)
    plan = plan_delta_batch(case.requests, 16, device)
    packed = pack_delta_factors(plan, zero, 2, 32, torch.float32, device)
    got = delta_extend_triton(case.q, case.k_buffer, case.v_buffer, plan, packed, inv)
    want = plain_attention(case.q, case.k_buffer, case.v_buffer, case.requests)
    torch.testing.assert_close(got, want, **tol(torch.float32, device))


def test_exact_delta_kernel_equals_recomputed_kv(device):
    """Kernel side of the identity: base + exact delta == the reader's recomputed attention."""
    from test_delta_reference import _owner_and_reader, sdpa

    q, kb, vb, req, facs, k_true, v_true, inv = _owner_and_reader(rank=None)  # rank = head_dim
    req = DeltaRequest(req.kv_indices, req.num_queries, req.spans)
    plan = plan_delta_batch([req], 16, device)
    packed = pack_delta_factors(plan, [facs], kb.shape[1], kb.shape[2], torch.float32, device)
    got = delta_extend_triton(
        q.to(device), kb.to(device), vb.to(device), plan, packed, inv.to(device)
    )
    torch.testing.assert_close(got.cpu(), sdpa(q, k_true, v_true), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_bf16_on_gpu(name):
    specs, _, group, h_kv, d, page, block_n = EXTEND_CASES[name]
    case = make_case(specs, h_kv, group, d, page_size=page, dtype=torch.bfloat16, device="cuda")
    got, want = run_both(case, block_n, decode=False, device="cuda")
    torch.testing.assert_close(got, want, **tol(torch.bfloat16, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_bf16_on_gpu(name):
    specs, _, group, h_kv, d, page, block_n = DECODE_CASES[name]
    case = make_case(specs, h_kv, group, d, page_size=page, dtype=torch.bfloat16, device="cuda")
    got, want = run_both(case, block_n, decode=True, device="cuda")
    torch.testing.assert_close(got, want, **tol(torch.bfloat16, "cuda"))


@pytest.mark.skipif(not FULL_GRID, reason="extended grid: set KVCMAS_KERNEL_TESTS_FULL=1")
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("name,cfg", list(_full_grid()) if FULL_GRID else [])
def test_full_grid(name, cfg, decode, device):
    specs, _, group, h_kv, d, page, block_n = cfg
    if decode:
        specs = specs[:1]
    case = make_case(specs, h_kv, group, d, page_size=page, seed=1, device=device)
    got, want = run_both(case, block_n, decode=decode, num_splits=2, device=device)
    torch.testing.assert_close(got, want, **tol(torch.float32, device))
