"""Tensor work of the serving read path: borrowed spans re-positioned, head mass measured.

The attention backend (``integration/delta_attention_backend.py``) gathers a row's keys and
values from the pool and calls these; they know nothing of SGLang. The pool holds keys rotated at
the owner's positions, so a borrowed key is read as ``R(δ)·k`` (values need nothing):
:func:`rotate_keys` does it for a whole row in one rotation, :func:`transform_spans` one span at
a time (the reference). :func:`head_mass` is what the owner's pass records for
``policy/recompute.py``; :func:`gather_pairs` is what factored leaves are fitted on.
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


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""PyTorch's CPU flash attention, which SDPA dispatches ``tail_attention`` to and which also
returns each query's log-sum-exp; None in a PyTorch without it."""


def fused_mass_serves(q: torch.Tensor, causal: bool) -> bool:
    """Whether :func:`tail_attention_and_mass` serves these queries: causal, on CPU, in a
    floating dtype the CPU flash kernel takes."""
    return causal and _FLASH_CPU is not None and q.device.type == "cpu" and \
        q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def tail_attention_and_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int,
                            scale: float | None, head_from: int, head_to: int,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain row's causal extend and its head mass in one pass over the keys (CPU).

    The mass on key rows ``[head_from, head_to)`` is ``exp(lse_head - lse)``: ``lse``, each
    query's log-sum-exp over every key it sees, comes with the flash kernel's output, so only
    the head's few keys are scored again (:func:`head_mass` scores every key a second time).

    Args:
        q: [H, n_q, d] (RoPE applied); k, v: [H_kv, n_kv, d] in row order (row index =
            position), n_kv = n_prefix + n_q; H a multiple of H_kv.
        scale: softmax scale (None: ``d ** -0.5``).
    Returns:
        (out [H, n_q, d]: :func:`tail_attention` with ``causal``, bit for bit where SDPA picks the
        flash kernel; mass [n_q] float32: :func:`head_mass` with positions ``arange(n_kv)``, to
        float rounding).
    """
    n_q, n_kv = q.shape[-2], k.shape[-2]
    head_to = max(head_from, min(head_to, n_kv))  # a chunk may end inside the head
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(group, dim=0) if group > 1 else k
    vv = v.repeat_interleave(group, dim=0) if group > 1 else v
    q_pos = n_prefix + torch.arange(n_q, device=q.device)
    mask = None
    if n_prefix:  # the flash kernel's own causal mask is top-left: a tail needs its own
        visible = torch.arange(n_kv, device=q.device)[None, :] <= q_pos[:, None]
        mask = torch.zeros((n_q, n_kv), dtype=q.dtype, device=q.device).masked_fill_(
            ~visible, float("-inf"))
    out, lse = _FLASH_CPU(q.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), 0.0, not n_prefix,
                          attn_mask=mask, scale=scale)
    head = (q.float() @ kk[:, head_from:head_to].float().transpose(1, 2)) * scale  # [H, n_q, h]
    hidden = torch.arange(head_from, head_to, device=q.device)[None, :] > q_pos[:, None]
    head = head.masked_fill(hidden, float("-inf"))
    mass = torch.exp(torch.logsumexp(head, dim=-1) - lse[0].float()).mean(0)
    return out.squeeze(0), mass


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
