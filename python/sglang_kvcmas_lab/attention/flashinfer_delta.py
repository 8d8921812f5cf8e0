"""FlashInfer route for the delta read: a custom FA2 attention variant behind a plan/run wrapper.

The variant source is ``kernels/flashinfer/delta_variant.cuh`` (C++, rendered by FlashInfer's JIT
into its batch-prefill template). It corrects the *keys* of shared-span tokens exactly as
:mod:`~sglang_kvcmas_lab.attention.reference` does (shift of the post-RoPE base plus the rotated
low-rank pre-RoPE deviation). Values are read as stored.

# NOTE: FlashInfer 0.7.2's FA2 kernels expose per-key work only through ``LogitsTransform`` (the
# declared ``KeyTransform`` hook is never called), so the variant recomputes a span token's logit in
# CUDA cores at O(head_dim·r) per (query head, key) pair, and no hook can add the value delta
# ``(P·U_v)·C_vᵀ``. The Triton kernels (:mod:`~sglang_kvcmas.attention.triton_delta`) are the
# complete and fast path; this wrapper is the FlashInfer comparison point.

``flashinfer`` is imported lazily: importing this module needs neither flashinfer nor a GPU.
Extend and decode share one wrapper (decode = one query per request), as FlashInfer's own
tensor-core decode does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest
from sglang_kvcmas.attention.delta_plan import DeltaPlan

VARIANT_NAME = "KvcmasDeltaKeyAttention"
VARIANT_SOURCE = (
    Path(__file__).resolve().parents[3] / "kernels" / "flashinfer" / "delta_variant.cuh"
)
TENSOR_NAMES = [
    "kvcmas_token_offset",
    "kvcmas_token_span",
    "kvcmas_token_urow",
    "kvcmas_token_shift",
    "kvcmas_k_u",
    "kvcmas_k_c",
    "kvcmas_inv_freq",
]
TENSOR_DTYPES = ["int32_t"] * 4 + ["float"] * 3
SCALAR_NAMES = ["sm_scale", "kvcmas_block_r", "kvcmas_num_kv_heads"]
SCALAR_DTYPES = ["double", "int64_t", "int64_t"]


def variant_decl() -> str:
    """The C++ variant source (needs a source checkout: ``kernels/`` is not inside the wheel)."""
    if not VARIANT_SOURCE.is_file():
        raise FileNotFoundError(f"FlashInfer variant source not found at {VARIANT_SOURCE}")
    return VARIANT_SOURCE.read_text()


def jit_args(dtype: torch.dtype, head_dim: int) -> list:
    """Arguments of ``flashinfer.jit.attention.gen_customize_batch_prefill_module`` after backend.

    Args:
        dtype: query/KV/output dtype (torch.float16 or torch.bfloat16)
        head_dim: the model's head dimension (qk and vo)
    """
    tag = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    return [
        f"kvcmas_delta_key_{tag}_d{head_dim}",
        dtype,
        dtype,
        dtype,
        torch.int32,
        head_dim,
        head_dim,
        TENSOR_NAMES,
        TENSOR_DTYPES,
        SCALAR_NAMES,
        SCALAR_DTYPES,
        VARIANT_NAME,
        variant_decl(),
    ]


@dataclass(frozen=True)
class TokenMetadata:
    """Per-KV-token view of a :class:`DeltaPlan`, as the variant indexes it.

    Attributes:
        offset: [batch + 1] int32, request i's tokens are ``offset[i]:offset[i+1]``.
        span: [total_kv] int32, global span id or -1.
        urow: [total_kv] int32, row of the packed K coefficients.
        shift: [total_kv] int32, δ (0 outside spans).
    """

    offset: torch.Tensor
    span: torch.Tensor
    urow: torch.Tensor
    shift: torch.Tensor


def token_metadata(plan: DeltaPlan) -> TokenMetadata:
    """Expand the plan's tiles to one entry per KV token (host side, once per batch)."""
    lens = plan.tile_len.long().cpu()
    span = torch.repeat_interleave(plan.tile_span.cpu(), lens)
    shift = torch.repeat_interleave(plan.tile_shift.cpu(), lens)
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    urow = torch.repeat_interleave(plan.tile_urow.cpu(), lens) + within
    urow = torch.where(span >= 0, urow, torch.zeros_like(urow))
    dev = plan.kv_indptr.device
    return TokenMetadata(
        plan.kv_indptr,
        span.to(dev, torch.int32),
        urow.to(dev, torch.int32),
        shift.to(dev, torch.int32),
    )


class DeltaFlashInferWrapper:
    """FlashInfer batch attention with the delta key read; ``plan()`` once per batch, ``run()``
    per layer, like FlashInfer's own wrappers. The pool has page size 1 (SGLang's token pool)."""

    def __init__(self, workspace: torch.Tensor, dtype: torch.dtype, head_dim: int) -> None:
        """
        Args:
            workspace: [>= 128 MiB] uint8 CUDA buffer for FlashInfer's split-KV scratch
            dtype: query/KV dtype (float16 or bfloat16)
            head_dim: model head dimension
        """
        import flashinfer

        self._inner = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend="fa2", jit_args=jit_args(dtype, head_dim)
        )
        self._dtype, self._head_dim = dtype, head_dim
        self._meta: TokenMetadata | None = None

    def plan(
        self,
        requests: Sequence[DeltaRequest],
        plan: DeltaPlan,
        num_qo_heads: int,
        num_kv_heads: int,
    ) -> None:
        """Host metadata for one batch (all layers).

        Args:
            requests: the batch, as given to ``plan_delta_batch``
            plan: ``plan_delta_batch(requests, ...)`` on the CUDA device
            num_qo_heads, num_kv_heads: attention heads of the model
        """
        dev = plan.kv_indptr.device
        self._meta = token_metadata(plan)
        self._num_kv_heads = num_kv_heads
        self._inner.plan(
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            torch.ones(len(requests), dtype=torch.int32, device=dev),
            num_qo_heads,
            num_kv_heads,
            self._head_dim,
            1,
            causal=True,
            q_data_type=self._dtype,
            kv_data_type=self._dtype,
        )

    def run(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        k_u: torch.Tensor,
        k_c: torch.Tensor,
        inv_freq: torch.Tensor,
        sm_scale: float | None = None,
    ) -> torch.Tensor:
        """One layer's attention.

        Args:
            q: [total_queries, H, d] post-RoPE queries
            k_buffer, v_buffer: [pool_size, H_kv, d] the pool (page size 1)
            k_u: [rows, H_kv, block_r] float32 packed key coefficients (``PackedFactors.k_u``)
            k_c: [spans, H_kv, d, block_r] float32 packed key bases (``PackedFactors.k_c``)
            inv_freq: [d // 2] float32
        Returns:
            [total_queries, H, d] in q's dtype
        """
        if self._meta is None:
            raise RuntimeError("plan() first")
        m = self._meta
        scale = sm_scale if sm_scale is not None else self._head_dim**-0.5
        paged = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # [pool, page_size=1, H_kv, d]
        return self._inner.run(
            q,
            paged,
            m.offset,
            m.span,
            m.urow,
            m.shift,
            k_u.float().contiguous(),
            k_c.float().contiguous(),
            inv_freq.float().contiguous(),
            float(scale),
            int(k_u.shape[-1]),
            int(self._num_kv_heads),
        )
