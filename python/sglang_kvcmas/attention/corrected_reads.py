"""Reading borrowed KV through a reader's low-rank correction (``attention/lowrank.py``).

- :func:`reference_corrected_attention`: the naive reference. Every key re-positioned by its own
  shift and, where the row corrects it, corrected explicitly one key at a time
  (``x + (x·A + c)·Bᵀ``, the same for its value); then causal attention by true position. The
  backend's extend and decode are tested against it (``test/serving/test_lowrank.py``).
- :func:`correct_rows`: extend's application: the marked rows of a gathered, re-positioned row
  corrected in one product per layer (extend already holds the row's keys as a copy).
- :func:`corrected_grouped_decode`: decode's application, nearly free. Keys gathered grouped by
  (shift, corrected) (:func:`grouped_marked`); a corrected group scores with the corrected
  query ``q + (q·B)·Aᵀ`` rotated by the group's shift, plus ``(q·B)·c``; values are corrected
  on the output, ``y + (y·A + (Σp)·c)·Bᵀ`` over the corrected groups' ``y = Σp·v``.
- :func:`gather_pairs`: the fit's inputs at one layer, from the pool (for the affine fit and
  for factored leaves alike).

A row with factored leaves (``attention/leaf_factors.py``) adds each such token's deviation to
its gathered key and value: ``correct_rows`` in extend, and in decode too (its keys gathered and
re-positioned as extend does; the grouped decode above serves the affine factors only).

A row or layer without factors never comes here: the backend takes today's path, bit for bit.
"""

from __future__ import annotations

import torch

from sglang_kvcmas.attention.leaf_factors import LeafFactorFit
from sglang_kvcmas.attention.lowrank import CorrectionFit, LayerCorrection
from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, as_shift_rope, rope_cos_sin, rotate
from sglang_kvcmas.attention.span_reads import rotate_keys
from sglang_kvcmas.attention.spans import KeyShifts


def reference_corrected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
    k_pos: torch.Tensor, key_shift: torch.Tensor, corrected: torch.Tensor,
    rope: ShiftRope | torch.Tensor, scale: float, lc: LayerCorrection | None,
) -> torch.Tensor:
    """Attention over a row whose every borrowed key is re-positioned and corrected explicitly.

    Args:
        q: [n_q, H, d] queries (RoPE applied at ``q_pos``).
        k: [n, H_kv, d] keys as the pool stores them (rotated at their owners' positions).
        v: [n, H_kv, d] values.
        q_pos, k_pos: [n_q], [n] true positions (a query sees keys at positions <= its own).
        key_shift: [n] int64 shift of each key (0: own).
        corrected: [n] bool keys (and values) read through the affine factors.
        lc: the layer's correction (None: re-positioned only); its ``tokens`` deviations are
            added to their rows (after the affine factors, if a row has both).
    Returns:
        [n_q, H, d] float32.
    """
    rope = as_shift_rope(rope)
    keys, vals = [], []
    for j in range(k.shape[0]):
        kj, vj = k[j : j + 1].to(torch.float32), v[j : j + 1].to(torch.float32)
        if int(key_shift[j]):
            kj = apply_rope(kj, key_shift[j : j + 1], rope)
        if lc is not None and bool(corrected[j]):
            kj = lc.k.apply(kj) if lc.k is not None else kj
            vj = lc.v.apply(vj) if lc.v is not None else vj
        if lc is not None and lc.tokens is not None:
            at = torch.nonzero(lc.tokens.rows == j).flatten()[:1]
            if at.numel():  # a factored leaf's token: its deviation, the key's at its position
                kj = kj + apply_rope(lc.tokens.k[at], lc.tokens.positions[at], rope)
                vj = vj + lc.tokens.v[at]
        keys.append(kj)
        vals.append(vj)
    kk, vv = torch.cat(keys), torch.cat(vals)  # [n, H_kv, d]
    g = q.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), kk) * scale
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


