"""Attention over re-positioned borrowed keys with the delta kernels (the GPU path).

A batch's rows are planned once per forward (:func:`plan_shifted`: each row's pool slots, how
many of its last tokens are queries, and its runs of one shift, tiled so that no tile crosses a
run), and every layer is one launch of
:func:`~sglang_kvcmas.attention.triton_delta.delta_decode_triton` (one query per row) or
:func:`~sglang_kvcmas.attention.triton_delta.delta_extend_triton` (a row's last queries,
row-causal), which rotate each KV tile by its run's shift in registers (``R(δ)·k``, no rotated
copy of any key) and attend all of a KV head's query heads at once.

Factored leaves (``attention/deviation_factors.py``) are the kernels' own delta form: a token's
pre-RoPE key deviation ``u·Bᵀ`` rotated at its reader position, its value deviation added as
is. :func:`place_leaves` puts a batch's factored tokens into the kernels' packed factors once
per forward (a shift-0 run becomes a span where it holds one: deviations are added inside spans
only). A span carries one basis: a row's parts (one fit each) take their own columns of it side
by side, so a row with ``P`` parts of rank ``r`` reads at rank ``P·r``. Everything else reads
zero factors (re-positioning only).

# NOTE: the recomputed tokens of a reader's extend keep the torch path: they precede some of its
# borrowed keys in position but follow them in row order (every later query of the row follows
# them all, so for those the kernel's row-causal mask is their position mask). So do factored
# tokens whose row index is not their position (the kernels rotate a deviation at its row index).

References: :func:`~sglang_kvcmas.attention.span_reads.rotate_keys` then SDPA (the tests),
:func:`~sglang_kvcmas.attention.shifted_query.grouped_shift_decode` and
:func:`~sglang_kvcmas.attention.span_reads.tail_attention` (the CPU paths). Shapes: ``q``
[queries, H, d]; pool buffers [slots, H_kv, d]; output [queries, H, d].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest
from sglang_kvcmas.attention.delta_plan import (
    DeltaPlan,
    PackedFactors,
    pack_delta_factors,
    plan_delta_batch,
    rank_block,
)
from sglang_kvcmas.attention.deviation_factors import LeafReads, TokenFactors
from sglang_kvcmas.attention.rope import ShiftRope
from sglang_kvcmas.attention.spans import KeyShifts, SharedSpan

BLOCK_N = 64
"""KV tile of the kernels (a run shorter than this leaves a partly filled tile)."""


def kernel_serves(rope: ShiftRope) -> bool:
    """Whether the kernels re-position this model's keys exactly: neox layout over the whole
    head, and a head size they tile (a power of two, at least 32)."""
    d = rope.head_dim
    return rope.neox and rope.rotary_dim == d and d >= 32 and d & (d - 1) == 0


@dataclass(frozen=True)
class LeafPlacement:
    """Where a planned batch's factored-leaf tokens sit in the kernels' packed factors.

    Placed once per forward (:func:`place_leaves`); :meth:`pack` fills one layer's factors
    (:meth:`pack_reference`: the same, one part at a time).

    Attributes:
        parts: per stored part of every row: its factors (all layers), the packed ``U`` rows
            of its tokens ([j] int64, in the part's token order), the first column of its rank
            block, and the global ids of the spans that hold its tokens ([s] int64: each
            carries the part's basis in those columns).
        num_rows: packed ``U`` rows (every span's tokens).
        num_spans: spans planned.
        block_r: padded rank (``delta_plan.rank_block`` of the widest row's blocks together).
    """

    parts: tuple[tuple[TokenFactors, torch.Tensor, int, torch.Tensor], ...]
    num_rows: int
    num_spans: int
    block_r: int
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def _shapes(self, num_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
        return ((max(self.num_rows, 1), num_kv_heads, self.block_r),
                (max(self.num_spans, 1), num_kv_heads, head_dim, self.block_r))

    def pack_reference(self, layer: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> PackedFactors:
        """:meth:`pack`, one part at a time on the host (the reference)."""
        shape_u, shape_c = self._shapes(num_kv_heads, head_dim)
        k_u, v_u = torch.zeros(shape_u), torch.zeros(shape_u)
        k_c, v_c = torch.zeros(shape_c), torch.zeros(shape_c)
        for f, urows, col, sids in self.parts:
            end = col + f.rank
            k_u[urows, :, col:end] = f.k[layer].float()
            v_u[urows, :, col:end] = f.v[layer].float()
            k_c[sids, :, :, col:end] = f.basis.k[layer].float()
            v_c[sids, :, :, col:end] = f.basis.v[layer].float()
        return PackedFactors(*(t.to(device=device, dtype=dtype) for t in (k_u, k_c, v_u, v_c)))

    def pack(self, layer: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device | str) -> PackedFactors:
        """One layer's factors: ``k_u``/``v_u`` [num_rows, H_kv, block_r] (zero but on factored
        tokens), ``k_c``/``v_c`` [num_spans, H_kv, d, block_r] (zero but in a part's columns of
        the spans that hold its tokens), copied to the device once and scattered there; parts of
        different ranks take :meth:`pack_reference`."""
        ranks = {f.rank for f, *_ in self.parts}
        if len(ranks) != 1:
            return self.pack_reference(layer, num_kv_heads, head_dim, dtype, device)
        (r,) = ranks
        key = str(device)
        if key not in self._index:
            cols = [torch.arange(col, col + r) for _, _, col, _ in self.parts]
            self._index[key] = tuple(t.to(device) for t in (
                torch.cat([u for _, u, _, _ in self.parts]),  # [T] packed rows
                torch.cat([c.expand(len(u), r) for c, (_, u, _, _) in zip(cols, self.parts)]),
                torch.cat([s for *_, s in self.parts]),  # [P'] spans carrying a basis
                torch.cat([c.expand(len(s), r) for c, (*_, s) in zip(cols, self.parts)]),
                torch.cat([torch.full((len(s),), i) for i, (*_, s) in enumerate(self.parts)])))
        urows, ucols, sids, scols, owner = self._index[key]
        shape_u, shape_c = self._shapes(num_kv_heads, head_dim)
        out = []
        for name in ("k", "v"):
            coef = torch.cat([getattr(f, name)[layer] for f, *_ in self.parts])  # [T, H, r]
            basis = torch.stack([getattr(f.basis, name)[layer] for f, *_ in self.parts])
            u = torch.zeros(shape_u[0], self.block_r, num_kv_heads, dtype=dtype, device=device)
            u[urows[:, None], ucols] = coef.to(device=device, dtype=dtype).transpose(1, 2)
            c = torch.zeros(shape_c[0], self.block_r, num_kv_heads, head_dim, dtype=dtype,
                            device=device)
            c[sids[:, None], scols] = basis.to(device=device, dtype=dtype)[owner].permute(
                0, 3, 1, 2)
            out += [u.transpose(1, 2).contiguous(), c.permute(0, 2, 3, 1).contiguous()]
        return PackedFactors(*out)


@dataclass(frozen=True)
class ShiftedPlan:
    """One batch's kernel inputs, shared by every layer.

    Attributes:
        plan: tiles of every row (runs of one shift kept apart).
        packed: zero factors (rank padded to the kernels' minimum).
        inv_freq: [d / 2] float32 rotary frequencies on the batch's device.
        decode: one query per row (the decode kernel), else the extend kernel.
        leaves: where the batch's factored-leaf tokens sit, or None (none).
    """

    plan: DeltaPlan
    packed: PackedFactors
    inv_freq: torch.Tensor
    decode: bool
    leaves: LeafPlacement | None = None

    def factors(self, layer: int) -> PackedFactors:
        """The factors the kernels read at ``layer``: the leaves' there, else zero."""
        if self.leaves is None:
            return self.packed
        k = self.packed.k_c
        return self.leaves.pack(layer, k.shape[1], k.shape[2], k.dtype, k.device)


def row_runs(shifts: KeyShifts | None, prefix_len: int,
             leaf_rows: torch.Tensor | None = None) -> tuple[SharedSpan, ...]:
    """A row's runs of one non-zero shift inside its first ``prefix_len`` keys, and the runs of
    shift 0 there that hold one of ``leaf_rows`` ([j] int64 row indices of factored tokens)."""
    no_leaves = leaf_rows is None or not leaf_rows.numel()
    if prefix_len <= 0 or (shifts is None and no_leaves):
        return ()
    idx = (shifts.index_upto(prefix_len) if shifts is not None
           else torch.zeros(prefix_len, dtype=torch.int64))
    values = shifts.shifts.tolist() if shifts is not None else [0]
    held = torch.zeros(prefix_len + 1, dtype=torch.int64)
    if not no_leaves:
        held[1:][leaf_rows[leaf_rows < prefix_len]] = 1
    held = held.cumsum(0).tolist()  # held[b] - held[a]: leaf rows in [a, b)
    cut = (torch.nonzero(idx[1:] != idx[:-1]).flatten() + 1).tolist()
    starts, ends = [0, *cut], [*cut, prefix_len]
    return tuple(SharedSpan(a, b - a, values[i])
                 for a, b, i in zip(starts, ends, idx[torch.tensor(starts)].tolist())
                 if i or held[b] > held[a])


def place_leaves(runs: Sequence[tuple[SharedSpan, ...]],
                 leaves: Sequence[LeafReads | None]) -> LeafPlacement | None:
    """Place every row's factored tokens in the packed rows of the spans ``runs[i]`` that hold
    them (``plan_delta_batch``'s order: rows in batch order, a row's spans in order); None
    where no row reads a factored leaf.

    Raises:
        ValueError: a factored token outside its row's spans (``row_runs`` given the row's
            factored tokens makes spans that hold them all).
    """
    if not any(lr is not None and len(lr) for lr in leaves):
        return None
    parts, row0, sid0, widest = [], 0, 0, 1
    for spans, lr in zip(runs, leaves):
        starts = torch.tensor([s.start for s in spans], dtype=torch.int64)
        ends = torch.tensor([s.end for s in spans], dtype=torch.int64)
        first = torch.tensor([0, *(s.length for s in spans)]).cumsum(0)[:-1] + row0
        sids = torch.arange(sid0, sid0 + len(spans), dtype=torch.int64)
        col = 0
        for rows, _, f in (lr.parts if lr is not None else ()):
            k = torch.searchsorted(starts, rows, right=True) - 1
            if not len(spans) or (k < 0).any() or (rows >= ends[k.clamp(min=0)]).any():
                raise ValueError("a factored token lies outside its row's spans")
            parts.append((f, first[k] + rows - starts[k], col, sids[torch.unique(k)]))
            col += f.rank
        widest = max(widest, col)
        row0 += sum(s.length for s in spans)
        sid0 += len(spans)
    return LeafPlacement(tuple(parts), row0, sid0, rank_block(widest))


def plan_shifted(
    kv_indices: Sequence[torch.Tensor], shifts: Sequence[KeyShifts | None], num_kv_heads: int,
    rope: ShiftRope, device: torch.device | str, num_queries: Sequence[int] | None = None,
    leaves: Sequence[LeafReads | None] | None = None,
) -> ShiftedPlan:
    """Plan a batch: row ``i`` reads pool slots ``kv_indices[i]`` ([n_i] int) with its keys at
    ``shifts[i]`` (None: plain) and, where ``leaves[i]`` is given, its factored tokens through
    their deviations (each at its row index: the caller checks that it is its position); its
    last ``num_queries[i]`` tokens (default 1: decode) are the queries."""
    counts = [1] * len(kv_indices) if num_queries is None else list(num_queries)
    leaves = list(leaves) if leaves is not None else [None] * len(kv_indices)
    runs = [row_runs(s, int(kv.numel()) - n, lr.rows if lr is not None else None)
            for kv, s, n, lr in zip(kv_indices, shifts, counts, leaves)]
    reqs = [DeltaRequest(kv, n, r) for kv, n, r in zip(kv_indices, counts, runs)]
    plan = plan_delta_batch(reqs, BLOCK_N, device)
    packed = pack_delta_factors(plan, None, num_kv_heads, rope.head_dim, torch.float32, device)
    return ShiftedPlan(plan, packed, rope.inv_freq.to(device), num_queries is None,
                       place_leaves(runs, leaves))


def shifted_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                      planned: ShiftedPlan, sm_scale: float, layer: int = 0) -> torch.Tensor:
    """[queries, H, d] attention of ``q`` (the planned rows' queries, in row order) over their
    rows, keys re-positioned, factored tokens read through their deviations at ``layer``."""
    from sglang_kvcmas.attention.triton_delta import (  # imports triton
        delta_decode_triton,
        delta_extend_triton,
    )

    args = (q, k_buffer, v_buffer, planned.plan, planned.factors(layer), planned.inv_freq,
            sm_scale)
    if planned.decode:
        return delta_decode_triton(*args)
    group = q.shape[1] // k_buffer.shape[1]
    return delta_extend_triton(*args, block_m=max(32, 1 << (group - 1).bit_length()))
