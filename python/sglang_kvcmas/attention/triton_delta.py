"""Triton extend and decode attention that read shared KV through per-agent low-rank deltas.

The math is the lab's torch reference (``sglang_kvcmas_lab.attention.reference``, the oracle these
kernels are tested against; the served decode is also tested against ``span_reads.rotate_keys``).
No per-agent K or V is ever written: each KV tile is read from SGLang's pool and corrected in
registers before it meets the queries,

    K_tile = R(δ)·K_base_tile + R(p_reader)·(U_tile @ Cᵀ)      U_tile: [BLOCK_N, r], Cᵀ: [r, d]
    V_tile = V_base_tile + U_v_tile @ C_vᵀ

so the extra work per tile is two rank-r matmuls and two rotations, and the extra memory traffic is
the U rows (r values per token instead of d) plus one C per span (cached across tiles).

One program serves one KV head and all of its GQA query heads, so a corrected tile is reused by
every query head of the group. Heads are split into halves (neox RoPE pairs dimension i with
i + d/2), so ``head_dim`` must be a power of two ≥ 32. Tiles come from
:func:`~sglang_kvcmas.attention.delta_plan.plan_delta_batch`; a tile never crosses a span boundary.

The ``@triton.jit`` code is in :mod:`.triton_delta_kernels`; this module plans launches.
Decode splits each request's tiles across ``num_splits`` programs (flash-decoding) and merges their
partial results with a second small kernel.

With ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors; that is
how CI tests them.
"""

from __future__ import annotations

import math

import torch
import triton

from sglang_kvcmas.attention.delta_plan import DeltaPlan, PackedFactors
from sglang_kvcmas.attention.triton_delta_kernels import (
    LOG2E,
    _delta_decode_kernel,
    _delta_extend_kernel,
    _merge_splits_kernel,
)


def _check(q: torch.Tensor, k_buffer: torch.Tensor, packed: PackedFactors) -> tuple[int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 32, got {head_dim}")
    for t in (packed.k_u, packed.v_u):
        if t.stride() != packed.k_u.stride():
            raise ValueError("k_u and v_u must share strides")
    for t in (packed.k_c, packed.v_c):
        if t.stride() != packed.k_c.stride():
            raise ValueError("k_c and v_c must share strides")
    return num_heads // num_kv_heads, head_dim


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_warps(head_dim: int, block_m: int) -> int:
    # float32 K/V tiles and two accumulators live in registers; wide heads need more warps.
    return 8 if head_dim * block_m >= 128 * 64 else 4


def _read_args(k_buffer, v_buffer, plan: DeltaPlan, packed: PackedFactors, inv_freq) -> list:
    """The arguments both delta kernels end with, in their order."""
    return [
        k_buffer,
        v_buffer,
        plan.kv_indices,
        plan.kv_indptr,
        plan.tile_indptr,
        plan.tile_start,
        plan.tile_len,
        plan.tile_span,
        plan.tile_shift,
        plan.tile_urow,
        packed.k_u,
        packed.k_c,
        packed.v_u,
        packed.v_c,
        inv_freq,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        packed.k_u.stride(0),
        packed.k_u.stride(1),
        packed.k_c.stride(0),
        packed.k_c.stride(1),
        packed.k_c.stride(2),
    ]


def delta_extend_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: DeltaPlan,
    packed: PackedFactors,
    inv_freq: torch.Tensor,
    sm_scale: float | None = None,
    block_m: int = 32,
) -> torch.Tensor:
    """Extend attention through deltas (same contract as ``reference.delta_attention``).

    Args:
        q: [total_queries, H, d] post-RoPE queries (rows ordered as ``plan.qo_indptr``)
        k_buffer: [pool_size, H_kv, d] post-RoPE keys, last dim contiguous
        v_buffer: [pool_size, H_kv, d]
        plan: from ``plan_delta_batch`` (on q's device)
        packed: from ``pack_delta_factors`` for this layer (on q's device)
        inv_freq: [d // 2] float32 RoPE frequencies
        sm_scale: default ``1/sqrt(d)``
        block_m: query rows (tokens × GQA group) per program, a power of two ≥ 16 and ≥ group
    Returns:
        [total_queries, H, d] in q's dtype
    """
    group, head_dim = _check(q, k_buffer, packed)
    if block_m < max(16, group):
        raise ValueError(f"block_m={block_m} must be >= max(16, group={group})")
    tokens = block_m // group
    o = torch.empty_like(q)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    grid = (plan.batch_size, k_buffer.shape[1], triton.cdiv(max(plan.max_queries, 1), tokens))
    _delta_extend_kernel[grid](
        q,
        o,
        plan.qo_indptr,
        scale,
        group,
        tokens,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        *_read_args(k_buffer, v_buffer, plan, packed, inv_freq),
        BLOCK_M=block_m,
        BLOCK_N=plan.block_n,
        HALF=head_dim // 2,
        BLOCK_R=packed.block_r,
        DOT_PREC=_dot_precision(q.dtype),
        num_warps=_num_warps(head_dim, block_m),
    )
    return o


def default_num_splits(
    batch_size: int, num_kv_heads: int, max_tiles: int, num_sms: int = 132
) -> int:
    """Enough decode splits to give every SM about two programs, capped by tiles and by 16."""
    want = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(want, max_tiles, 16))


def delta_decode_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: DeltaPlan,
    packed: PackedFactors,
    inv_freq: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention through deltas: one query per request.

    Args:
        q: [batch, H, d] post-RoPE queries
        num_splits: KV splits per request (default: :func:`default_num_splits`)
        others: as :func:`delta_extend_triton`
    Returns:
        [batch, H, d] in q's dtype
    """
    group, head_dim = _check(q, k_buffer, packed)
    batch, num_heads = q.shape[0], q.shape[1]
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = default_num_splits(batch, k_buffer.shape[1], plan.max_tiles, sms)
    mid_o = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    _delta_decode_kernel[(batch, k_buffer.shape[1], num_splits)](
        q,
        mid_o,
        mid_lse,
        scale,
        group,
        num_splits,
        q.stride(0),
        q.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        *_read_args(k_buffer, v_buffer, plan, packed, inv_freq),
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=plan.block_n,
        HALF=head_dim // 2,
        BLOCK_R=packed.block_r,
        DOT_PREC=_dot_precision(q.dtype),
        num_warps=4,
    )
    o = torch.empty_like(q)
    _merge_splits_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        o,
        num_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD=head_dim,
    )
    return o
