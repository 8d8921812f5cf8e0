"""The GPU micro-benchmark's configurations (``benchmark/kernels/delta_attention_gpu_bench.py``)
build and read right before a GPU times them: each grid axis (rank 0 = re-positioning only, 16
runs of alternating shifts, GQA 1:1, head_dim 64) through the decode and extend kernels against
the torch reference, small and in float32 (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers.bench_scripts import load_script
from sglang_kvcmas.attention.delta_plan import pack_delta_factors, plan_delta_batch
from sglang_kvcmas.attention.rope import rope_inv_freq
from sglang_kvcmas.attention.triton_delta import (
    delta_decode_triton,
    delta_extend_triton,
)
from sglang_kvcmas_lab.attention.reference import delta_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"

bench = load_script("benchmark/kernels/delta_attention_gpu_bench.py")


@pytest.mark.parametrize("rank, spans, kv_heads, head_dim, queries", [
    (0, 1, 2, 64, 1), (8, 1, 2, 64, 1), (0, 16, 2, 64, 1), (8, 16, 8, 32, 1), (8, 1, 2, 64, 5),
])
def test_bench_config_reads_as_the_reference(monkeypatch, rank, spans, kv_heads, head_dim,
                                             queries):
    monkeypatch.setattr(bench, "H", 8)
    monkeypatch.setattr(bench, "H_KV", kv_heads)
    monkeypatch.setattr(bench, "D", head_dim)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)  # the interpreter's bf16 dot is wrong
    q, kb, vb, reqs, facs = bench.build(2, 200, queries, rank, spans=spans, device=DEV)
    assert [len(r.spans) for r in reqs] == [spans, spans]
    inv = rope_inv_freq(head_dim, 5e5).to(DEV)
    plan = plan_delta_batch(reqs, 64, DEV)
    packed = pack_delta_factors(plan, facs, kv_heads, head_dim, torch.float32, DEV)
    kernel = delta_decode_triton if queries == 1 else delta_extend_triton
    got = kernel(q, kb, vb, plan, packed, inv)
    ref = delta_attention(q, kb, vb, reqs, facs, inv)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-4, rtol=2e-3)
