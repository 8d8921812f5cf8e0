"""Decode attention over re-positioned shared spans by rotating the query, not the keys.

A reader's row holds borrowed keys rotated at the owner's positions; the span's read key is
``R(δ)·k`` (``attention/rope.py``). Rotations are orthogonal, so the score against it is

    q · R(δ)·k = (R(−δ)·q) · k

For one decode query that turns a rotation of every borrowed key, at every layer and step, into
one rotation of the query per distinct shift (one per owner). Attention does not depend on the
order of its keys, so the backend gathers a row's keys grouped by shift
(``KeyShifts.grouped``): one product per group, as many multiply-adds as plain attention, however
many runs the reader's exact leaves cut the borrowed spans into.

The reference is :func:`sglang_kvcmas.attention.span_reads.transform_spans` followed by SDPA.
"""

from __future__ import annotations

import torch

from sglang_kvcmas.attention.rope import ShiftRope, as_shift_rope, rope_cos_sin, rotate


def grouped_shift_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shifts: torch.Tensor,
    groups: tuple[tuple[int, int, int], ...],
    rope: ShiftRope | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per head over keys gathered in shift-group order
    (``KeyShifts.grouped``): one product per group, the query rotated by that group's shift.

    Args:
        q: [H, 1, d] query (RoPE applied at the reader's position).
        k: [H_kv, n_kv, d] keys in group order (owner positions); H % H_kv == 0.
        v: [H_kv, n_kv, d] values in the same order.
        shifts: [S] int64 distinct shifts.
        groups: ``(lo, hi, i)``: keys ``lo .. hi-1`` are read at ``shifts[i]``; they cover
            ``[0, n_kv)``.
        rope: the model's rotary (:class:`ShiftRope`), or full-width ``inv_freq: [d // 2]``.
    Returns:
        [H, 1, d] in ``q.dtype``.
    """
    rope = as_shift_rope(rope)
    h, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    g, n_kv = h // hkv, k.shape[1]
    cos, sin = rope_cos_sin(-shifts.to(q.device), rope.inv_freq)  # [S, rotary_dim/2] each
    qf = q.reshape(hkv, g, d).to(torch.float32)
    q_s = rotate(qf, cos[:, None, None, :], sin[:, None, None, :], rope) * scale  # [S, H_kv, g, d]
    kf = k.to(torch.float32)
    scores = torch.empty((hkv, g, n_kv), dtype=torch.float32, device=q.device)
    for lo, hi, i in groups:
        scores[:, :, lo:hi] = q_s[i] @ kf[:, lo:hi].transpose(1, 2)
    out = torch.softmax(scores, dim=-1) @ v.to(torch.float32)  # [H_kv, g, d]
    return out.reshape(h, 1, d).to(q.dtype)
