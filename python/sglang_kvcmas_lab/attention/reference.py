"""PyTorch reference for attention that reads shared KV through per-agent low-rank deltas.

This is the oracle for the Triton kernels and the FlashInfer variant, and the CPU serving path.

**What the pool stores (decided).** SGLang writes keys into ``k_buffer`` *after* RoPE, at the
positions of the agent that computed them. A shared span's base keys are therefore the owner's
post-RoPE keys; deltas are factored on **pre-RoPE** keys (RoPE would inflate a low-rank deviation
to rank ``head_dim``) and on values.

**The algebra.** For a token t of a shared span read by agent b, owned by agent a:

    p_a(t)       owner position,  p_b(t) = p_a(t) + δ  reader position (δ = span shift)
    k_base(t)    = R(p_a)·k_a(t)                 what the pool holds (k_a: owner's pre-RoPE key)
    k_b(t)       = k_a(t) + U(t)·Cᵀ              reader's pre-RoPE key, rank-r deviation
    key read     = R(p_b)·k_b(t)
                 = R(p_b)·k_a + R(p_b)·U·Cᵀ
                 = R(δ)·R(p_a)·k_a + R(p_b)·U·Cᵀ          (rotations compose)
                 = R(δ)·k_base(t) + R(p_b(t))·(U(t)·Cᵀ)
    value read   = v_base(t) + U_v(t)·C_vᵀ        (values carry no position)

So the base key is rotated by the span's constant shift δ (one cos/sin pair per frequency for the
whole span) and the reconstructed pre-RoPE deviation is rotated at the reader's own positions. With
δ = 0 and no delta the read is the pool itself; an agent reading its own KV reads it exactly.
Queries arrive already rotated at reader positions, as SGLang computes them.

The LoRA form of PReCache's value read, ``P·(V0 + s·a·B) = P·V0 + s·(P·a)·B``, is the same
identity with U = a, Cᵀ = s·B: :func:`lora_value_read` computes the right-hand side, which never
forms a per-agent V.

Shapes: ``H`` query heads, ``H_kv`` KV heads (GQA: query head h reads KV head ``h // (H // H_kv)``),
``d`` head_dim, ``r`` rank. Computation is float32; outputs are cast to the query dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest, SpanFactors, check_factors
from sglang_kvcmas.attention.rope import apply_rope


def reader_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    request: DeltaRequest,
    factors: Sequence[SpanFactors] | None,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize the keys and values one reader sees (the naive path the kernels avoid).

    Args:
        k_buffer: [pool_size, H_kv, d] post-RoPE keys, any float dtype
        v_buffer: [pool_size, H_kv, d]
        request: the reader's sequence and its shared spans
        factors: one :class:`SpanFactors` per span of ``request`` (None: no deltas, shifts only)
        inv_freq: [d // 2] float32 RoPE frequencies
    Returns:
        (k, v): each [seq_len, H_kv, d] float32, keys rotated at reader positions.
    """
    idx = request.kv_indices.to(k_buffer.device)
    k = k_buffer[idx].to(torch.float32)
    v = v_buffer[idx].to(torch.float32)
    for j, span in enumerate(request.spans):
        sl = slice(span.start, span.end)
        f = factors[j] if factors is not None else SpanFactors()
        if span.shift:
            k[sl] = apply_rope(k[sl], torch.tensor([span.shift]), inv_freq)
        if f.k is not None:
            reader_pos = torch.arange(span.start, span.end)
            k[sl] += apply_rope(f.k.dense().to(k.device), reader_pos, inv_freq)
        if f.v is not None:
            v[sl] += f.v.dense().to(v.device)
    return k, v


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:
    """Causal GQA attention of the last ``n_q`` positions of a sequence over all of it.

    Args:
        q: [n_q, H, d] queries of positions ``n_kv − n_q .. n_kv − 1``
        k: [n_kv, H_kv, d]
        v: [n_kv, H_kv, d]
        sm_scale: softmax scale, default ``1/sqrt(d)``
    Returns:
        [n_q, H, d] float32
    """
    n_q, num_heads, d = q.shape
    n_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf = q.to(torch.float32).view(n_q, num_kv_heads, group, d)
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.to(torch.float32)) * scale
    q_pos = torch.arange(n_kv - n_q, n_kv, device=q.device)
    k_pos = torch.arange(n_kv, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.to(torch.float32))
    return out.reshape(n_q, num_heads, d)


def delta_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    requests: Sequence[DeltaRequest],
    factors: Sequence[Sequence[SpanFactors]] | None,
    inv_freq: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Extend (or decode) attention for a batch of readers over a paged pool with shared spans.

    Args:
        q: [total_queries, H, d] post-RoPE queries, requests concatenated in order, each request's
            ``num_queries`` rows being its last positions
        k_buffer: [pool_size, H_kv, d] post-RoPE keys as SGLang stores them
        v_buffer: [pool_size, H_kv, d]
        requests: one :class:`DeltaRequest` per reader sequence
        factors: ``factors[i][j]`` is this layer's delta for span j of request i; None = no deltas
        inv_freq: [d // 2] float32 RoPE frequencies of the model
        sm_scale: softmax scale, default ``1/sqrt(d)``
    Returns:
        [total_queries, H, d] in q's dtype
    """
    check_factors(list(requests), None if factors is None else [list(f) for f in factors])
    out = torch.empty_like(q)
    row = 0
    for i, req in enumerate(requests):
        k, v = reader_kv(k_buffer, v_buffer, req, None if factors is None else factors[i], inv_freq)
        rows = slice(row, row + req.num_queries)
        out[rows] = causal_attention(q[rows], k, v, sm_scale).to(q.dtype)
        row += req.num_queries
    if row != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, requests ask for {row}")
    return out


def delta_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    requests: Sequence[DeltaRequest],
    factors: Sequence[Sequence[SpanFactors]] | None,
    inv_freq: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Decode: one query per request (``q: [batch, H, d]``); see :func:`delta_attention`."""
    if any(r.num_queries != 1 for r in requests):
        raise ValueError("decode requests have exactly one query each")
    return delta_attention(q, k_buffer, v_buffer, requests, factors, inv_freq, sm_scale)


def plain_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    requests: Sequence[DeltaRequest],
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention over the pool exactly as stored (no shifts, no deltas): the baseline.

    Args/returns as :func:`delta_attention`.
    """
    plain = [DeltaRequest(r.kv_indices, r.num_queries) for r in requests]
    empty = torch.empty(k_buffer.shape[-1] // 2)
    return delta_attention(q, k_buffer, v_buffer, plain, None, empty, sm_scale)


def lora_value_read(
    probs: torch.Tensor, v0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """PReCache's value read without a per-agent V: ``P·V0 + s·(P·a)·B``.

    Args:
        probs: [H_kv, n_q, n_kv] attention probabilities (one KV head's queries stacked)
        v0: [n_kv, H_kv, d] base values
        a: [n_kv, H_kv, r] the agent's low-rank cache ``X0·A``
        b: [H_kv, r, d] the adapter's B, per KV head
        scaling: LoRA scaling s
    Returns:
        [n_q, H_kv, d] float32
    """
    pv0 = torch.einsum("hqk,khd->qhd", probs.float(), v0.float())
    pa = torch.einsum("hqk,khr->qhr", probs.float(), a.float())
    return pv0 + scaling * torch.einsum("qhr,hrd->qhd", pa, b.float())
