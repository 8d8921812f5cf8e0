"""Decode attention of many re-positioned rows at once: a few tensor ops per layer, not per row.

The per-row read (:func:`sglang_kvcmas.attention.shifted_query.grouped_shift_decode`) costs a
handful of PyTorch calls for each row at each layer, and on a CPU the calls, the gathers and the
transposed copies cost more than the arithmetic. Here the rows of a batch are planned once per
forward (every layer reads the same slots and shifts) into buckets of similar length, and each
layer reads a bucket in one flat gather and a handful of batched products:

    q_s[r, s]   = R(−shift[r, s])·q[r]                     every row's query, once per shift
    score[r, k] = q_s[r, shift_index[r, k]] · k_owner[r, k]  (all S products, then a gather)
    out[r]      = softmax(score[r] + pad_bias[r]) · v[r]

``q · R(δ)·k = (R(−δ)·q) · k`` (``shifted_query.py``). Scoring every key against all S rotated
queries costs S times the products of plain attention, so rows with more than ``max_shifts``
distinct shifts are left to the per-row path, as are rows the caller does not hand over.

A row's tokens read through factored leaves (``attention/deviation_factors.py``: the owner's key
re-positioned plus a deviation ``Δk`` rotated at the token's position, its value plus ``Δv``)
have their deviations added to the bucket's gathered copies of their keys and values, the key's
rotated to the owner's position ``p − δ`` as the gathered key sits there:
``R(−δ)q · (k + R(p−δ)Δk) = q · (R(δ)k + R(p)Δk)``. The deviations come expanded and rotated
once per layer and request (``LeafReads.in_owner_frame``).

The reference is the per-row path (``grouped_shift_decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas.attention.deviation_factors import LeafReads
from sglang_kvcmas.attention.rope import ShiftRope, as_shift_rope, rope_cos_sin, rotate
from sglang_kvcmas.attention.spans import KeyShifts

MAX_SHIFTS = 4
"""Rows with more distinct shifts (owners) than this take the per-row path."""

MAX_PAD = 1.3
"""A bucket's longest row is at most this times its shortest (bounds the padding gathered)."""

MAX_BUCKET_KEYS = 4096
"""Keys one bucket gathers at most (rows x longest row; a longer row is a bucket alone): the
gathered keys and values of a bucket stay in cache while its products read them."""


@dataclass(frozen=True)
class DecodeBucket:
    """Rows of similar length read together.

    Attributes:
        rows: [R] int64 the rows' indices in the batch.
        slots: [R, L] int64 pool slots of each row's keys in row order; padding repeats the
            row's first slot.
        shift_index: [R, L] int64 each key's index into its row's shifts (padding: 0).
        pad_bias: [R, 1, 1, L] float32, 0 for a key, -inf for padding.
        cos, sin: [R, S, rotary_dim // 2] float32 of each row's shifts negated (padding: 0).
        shifts: [R, S] int64 each row's shifts (padding: 0).
        leaves: per row that reads factored leaves: (its factored tokens, [m] int64 each
            token's shift in the row, [m] int64 the tokens' indices into the bucket's
            flattened ``[R * L]`` keys).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    shift_index: torch.Tensor
    pad_bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    shifts: torch.Tensor
    leaves: tuple[tuple[LeafReads, torch.Tensor, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class BatchedDecodePlan:
    """A decode batch's rows in buckets; ``rest``: the rows left to the per-row path."""

    buckets: tuple[DecodeBucket, ...]
    rest: tuple[int, ...]


def plan_batched_decode(
    kv_slots: list[torch.Tensor | None],
    shifts: list[KeyShifts | None],
    rope: ShiftRope | torch.Tensor,
    max_shifts: int = MAX_SHIFTS,
    max_pad: float = MAX_PAD,
    max_keys: int = MAX_BUCKET_KEYS,
    leaves: list[LeafReads | None] | None = None,
) -> BatchedDecodePlan:
    """Bucket a decode batch's rows, once per forward.

    Args:
        kv_slots: per row, [n_i] int64 pool slots of its keys in row order (n_i >= 1), or
            None for a row not to be read here; those, and rows with more than
            ``max_shifts`` shifts, are returned in ``rest``.
        shifts: per row, its per-key shifts (None: every key at shift 0).
        rope: the model's rotary (:class:`ShiftRope`) or full-width ``inv_freq``.
        leaves: per row, the tokens it reads through factored leaves (None: none).
    Returns:
        the plan; its buckets hold every other row exactly once.
    """
    rope = as_shift_rope(rope)
    n_rows = len(kv_slots)
    table = [s.shifts if s is not None else torch.zeros(1, dtype=torch.int64) for s in shifts]
    mine = [i for i in range(n_rows)
            if kv_slots[i] is not None and table[i].numel() <= max_shifts]
    taken = set(mine)
    rest = tuple(i for i in range(n_rows) if i not in taken)
    mine.sort(key=lambda i: kv_slots[i].numel())
    buckets, start = [], 0
    while start < len(mine):
        end, shortest = start + 1, kv_slots[mine[start]].numel()
        while end < len(mine):
            n = kv_slots[mine[end]].numel()
            if n > max_pad * shortest or (end - start + 1) * n > max_keys:
                break
            end += 1
        buckets.append(_bucket(mine[start:end], kv_slots, shifts, table, rope, leaves))
        start = end
    return BatchedDecodePlan(tuple(buckets), rest)


