"""Triton extend and decode attention that read shared KV through per-agent low-rank deltas.

The math is :mod:`sglang_kvcmas.attention.reference` (the oracle these kernels are tested against).
No per-agent K or V is ever written: each KV tile is read from SGLang's pool and corrected in
registers before it meets the queries,

    K_tile = R(δ)·K_base_tile + R(p_reader)·(U_tile @ Cᵀ)      U_tile: [BLOCK_N, r], Cᵀ: [r, d]
    V_tile = V_base_tile + U_v_tile @ C_vᵀ

so the extra work per tile is two rank-r matmuls and two rotations, and the extra memory traffic is
the U rows (r values per token instead of d) plus one C per span (cached across tiles).

One program serves one KV head and all of its GQA query heads, so a corrected tile is reused by
every query head of the group. Heads are split into halves (neox RoPE pairs dimension i with
i + d/2), so ``head_dim`` must be a power of two ≥ 32. Tiles come from
:func:`~sglang_kvcmas.attention.plan.plan_delta_batch`; a tile never crosses a span boundary.

Decode splits each request's tiles across ``num_splits`` programs (flash-decoding) and merges their
partial results with a second small kernel.

With ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors; that is
how CI tests them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sglang_kvcmas.attention.plan import DeltaPlan, PackedFactors

_LOG2E = 1.4426950408889634
_NEG = -1.0e30  # finite "minus infinity": exp2(_NEG - m) == 0 and never NaN


@triton.jit
def _reader_kv_tile(
    k_buffer, v_buffer, kv_idx, kvh, t_start, t_len, span, shift, urow,
    k_u, k_c, v_u, v_c, inv_freq,
    s_kb_t, s_kb_h, s_vb_t, s_vb_h, s_u_t, s_u_h, s_c_s, s_c_h, s_c_d,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One KV head's tile as the reader sees it: (k_lo, k_hi, v), float32, [BLOCK_N, ·]."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    mask_n = offs_n < t_len
    slots = tl.load(kv_idx + t_start + offs_n, mask=mask_n, other=0).to(tl.int64)
    kb = k_buffer + slots[:, None] * s_kb_t + kvh * s_kb_h
    k_lo = tl.load(kb + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    k_hi = tl.load(kb + HALF + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    vb = v_buffer + slots[:, None] * s_vb_t + kvh * s_vb_h
    v_lo = tl.load(vb + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    v_hi = tl.load(vb + HALF + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    freq = tl.load(inv_freq + offs_h)
    if shift != 0:
        # Base keys are post-RoPE at owner positions: R(δ) moves them to reader positions.
        ang = shift.to(tl.float32) * freq
        cs = tl.cos(ang)[None, :]
        sn = tl.sin(ang)[None, :]
        k_lo, k_hi = k_lo * cs - k_hi * sn, k_hi * cs + k_lo * sn
    if span >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        u_off = (urow + offs_n)[:, None] * s_u_t + kvh * s_u_h + offs_r[None, :]
        c_lo_off = span * s_c_s + kvh * s_c_h + offs_h[:, None] * s_c_d + offs_r[None, :]
        c_hi_off = c_lo_off + HALF * s_c_d
        uk = tl.load(k_u + u_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        dk_lo = tl.dot(uk, tl.trans(tl.load(k_c + c_lo_off).to(tl.float32)), input_precision=DOT_PREC)
        dk_hi = tl.dot(uk, tl.trans(tl.load(k_c + c_hi_off).to(tl.float32)), input_precision=DOT_PREC)
        # The deviation is pre-RoPE: rotate it at the reader's positions (= request-local index).
        ang = (t_start + offs_n).to(tl.float32)[:, None] * freq[None, :]
        cs = tl.cos(ang)
        sn = tl.sin(ang)
        k_lo += dk_lo * cs - dk_hi * sn
        k_hi += dk_hi * cs + dk_lo * sn
        uv = tl.load(v_u + u_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        v_lo += tl.dot(uv, tl.trans(tl.load(v_c + c_lo_off).to(tl.float32)), input_precision=DOT_PREC)
        v_hi += tl.dot(uv, tl.trans(tl.load(v_c + c_hi_off).to(tl.float32)), input_precision=DOT_PREC)
    return k_lo, k_hi, v_lo, v_hi


@triton.jit
def _attend_tile(
    q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with one tile; ``ok`` masks [BLOCK_M, BLOCK_N]."""
    dt = q_lo.dtype
    s = tl.dot(q_lo, tl.trans(k_lo.to(dt)), input_precision=DOT_PREC)
    s += tl.dot(q_hi, tl.trans(k_hi.to(dt)), input_precision=DOT_PREC)
    s = tl.where(ok, s * qk_scale, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(dt)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(dt), input_precision=DOT_PREC)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(dt), input_precision=DOT_PREC)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _delta_extend_kernel(
    q, o, k_buffer, v_buffer, kv_indices, qo_indptr, kv_indptr,
    tile_indptr, tile_start, tile_len, tile_span, tile_shift, tile_urow,
    k_u, k_c, v_u, v_c, inv_freq, qk_scale, GROUP, TOKENS,
    s_q_t, s_q_h, s_o_t, s_o_h,
    s_kb_t, s_kb_h, s_vb_t, s_vb_h, s_u_t, s_u_h, s_c_s, s_c_h, s_c_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tok0 = tl.program_id(2) * TOKENS
    q0 = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q0
    if tok0 < q_len:
        kv0 = tl.load(kv_indptr + b)
        prefix = tl.load(kv_indptr + b + 1) - kv0 - q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_h = tl.arange(0, HALF)
        offs_n = tl.arange(0, BLOCK_N)
        tok = tok0 + offs_m // GROUP
        row_ok = (offs_m < TOKENS * GROUP) & (tok < q_len)
        q_off = (q0 + tok)[:, None] * s_q_t + (kvh * GROUP + offs_m % GROUP)[:, None] * s_q_h
        q_lo = tl.load(q + q_off + offs_h[None, :], mask=row_ok[:, None], other=0.0)
        q_hi = tl.load(q + q_off + HALF + offs_h[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = prefix + tok
        last_pos = prefix + tl.minimum(tok0 + TOKENS, q_len) - 1
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
        for t in range(tl.load(tile_indptr + b), tl.load(tile_indptr + b + 1)):
            t_start = tl.load(tile_start + t)
            if t_start <= last_pos:  # causal: later tiles are invisible to this block
                t_len = tl.load(tile_len + t)
                k_lo, k_hi, v_lo, v_hi = _reader_kv_tile(
                    k_buffer, v_buffer, kv_indices + kv0, kvh, t_start, t_len,
                    tl.load(tile_span + t), tl.load(tile_shift + t), tl.load(tile_urow + t),
                    k_u, k_c, v_u, v_c, inv_freq,
                    s_kb_t, s_kb_h, s_vb_t, s_vb_h, s_u_t, s_u_h, s_c_s, s_c_h, s_c_d,
                    BLOCK_N, HALF, BLOCK_R, DOT_PREC,
                )
                kv_pos = t_start + offs_n
                ok = (offs_n < t_len)[None, :] & (kv_pos[None, :] <= q_pos[:, None])
                m_i, l_i, acc_lo, acc_hi = _attend_tile(
                    q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale,
                    DOT_PREC,
                )
        inv_l = 1.0 / l_i
        o_off = (q0 + tok)[:, None] * s_o_t + (kvh * GROUP + offs_m % GROUP)[:, None] * s_o_h
        out_lo = (acc_lo * inv_l[:, None]).to(o.dtype.element_ty)
        out_hi = (acc_hi * inv_l[:, None]).to(o.dtype.element_ty)
        tl.store(o + o_off + offs_h[None, :], out_lo, mask=row_ok[:, None])
        tl.store(o + o_off + HALF + offs_h[None, :], out_hi, mask=row_ok[:, None])


@triton.jit
def _delta_decode_kernel(
    q, mid_o, mid_lse, k_buffer, v_buffer, kv_indices, kv_indptr,
    tile_indptr, tile_start, tile_len, tile_span, tile_shift, tile_urow,
    k_u, k_c, v_u, v_c, inv_freq, qk_scale, GROUP, NUM_SPLITS,
    s_q_b, s_q_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    s_kb_t, s_kb_h, s_vb_t, s_vb_h, s_u_t, s_u_h, s_c_s, s_c_h, s_c_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv0 = tl.load(kv_indptr + b)
    t0 = tl.load(tile_indptr + b)
    n_tiles = tl.load(tile_indptr + b + 1) - t0
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = t0 + split * per_split
    t_end = tl.minimum(t_begin + per_split, t0 + n_tiles)
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < GROUP
    head = kvh * GROUP + offs_m
    q_off = b * s_q_b + head[:, None] * s_q_h
    q_lo = tl.load(q + q_off + offs_h[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q + q_off + HALF + offs_h[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    for t in range(t_begin, t_end):
        t_start = tl.load(tile_start + t)
        t_len = tl.load(tile_len + t)
        k_lo, k_hi, v_lo, v_hi = _reader_kv_tile(
            k_buffer, v_buffer, kv_indices + kv0, kvh, t_start, t_len,
            tl.load(tile_span + t), tl.load(tile_shift + t), tl.load(tile_urow + t),
            k_u, k_c, v_u, v_c, inv_freq,
            s_kb_t, s_kb_h, s_vb_t, s_vb_h, s_u_t, s_u_h, s_c_s, s_c_h, s_c_d,
            BLOCK_N, HALF, BLOCK_R, DOT_PREC,
        )
        ok = row_ok[:, None] & (offs_n < t_len)[None, :]
        m_i, l_i, acc_lo, acc_hi = _attend_tile(
            q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale, DOT_PREC
        )
    # An empty split (more splits than tiles) reports lse = _NEG, which gets weight 0 when merged.
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG)
    mo = mid_o + b * s_mo_b + head[:, None] * s_mo_h + split * s_mo_s
    tl.store(mo + offs_h[None, :], acc_lo * inv_l[:, None], mask=row_ok[:, None])
    tl.store(mo + HALF + offs_h[None, :], acc_hi * inv_l[:, None], mask=row_ok[:, None])
    tl.store(mid_lse + b * s_ml_b + head * s_ml_h + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    mid_o, mid_lse, o, NUM_SPLITS, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, s_o_b, s_o_h,
    BLOCK_S: tl.constexpr, HEAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD)
    ok = offs_s < NUM_SPLITS
    lse = tl.load(mid_lse + b * s_ml_b + h * s_ml_h + offs_s, mask=ok, other=_NEG)
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(ok, w, 0.0)
    part = tl.load(
        mid_o + b * s_mo_b + h * s_mo_h + offs_s[:, None] * s_mo_s + offs_d[None, :],
        mask=ok[:, None], other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o + b * s_o_b + h * s_o_h + offs_d, out.to(o.dtype.element_ty))


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


def _common_args(k_buffer, v_buffer, packed: PackedFactors) -> list:
    return [
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        packed.k_u.stride(0), packed.k_u.stride(1),
        packed.k_c.stride(0), packed.k_c.stride(1), packed.k_c.stride(2),
    ]


def _tile_args(plan: DeltaPlan) -> list:
    return [plan.tile_indptr, plan.tile_start, plan.tile_len, plan.tile_span, plan.tile_shift,
            plan.tile_urow]


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
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * _LOG2E
    grid = (plan.batch_size, k_buffer.shape[1], triton.cdiv(max(plan.max_queries, 1), tokens))
    _delta_extend_kernel[grid](
        q, o, k_buffer, v_buffer, plan.kv_indices, plan.qo_indptr, plan.kv_indptr,
        *_tile_args(plan), packed.k_u, packed.k_c, packed.v_u, packed.v_c,
        inv_freq, scale, group, tokens,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), *_common_args(k_buffer, v_buffer, packed),
        BLOCK_M=block_m, BLOCK_N=plan.block_n, HALF=head_dim // 2, BLOCK_R=packed.block_r,
        DOT_PREC=_dot_precision(q.dtype), num_warps=_num_warps(head_dim, block_m),
    )
    return o


def default_num_splits(batch_size: int, num_kv_heads: int, max_tiles: int, num_sms: int = 132) -> int:
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
        sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 1)
        num_splits = default_num_splits(batch, k_buffer.shape[1], plan.max_tiles, sms)
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * _LOG2E
    _delta_decode_kernel[(batch, k_buffer.shape[1], num_splits)](
        q, mid_o, mid_lse, k_buffer, v_buffer, plan.kv_indices, plan.kv_indptr,
        *_tile_args(plan), packed.k_u, packed.k_c, packed.v_u, packed.v_c,
        inv_freq, scale, group, num_splits,
        q.stride(0), q.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), *_common_args(k_buffer, v_buffer, packed),
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=plan.block_n, HALF=head_dim // 2,
        BLOCK_R=packed.block_r, DOT_PREC=_dot_precision(q.dtype), num_warps=4,
    )
    o = torch.empty_like(q)
    _merge_splits_kernel[(batch, num_heads)](
        mid_o, mid_lse, o, num_splits, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), o.stride(0), o.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD=head_dim,
    )
    return o
