"""Tensor work of the serving read path: borrowed spans re-positioned, head mass measured.

The attention backend (``integration/delta_attention_backend.py``) gathers a row's keys and
values from the pool and calls these; they know nothing of SGLang.

- :func:`rotate_keys` re-positions every borrowed key by its own shift (``R(δ)·k``: the pool
  holds keys rotated at the owner's positions; values need nothing), one gather of cos/sin per
  key and one rotation for the whole row, however many runs the row has.
- :func:`transform_spans` does the same one span at a time: the reference that
  :func:`rotate_keys` and decode's query rotation (``shifted_query.py``) are tested against.
- :func:`head_mass` is the softmax mass each query puts on the agent head's key rows, which the
  owner's pass records for ``policy/recompute.py``.
- :func:`tail_attention` is a plain row's extend: its new queries only, over their causal
  prefix (reference: :func:`padded_tail_attention`, the query padded to the whole sequence).
- :func:`gather_pairs` gathers, at one layer, what a reader's factored leaves are fitted on: the
  owner's K/V of the tokens it recomputes, re-positioned, and its own exact K/V of them
  (``attention/deviation_factors.py``).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.deviation_factors import LeafFactorFit
from sglang_kvcmas.attention.rope import ShiftRope, as_shift_rope, rope_cos_sin, rotate
from sglang_kvcmas.attention.spans import KeyShifts, RowSpans

PROBE_BLOCK = 256
"""Query rows scored at once by :func:`head_mass` (bounds its [H, block, n_kv] scores)."""


def transform_spans(
    k: torch.Tensor,
    row: RowSpans,
    rope: ShiftRope | torch.Tensor,
    cos_sin_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Re-position one row's borrowed keys by their spans' shifts, in place.

    Args:
        k: [seq_len, H_kv, d] keys gathered from the pool in row order (a copy, not the pool)
        row: the row's borrowed spans; positions are row indices
        rope: the model's rotary (:class:`ShiftRope`), or full-width ``inv_freq: [d // 2]``
        cos_sin_cache: optional memo ``shift -> (cos, sin)``, each [rotary_dim // 2] on ``k``'s
            device
    Returns:
        k, the same tensor.
    """
    rope = as_shift_rope(rope)
    for span in row.reads:
        if span.start >= k.shape[0] or not span.shift:
            continue
        sl = slice(span.start, min(span.end, k.shape[0]))
        cs = None if cos_sin_cache is None else cos_sin_cache.get(span.shift)
        if cs is None:
            cos, sin = rope_cos_sin(torch.tensor([span.shift]), rope.inv_freq)
            cs = (cos[0].to(k.device), sin[0].to(k.device))
            if cos_sin_cache is not None:
                cos_sin_cache[span.shift] = cs
        k[sl] = rotate(k[sl].to(torch.float32), *cs, rope).to(k.dtype)
    return k


def rotate_keys(
    k: torch.Tensor, key_shifts: KeyShifts, rope: ShiftRope | torch.Tensor
) -> torch.Tensor:
    """Every key re-positioned by its shift (a new tensor; ``k`` is not modified).

    Args:
        k: [n, H_kv, d] keys gathered from the pool in row order.
        key_shifts: the row's per-key shift map.
        rope: the model's rotary (:class:`ShiftRope`), or full-width ``inv_freq: [d // 2]``.
    Returns:
        [n, H_kv, d] in ``k.dtype``; equals :func:`transform_spans` over the map's spans.
    """
    rope = as_shift_rope(rope)
    n = k.shape[0]
    m = min(n, key_shifts.index.numel())
    if m == 0 or not key_shifts.any:
        return k
    cos, sin = rope_cos_sin(key_shifts.shifts, rope.inv_freq)  # [S, rotary_dim/2]
    idx = key_shifts.index[:m].to(k.device)
    cos, sin = cos.to(k.device)[idx][:, None, :], sin.to(k.device)[idx][:, None, :]
    out = k.clone()
    out[:m] = rotate(k[:m].to(torch.float32), cos, sin, rope).to(k.dtype)
    return out


