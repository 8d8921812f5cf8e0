"""The delta read in plain torch, planned once per batch: the CPU serving path.

Same contract and result as :func:`~sglang_kvcmas_lab.attention.reference.delta_attention` (tested
equal), arranged for speed the way the kernels are:

- ``plan_torch_delta`` (once per batch) computes every cos/sin the read needs — one row per span
  for the shift δ, one row per span token for its reader position — instead of per layer.
- ``run`` (per layer) corrects keys in a gathered copy (the rotated deviation must be formed per
  token anyway), but never forms per-agent values: ``P·(V + U_v·C_vᵀ) = P·V + (P·U_v)·C_vᵀ``, the
  LoRA form, costs O(n_q·L·r) instead of O(L·d·r).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest, SpanFactors, check_factors
from sglang_kvcmas.attention.rope import rope_cos_sin, rotate_halves


@dataclass(frozen=True)
class SpanRope:
    """Rotations of one span: shift rows [1, 1, d/2], reader-position rows [length, 1, d/2]."""

    shift_cos: torch.Tensor
    shift_sin: torch.Tensor
    pos_cos: torch.Tensor
    pos_sin: torch.Tensor


@dataclass(frozen=True)
class TorchDeltaPlan:
    """Per-batch state of the torch read path.

    Attributes:
        requests: the batch.
        ropes: ``ropes[i][j]`` are the rotations of span j of request i.
    """

    requests: tuple[DeltaRequest, ...]
    ropes: tuple[tuple[SpanRope, ...], ...]


def plan_torch_delta(
    requests: Sequence[DeltaRequest], inv_freq: torch.Tensor, device: torch.device | str = "cpu"
) -> TorchDeltaPlan:
    """Precompute the rotations of every span (layer independent).

    Args:
        requests: the batch
        inv_freq: [d // 2] float32 RoPE frequencies
    """
    inv = inv_freq.to(device)
    ropes = []
    for req in requests:
        spans = []
        for span in req.spans:
            sc, ss = rope_cos_sin(torch.tensor([span.shift], device=device), inv)
            pc, ps = rope_cos_sin(torch.arange(span.start, span.end, device=device), inv)
            spans.append(SpanRope(sc[:, None], ss[:, None], pc[:, None], ps[:, None]))
        ropes.append(tuple(spans))
    return TorchDeltaPlan(tuple(requests), tuple(ropes))


def run_torch_delta(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: TorchDeltaPlan,
    factors: Sequence[Sequence[SpanFactors]] | None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """One layer of extend/decode attention through deltas.

    Args:
        q: [total_queries, H, d] post-RoPE queries, requests in plan order
        k_buffer: [pool_size, H_kv, d] post-RoPE keys as SGLang stores them
        v_buffer: [pool_size, H_kv, d]
        plan: from :func:`plan_torch_delta`
        factors: ``factors[i][j]``: this layer's delta for span j of request i; None = no deltas
        sm_scale: default ``1/sqrt(d)``
    Returns:
        [total_queries, H, d] in q's dtype
    """
    check_factors(plan.requests, None if factors is None else [list(f) for f in factors])
    num_heads, d = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    row = 0
    for i, req in enumerate(plan.requests):
        n_q, n_kv = req.num_queries, req.seq_len
        idx = req.kv_indices.to(k_buffer.device)
        k = k_buffer[idx].to(torch.float32)
        v = v_buffer[idx].to(torch.float32)
        facs = factors[i] if factors is not None else [SpanFactors()] * len(req.spans)
        for span, rope, f in zip(req.spans, plan.ropes[i], facs, strict=True):
            sl = slice(span.start, span.end)
            if span.shift:
                k[sl] = rotate_halves(k[sl], rope.shift_cos, rope.shift_sin)
            if f.k is not None:
                k[sl] += rotate_halves(f.k.dense(), rope.pos_cos, rope.pos_sin)
        qf = q[row : row + n_q].to(torch.float32).view(n_q, num_kv_heads, group, d)
        scores = torch.einsum("qhgd,khd->hgqk", qf, k) * scale
        if n_q > 1:
            q_pos = torch.arange(n_kv - n_q, n_kv, device=q.device)
            causal = torch.arange(n_kv, device=q.device)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->hgqd", probs, v)
        for span, f in zip(req.spans, facs, strict=True):
            if f.v is not None:  # P·U_v then ·C_vᵀ: the per-agent V is never formed
                pu = torch.einsum(
                    "hgqk,khr->hgqr", probs[..., span.start : span.end], f.v.u.float()
                )
                o += torch.einsum("hgqr,hdr->hgqd", pu, f.v.c.float())
        out[row : row + n_q] = o.permute(2, 0, 1, 3).reshape(n_q, num_heads, d).to(q.dtype)
        row += n_q
    if row != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, the plan asks for {row}")
    return out
