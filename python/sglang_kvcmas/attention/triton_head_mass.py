"""Head mass on the agent head in one pass over a row's keys: ``span_reads.head_mass`` in Triton.

One program serves one query head and a block of queries. It walks the row's keys in tiles and
keeps two running log-sum-exps per query (base 2): over every key it sees (the softmax's
denominator) and over the keys it sees in ``[head_from, head_to)``. The mass is their ratio,
averaged over query heads afterwards; nothing of size ``n_q × n_kv`` is ever materialized.
Scores are float32 (``ieee`` dots), as the reference's. Like the delta kernels, it runs on CPU
tensors under ``TRITON_INTERPRET=1`` (how CI tests it against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_kvcmas.attention.triton_delta_kernels import LOG2E, NEG


@triton.jit
def _head_mass_kernel(
    q, k, q_pos, k_pos, out, n_q, n_kv, head_from, head_to, scale_log2,
    s_qh, s_qn, s_kh, s_kn, s_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[h, i] = softmax mass of query i (head h) on key rows [head_from, head_to)."""
    h = tl.program_id(1)
    offs_q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = offs_q < n_q
    mask_d = offs_d < D
    qt = tl.load(q + h * s_qh + offs_q[:, None] * s_qn + offs_d[None, :],
                 mask=mask_q[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    qp = tl.load(q_pos + offs_q, mask=mask_q, other=0)
    kv = k + (h // GROUP) * s_kh
    m_all = tl.full([BLOCK_Q], NEG, tl.float32)
    l_all = tl.zeros([BLOCK_Q], tl.float32)
    m_head = tl.full([BLOCK_Q], NEG, tl.float32)
    l_head = tl.zeros([BLOCK_Q], tl.float32)
    for start in range(0, n_kv, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        mask_k = offs_k < n_kv
        kt = tl.load(kv + offs_k[:, None] * s_kn + offs_d[None, :],
                     mask=mask_k[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        kp = tl.load(k_pos + offs_k, mask=mask_k, other=0)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale_log2  # [BLOCK_Q, BLOCK_K]
        seen = mask_k[None, :] & (kp[None, :] <= qp[:, None])
        s = tl.where(seen, s, NEG)
        m_new = tl.maximum(m_all, tl.max(s, 1))
        l_all = l_all * tl.exp2(m_all - m_new) + tl.sum(
            tl.where(seen, tl.exp2(s - m_new[:, None]), 0.0), 1)
        m_all = m_new
        in_head = seen & (offs_k[None, :] >= head_from) & (offs_k[None, :] < head_to)
        sh = tl.where(in_head, s, NEG)
        m_new = tl.maximum(m_head, tl.max(sh, 1))
        l_head = l_head * tl.exp2(m_head - m_new) + tl.sum(
            tl.where(in_head, tl.exp2(sh - m_new[:, None]), 0.0), 1)
        m_head = m_new
    mass = tl.where(l_head > 0, l_head / tl.maximum(l_all, 1e-30) * tl.exp2(m_head - m_all), 0.0)
    tl.store(out + h * s_oh + offs_q, mass, mask=mask_q)


def head_mass_triton(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
    head_from: int, head_to: int,
) -> torch.Tensor:
    """:func:`~sglang_kvcmas.attention.span_reads.head_mass` (same arguments, [n_q] float32);
    ``q``: [H, n_q, d] in any float dtype, last dimension contiguous or not."""
    h, n_q, d = q.shape
    h_kv, n_kv = k.shape[0], k.shape[1]
    if h % h_kv:
        raise ValueError(f"{h} query heads are not a multiple of {h_kv} KV heads")
    if n_q == 0:
        return q.new_zeros(0, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_pos = q_pos.to(device=q.device, dtype=torch.int64).contiguous()
    k_pos = k_pos.to(device=q.device, dtype=torch.int64).contiguous()
    out = torch.empty(h, n_q, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    block_q = 64 if block_d <= 128 else 32
    _head_mass_kernel[(triton.cdiv(n_q, block_q), h)](
        q, k, q_pos, k_pos, out, n_q, n_kv, max(0, head_from), max(0, head_to),
        scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
        GROUP=h // h_kv, D=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_K=64,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out.mean(0)
