"""Triton kernels of the delta read path (launched by :mod:`.triton_delta`, which documents them).

``_reader_kv_tile`` is the heart: one KV head's tile as a reader agent sees it, built in registers
from the base pool and the span's low-rank factors. The rest is flash attention around it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(NEG - m) == 0 and never NaN


@triton.jit
def _reader_kv_tile(
    k_buffer,
    v_buffer,
    kv_idx,
    t_start,
    t_len,
    span,
    shift,
    urow,
    k_u,
    k_c,
    v_u,
    v_c,
    inv_freq,
    s_kb_t,
    s_vb_t,
    s_u_t,
    s_c_s,
    s_c_d,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One KV head's tile as the reader sees it: (k_lo, k_hi, v), float32, [BLOCK_N, ·].

    ``k_buffer``, ``v_buffer``, ``k_u``, ``k_c``, ``v_u``, ``v_c`` already point at the KV head.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    mask_n = offs_n < t_len
    slots = tl.load(kv_idx + t_start + offs_n, mask=mask_n, other=0).to(tl.int64)
    kb = k_buffer + slots[:, None] * s_kb_t
    k_lo = tl.load(kb + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    k_hi = tl.load(kb + HALF + offs_h[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    vb = v_buffer + slots[:, None] * s_vb_t
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
        u_off = (urow + offs_n)[:, None] * s_u_t + offs_r[None, :]
        c_lo_off = span * s_c_s + offs_h[:, None] * s_c_d + offs_r[None, :]
        c_hi_off = c_lo_off + HALF * s_c_d
        uk = tl.load(k_u + u_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        dk_lo = tl.dot(
            uk, tl.trans(tl.load(k_c + c_lo_off).to(tl.float32)), input_precision=DOT_PREC
        )
        dk_hi = tl.dot(
            uk, tl.trans(tl.load(k_c + c_hi_off).to(tl.float32)), input_precision=DOT_PREC
        )
        # The deviation is pre-RoPE: rotate it at the reader's positions (= request-local index).
        ang = (t_start + offs_n).to(tl.float32)[:, None] * freq[None, :]
        cs = tl.cos(ang)
        sn = tl.sin(ang)
        k_lo += dk_lo * cs - dk_hi * sn
        k_hi += dk_hi * cs + dk_lo * sn
        uv = tl.load(v_u + u_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        v_lo += tl.dot(
            uv, tl.trans(tl.load(v_c + c_lo_off).to(tl.float32)), input_precision=DOT_PREC
        )
        v_hi += tl.dot(
            uv, tl.trans(tl.load(v_c + c_hi_off).to(tl.float32)), input_precision=DOT_PREC
        )
    return k_lo, k_hi, v_lo, v_hi


@triton.jit
def _attend_tile(
    q_lo,
    q_hi,
    k_lo,
    k_hi,
    v_lo,
    v_hi,
    ok,
    m_i,
    l_i,
    acc_lo,
    acc_hi,
    qk_scale,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with one tile; ``ok`` masks [BLOCK_M, BLOCK_N]."""
    dt = q_lo.dtype
    s = tl.dot(q_lo, tl.trans(k_lo.to(dt)), input_precision=DOT_PREC)
    s += tl.dot(q_hi, tl.trans(k_hi.to(dt)), input_precision=DOT_PREC)
    s = tl.where(ok, s * qk_scale, NEG)
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
    q,
    o,
    qo_indptr,
    qk_scale,
    GROUP,
    TOKENS,
    s_q_t,
    s_q_h,
    s_o_t,
    s_o_h,
    k_buffer,
    v_buffer,
    kv_indices,
    kv_indptr,
    tile_indptr,
    tile_start,
    tile_len,
    tile_span,
    tile_shift,
    tile_urow,
    k_u,
    k_c,
    v_u,
    v_c,
    inv_freq,
    s_kb_t,
    s_kb_h,
    s_vb_t,
    s_vb_h,
    s_u_t,
    s_u_h,
    s_c_s,
    s_c_h,
    s_c_d,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tok0 = tl.program_id(2) * TOKENS
    q0 = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q0
    if tok0 >= q_len:
        return
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
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    for t in range(tl.load(tile_indptr + b), tl.load(tile_indptr + b + 1)):
        t_start = tl.load(tile_start + t)
        if t_start <= last_pos:  # causal: later tiles are invisible to this block
            t_len = tl.load(tile_len + t)
            k_lo, k_hi, v_lo, v_hi = _reader_kv_tile(
                k_buffer + kvh * s_kb_h,
                v_buffer + kvh * s_vb_h,
                kv_indices + kv0,
                t_start,
                t_len,
                tl.load(tile_span + t),
                tl.load(tile_shift + t),
                tl.load(tile_urow + t),
                k_u + kvh * s_u_h,
                k_c + kvh * s_c_h,
                v_u + kvh * s_u_h,
                v_c + kvh * s_c_h,
                inv_freq,
                s_kb_t,
                s_vb_t,
                s_u_t,
                s_c_s,
                s_c_d,
                BLOCK_N,
                HALF,
                BLOCK_R,
                DOT_PREC,
            )
            kv_pos = t_start + offs_n
            ok = (offs_n < t_len)[None, :] & (kv_pos[None, :] <= q_pos[:, None])
            m_i, l_i, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale, DOT_PREC
            )
    inv_l = 1.0 / l_i
    o_off = (q0 + tok)[:, None] * s_o_t + (kvh * GROUP + offs_m % GROUP)[:, None] * s_o_h
    out_lo = (acc_lo * inv_l[:, None]).to(o.dtype.element_ty)
    out_hi = (acc_hi * inv_l[:, None]).to(o.dtype.element_ty)
    tl.store(o + o_off + offs_h[None, :], out_lo, mask=row_ok[:, None])
    tl.store(o + o_off + HALF + offs_h[None, :], out_hi, mask=row_ok[:, None])


