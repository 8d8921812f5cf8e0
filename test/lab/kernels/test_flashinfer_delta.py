"""FlashInfer route: host metadata on CPU; the variant itself on a GPU (compile-checked on CPU by
``kernels/flashinfer/compile_check.py``).

GPU tolerance: bf16 inputs, ``atol=rtol=3e-2`` against the float32 reference (the variant rounds
probabilities to bf16 before its PV product, as FlashInfer does).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from delta_cases import ReqSpec, make_case
from sglang_kvcmas.attention.delta_batch import SpanFactors
from sglang_kvcmas_lab.attention.flashinfer_delta import token_metadata, variant_decl
from sglang_kvcmas.attention.delta_plan import pack_delta_factors, plan_delta_batch
from sglang_kvcmas_lab.attention.reference import delta_attention
from sglang_kvcmas.attention.rope import rope_inv_freq


def test_token_metadata_expands_tiles_per_token():
    case = make_case(
        [ReqSpec(40, 3, ((2, 20, 5),), (4,)), ReqSpec(10, 1, ((0, 5, -1),), (2,))], 1, 1, 32
    )
    plan = plan_delta_batch(case.requests, 8)
    m = token_metadata(plan)
    want_span = [-1] * 2 + [0] * 20 + [-1] * 18 + [1] * 5 + [-1] * 5
    assert m.span.tolist() == want_span
    assert m.shift.tolist() == [0] * 2 + [5] * 20 + [0] * 18 + [-1] * 5 + [0] * 5
    assert m.urow.tolist() == [0] * 2 + list(range(20)) + [0] * 18 + list(range(20, 25)) + [0] * 5
    assert m.offset.tolist() == [0, 40, 50]


def test_variant_source_declares_the_hooks_it_relies_on():
    src = variant_decl()
    assert "struct KvcmasDeltaKeyAttention : AttentionVariantBase" in src
    assert "REGISTER_LOGITS_TRANSFORM" in src and "sm_scale_log2" in src


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer",
)
@pytest.mark.parametrize("decode", [False, True])
def test_flashinfer_variant_matches_reference_for_key_deltas(decode):
    from sglang_kvcmas_lab.attention.flashinfer_delta import DeltaFlashInferWrapper

    nq = 1 if decode else 17
    specs = [
        ReqSpec(300, nq, ((4, 200, 7),), (8,)),
        ReqSpec(81, nq, ((0, 60, -3),), (16,)),
        ReqSpec(40, nq),
    ]
    # head_dim 128: the same JIT module as the GPU benchmark, so gpu_check compiles it once.
    case = make_case(specs, 2, 3, 128, dtype=torch.bfloat16, device="cuda")
    key_only = [[SpanFactors(k=f.k) for f in facs] for facs in case.factors]
    inv = rope_inv_freq(128, 1e5).cuda()
    want = delta_attention(case.q, case.k_buffer, case.v_buffer, case.requests, key_only, inv)
    plan = plan_delta_batch(case.requests, 64, "cuda")
    packed = pack_delta_factors(plan, key_only, 2, 128, torch.float32, "cuda")
    wrapper = DeltaFlashInferWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), torch.bfloat16, 128
    )
    wrapper.plan(case.requests, plan, 6, 2)
    got = wrapper.run(case.q, case.k_buffer, case.v_buffer, packed.k_u, packed.k_c, inv)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