def _bucket(rows: list[int], kv_slots, shifts, table, rope: ShiftRope,
            leaves: list[LeafReads | None] | None) -> DecodeBucket:
    device = kv_slots[rows[0]].device
    lens = [kv_slots[i].numel() for i in rows]
    n_max, s_max = max(lens), max(table[i].numel() for i in rows)
    slots = torch.empty((len(rows), n_max), dtype=torch.int64, device=device)
    index = torch.zeros((len(rows), n_max), dtype=torch.int64)
    neg = torch.zeros((len(rows), s_max), dtype=torch.int64)
    for r, (i, n) in enumerate(zip(rows, lens)):
        slots[r, :n] = kv_slots[i]
        slots[r, n:] = kv_slots[i][0]
        if shifts[i] is not None:
            index[r, :n] = shifts[i].index_upto(n)
        neg[r, : table[i].numel()] = -table[i]
    valid = torch.arange(n_max)[None, :] < torch.tensor(lens)[:, None]
    bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
    cos, sin = rope_cos_sin(neg.flatten(), rope.inv_freq)
    half = cos.shape[-1]
    read = [] if leaves is None else [
        (r, leaves[i]) for r, i in enumerate(rows) if leaves[i] is not None and len(leaves[i])]
    leaf_rows = tuple(
        (lr, -neg[r, index[r, lr.rows]], (r * n_max + lr.rows).to(device)) for r, lr in read)
    return DecodeBucket(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        slots=slots,
        shift_index=index.to(device),
        pad_bias=bias[:, None, None, :].to(device),
        cos=cos.view(len(rows), s_max, half).to(device),
        sin=sin.view(len(rows), s_max, half).to(device),
        shifts=-neg,
        leaves=leaf_rows,
    )


def batched_shift_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BatchedDecodePlan,
    rope: ShiftRope | torch.Tensor,
    scale: float,
    output: torch.Tensor,
    layer: int = 0,
) -> None:
    """Decode attention of the plan's bucketed rows, written into ``output``.

    Args:
        query: [B, H, d] one query per row (RoPE at the row's position).
        k_cache, v_cache: [P, H_kv, d] the pool (keys at their owners' positions); H % H_kv == 0.
        output: [B, H, d]; the bucketed rows are written, ``plan.rest`` left as they are.
        layer: the layer whose factored-leaf deviations the rows read.
    """
    rope = as_shift_rope(rope)
    h, d, hkv = query.shape[1], query.shape[2], k_cache.shape[1]
    g = h // hkv
    for b in plan.buckets:
        r, n_kv, s = b.slots.shape[0], b.slots.shape[1], b.cos.shape[1]
        flat = b.slots.flatten()
        # One flat gather each (a 2-D index is slower); per KV head, the products read the
        # gathered [R, L, H_kv, d] through strided views, no transposed copy.
        k = k_cache.index_select(0, flat).view(r, n_kv, hkv, d).to(torch.float32)
        v = v_cache.index_select(0, flat).view(r, n_kv, hkv, d).to(torch.float32)
        flat_k, flat_v = k.view(r * n_kv, hkv, d), v.view(r * n_kv, hkv, d)
        for leaves, shift, index in b.leaves:  # deviations added to the gathered copies
            terms = leaves.in_owner_frame(layer, shift, rope, k.device)
            if terms is not None:
                flat_k.index_add_(0, index, terms[0])
                flat_v.index_add_(0, index, terms[1])
        q = query[b.rows].reshape(r, hkv, g, d).to(torch.float32)
        q_s = rotate(q[:, :, None], b.cos[:, None, :, None, :], b.sin[:, None, :, None, :],
                     rope) * scale  # [R, H_kv, S, g, d]: each row's query once per shift
        every = torch.stack([q_s[:, j].reshape(r, s * g, d) @ k[:, :, j].transpose(1, 2)
                             for j in range(hkv)], dim=1).view(r, hkv, s, g, n_kv)
        if s == 1:
            scores = every[:, :, 0]
        else:  # each key's score against its own shift's query
            pick = b.shift_index[:, None, None, None, :].expand(r, hkv, 1, g, n_kv)
            scores = every.gather(2, pick).squeeze(2)  # [R, H_kv, g, L]
        probs = torch.softmax(scores + b.pad_bias, dim=-1)
        out = torch.stack([probs[:, j] @ v[:, :, j] for j in range(hkv)], dim=1)
        output[b.rows] = out.reshape(r, h, d).to(output.dtype)