@triton.jit
def _delta_decode_kernel(
    q,
    mid_o,
    mid_lse,
    qk_scale,
    GROUP,
    NUM_SPLITS,
    s_q_b,
    s_q_h,
    s_mo_b,
    s_mo_h,
    s_mo_s,
    s_ml_b,
    s_ml_h,
    k_buffer,
    v_buffer,
    kv_indices,
    kv_indptr,
    tile_indptr,
    tile_start,
    tile_len,
    tile_span,
    tile_shift,
    tile_urow,
    k_u,
    k_c,
    v_u,
    v_c,
    inv_freq,
    s_kb_t,
    s_kb_h,
    s_vb_t,
    s_vb_h,
    s_u_t,
    s_u_h,
    s_c_s,
    s_c_h,
    s_c_d,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
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
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    for t in range(t_begin, t_end):
        t_start = tl.load(tile_start + t)
        t_len = tl.load(tile_len + t)
        k_lo, k_hi, v_lo, v_hi = _reader_kv_tile(
            k_buffer + kvh * s_kb_h,
            v_buffer + kvh * s_vb_h,
            kv_indices + kv0,
            t_start,
            t_len,
            tl.load(tile_span + t),
            tl.load(tile_shift + t),
            tl.load(tile_urow + t),
            k_u + kvh * s_u_h,
            k_c + kvh * s_c_h,
            v_u + kvh * s_u_h,
            v_c + kvh * s_c_h,
            inv_freq,
            s_kb_t,
            s_vb_t,
            s_u_t,
            s_c_s,
            s_c_d,
            BLOCK_N,
            HALF,
            BLOCK_R,
            DOT_PREC,
        )
        ok = row_ok[:, None] & (offs_n < t_len)[None, :]
        m_i, l_i, acc_lo, acc_hi = _attend_tile(
            q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale, DOT_PREC
        )
    # An empty split (more splits than tiles) reports lse = NEG, which gets weight 0 when merged.
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), NEG)
    mo = mid_o + b * s_mo_b + head[:, None] * s_mo_h + split * s_mo_s
    tl.store(mo + offs_h[None, :], acc_lo * inv_l[:, None], mask=row_ok[:, None])
    tl.store(mo + HALF + offs_h[None, :], acc_hi * inv_l[:, None], mask=row_ok[:, None])
    tl.store(mid_lse + b * s_ml_b + head * s_ml_h + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    mid_o,
    mid_lse,
    o,
    NUM_SPLITS,
    s_mo_b,
    s_mo_h,
    s_mo_s,
    s_ml_b,
    s_ml_h,
    s_o_b,
    s_o_h,
    BLOCK_S: tl.constexpr,
    HEAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD)
    ok = offs_s < NUM_SPLITS
    lse = tl.load(mid_lse + b * s_ml_b + h * s_ml_h + offs_s, mask=ok, other=NEG)
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(ok, w, 0.0)
    part = tl.load(
        mid_o + b * s_mo_b + h * s_mo_h + offs_s[:, None] * s_mo_s + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o + b * s_o_b + h * s_o_h + offs_d, out.to(o.dtype.element_ty))