def head_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
    head_from: int, head_to: int,
) -> torch.Tensor:
    """Softmax mass each query puts on key rows ``[head_from, head_to)``, mean over heads.

    Args:
        q: [H, n_q, d] queries (RoPE applied).
        k: [H_kv, n_kv, d] keys as attention reads them.
        q_pos: [n_q] true positions of the queries; k_pos: [n_kv] of the keys (causal by
            position: a query sees keys at positions <= its own).
        scale: softmax scale.
    Returns:
        [n_q] float32.
    """
    kk = k.float().repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    out = []
    for lo in range(0, q.shape[1], PROBE_BLOCK):
        qb = q[:, lo : lo + PROBE_BLOCK].float()
        scores = (qb @ kk.transpose(1, 2)) * scale  # [H, b, n_kv]
        hidden = k_pos[None, None, :] > q_pos[None, lo : lo + PROBE_BLOCK, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        total = torch.logsumexp(scores, dim=-1)
        head = torch.logsumexp(scores[..., head_from:head_to], dim=-1)
        out.append(torch.exp(head - total).mean(0))
    return torch.cat(out) if out else q.new_zeros(0, dtype=torch.float32)


def tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int,
                   causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention of the last ``n_q`` of ``n_kv`` positions (a row's extend over a cached prefix
    of ``n_prefix``), computed for those queries only.

    Args:
        q: [H, n_q, d]; k, v: [H_kv, n_kv, d], n_kv = n_prefix + n_q.
        causal: query j attends keys 0 .. n_prefix + j; else every key.
    Returns:
        [H, n_q, d]; the rows ``n_prefix:`` of attention with the query padded to ``n_kv``
        (:func:`padded_tail_attention`, the reference), at ``n_q / n_kv`` of its work.
    """
    n_q, n_kv = q.shape[-2], k.shape[-2]
    mask = None
    if causal and n_prefix:
        mask = torch.arange(n_kv, device=q.device)[None, :] <= (
            n_prefix + torch.arange(n_q, device=q.device))[:, None]  # [n_q, n_kv]
    return scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
        is_causal=causal and not n_prefix, enable_gqa=enable_gqa, scale=scale,
    ).squeeze(0)


def padded_tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int,
                          causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Reference for :func:`tail_attention`: the query padded to all ``n_kv`` positions,
    attention over the whole square, its last ``n_q`` rows kept (SGLang's torch backend)."""
    q_full = torch.zeros((q.shape[0], k.shape[-2], q.shape[2]), dtype=q.dtype, device=q.device)
    q_full[:, n_prefix:, :] = q
    return scaled_dot_product_attention(
        q_full.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=causal,
        enable_gqa=enable_gqa, scale=scale,
    ).squeeze(0)[:, n_prefix:, :]


def gather_pairs(k_cache: torch.Tensor, v_cache: torch.Tensor, row_slots: torch.Tensor,
                 fit: LeafFactorFit, rope: ShiftRope | torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's fit inputs: (owner K re-positioned, reader's exact K, owner V, exact V),
    each [p, H_kv, d] float32.

    Args:
        k_cache, v_cache: the layer's pool buffers [slots, H_kv, d].
        row_slots: [n] int64 the row's pool slots (``req_to_token[row, :n]``).
    """
    dev = k_cache.device
    owner = fit.owner_slots.to(dev)
    exact = row_slots[fit.exact_rows.to(row_slots.device)].to(dev)
    x_k = rotate_keys(k_cache[owner], KeyShifts.of_row(0, fit.owner_shifts), rope)
    return (x_k.to(torch.float32), k_cache[exact].to(torch.float32),
            v_cache[owner].to(torch.float32), v_cache[exact].to(torch.float32))