def correct_rows(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, lc: LayerCorrection,
                 rope: ShiftRope | torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``mask`` of a gathered row corrected by the affine factors, and the rows of
    ``lc.tokens`` by their deviations (new tensors; the others as given).

    Args:
        k, v: [n, H_kv, d] keys (re-positioned) and values in row order.
        mask: [n] bool.
        rope: the model's rotary (needed where ``lc.tokens`` is set: their key deviations are
            rotated to their positions).
    """
    idx = torch.nonzero(mask.to(k.device)).flatten()
    if idx.numel() and lc.k is not None:
        k = k.clone()
        k[idx] = lc.k.apply(k[idx])
    if idx.numel() and lc.v is not None:
        v = v.clone()
        v[idx] = lc.v.apply(v[idx])
    if lc.tokens is not None:
        if rope is None:
            raise ValueError("factored leaves are read with the model's rotary")
        k, v = lc.tokens.apply(k, v, rope)
    return k, v


def grouped_marked(key_shifts: KeyShifts, mask: torch.Tensor, n: int
                   ) -> tuple[torch.Tensor, tuple[tuple[int, int, int, bool], ...]]:
    """Row indices ``0 .. n-1`` grouped by (shift, corrected): the order and the groups.

    Args:
        mask: [m] bool corrected row indices (rows ``>= m``: not corrected).
    Returns:
        (order [n] int64, groups ``(lo, hi, i, corrected)``: ``order[lo:hi]`` are read at
        ``shifts[i]``, corrected or not); uncorrected shift-0 keys last.
    """
    idx = key_shifts.index_upto(n)
    marked = torch.zeros(n, dtype=torch.int64)
    m = min(n, mask.numel())
    marked[:m] = mask[:m].to(torch.int64)
    code = idx * 2 + marked
    big = int(code.max()) + 1 if n else 1
    order = torch.sort(torch.where(code == 0, big, code), stable=True).indices
    values, counts = torch.unique_consecutive(code[order], return_counts=True)
    groups, at = [], 0
    for c, cnt in zip(values.tolist(), counts.tolist()):
        groups.append((at, at + cnt, c // 2, bool(c % 2)))
        at += cnt
    return order, tuple(groups)


def corrected_grouped_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shifts: torch.Tensor,
    groups: tuple[tuple[int, int, int, bool], ...], rope: ShiftRope | torch.Tensor, scale: float,
    lc: LayerCorrection,
) -> torch.Tensor:
    """Decode attention of one query per head over keys in (shift, corrected) group order.

    Args:
        q: [H, 1, d] query (RoPE applied at the reader's position).
        k, v: [H_kv, n_kv, d] keys (owner positions) and values in group order.
        shifts: [S] int64 distinct shifts.
        groups: from :func:`grouped_marked`; they cover ``[0, n_kv)``.
        lc: the layer's correction.
    Returns:
        [H, 1, d] in ``q.dtype``; equals :func:`reference_corrected_attention`.
    """
    rope = as_shift_rope(rope)
    h, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    g, n_kv = h // hkv, k.shape[1]
    cos, sin = rope_cos_sin(-shifts.to(q.device), rope.inv_freq)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    qf = q.reshape(hkv, g, d).to(torch.float32)
    q_s = rotate(qf, cos, sin, rope) * scale  # [S, H_kv, g, d]
    if lc.k is not None:
        qc, bias = lc.k.query_side(qf)  # the correction, in the reader's frame: before R(-δ)
        qc_s, bias = rotate(qc, cos, sin, rope) * scale, bias[..., None] * scale
    kf, vf = k.to(torch.float32), v.to(torch.float32)
    scores = torch.empty((hkv, g, n_kv), dtype=torch.float32, device=q.device)
    for lo, hi, i, corr in groups:
        if corr and lc.k is not None:
            scores[:, :, lo:hi] = qc_s[i] @ kf[:, lo:hi].transpose(1, 2) + bias
        else:
            scores[:, :, lo:hi] = q_s[i] @ kf[:, lo:hi].transpose(1, 2)
    p = torch.softmax(scores, dim=-1)
    out = torch.zeros((hkv, g, d), dtype=torch.float32, device=q.device)
    y_c, mass_c = torch.zeros_like(out), torch.zeros((hkv, g), dtype=torch.float32,
                                                     device=q.device)
    for lo, hi, _, corr in groups:
        part = p[:, :, lo:hi] @ vf[:, lo:hi]
        if corr and lc.v is not None:
            y_c += part
            mass_c += p[:, :, lo:hi].sum(-1)
        else:
            out += part
    if lc.v is not None:
        out += lc.v.output_side(y_c, mass_c)
    return out.reshape(h, 1, d).to(q.dtype)


def gather_pairs(k_cache: torch.Tensor, v_cache: torch.Tensor, row_slots: torch.Tensor,
                 fit: CorrectionFit | LeafFactorFit, rope: ShiftRope | torch.Tensor
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
