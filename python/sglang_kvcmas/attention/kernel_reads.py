"""Attention over re-positioned borrowed keys with the delta kernels (the GPU path).

A batch's rows are planned once per forward (:func:`plan_shifted`: each row's pool slots, how
many of its last tokens are queries, and its runs of one shift, tiled so that no tile crosses a
run), and every layer is one launch of
:func:`~sglang_kvcmas.attention.triton_delta.delta_decode_triton` (one query per row) or
:func:`~sglang_kvcmas.attention.triton_delta.delta_extend_triton` (a row's last queries,
row-causal), which rotate each KV tile by its run's shift in registers (``R(δ)·k``, no rotated
copy of any key) and attend all of a KV head's query heads at once. The factors are zero
(re-positioning only): rows with a low-rank correction keep the torch path, as do the recomputed
tokens of a reader's extend, which precede some of its borrowed keys in position but follow them
in row order (the backend reads them with the position mask; every later query of the row
follows them all, so the kernel's row-causal mask is their position mask).

References: :func:`~sglang_kvcmas.attention.span_reads.rotate_keys` then SDPA (the tests),
:func:`~sglang_kvcmas.attention.shifted_query.grouped_shift_decode` and
:func:`~sglang_kvcmas.attention.span_reads.tail_attention` (the CPU paths). Shapes: ``q``
[queries, H, d]; pool buffers [slots, H_kv, d]; output [queries, H, d].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest
from sglang_kvcmas.attention.delta_plan import (
    DeltaPlan,
    PackedFactors,
    pack_delta_factors,
    plan_delta_batch,
)
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
class ShiftedPlan:
    """One batch's kernel inputs, shared by every layer.

    Attributes:
        plan: tiles of every row (runs of one shift kept apart).
        packed: zero factors (rank padded to the kernels' minimum).
        inv_freq: [d / 2] float32 rotary frequencies on the batch's device.
        decode: one query per row (the decode kernel), else the extend kernel.
    """

    plan: DeltaPlan
    packed: PackedFactors
    inv_freq: torch.Tensor
    decode: bool


def row_runs(shifts: KeyShifts | None, prefix_len: int) -> tuple[SharedSpan, ...]:
    """A row's runs of one non-zero shift inside its first ``prefix_len`` keys."""
    if shifts is None:
        return ()
    runs = []
    for span in shifts.spans():
        end = min(span.end, prefix_len)
        if end > span.start:
            runs.append(SharedSpan(span.start, end - span.start, span.shift))
    return tuple(runs)


def plan_shifted(
    kv_indices: Sequence[torch.Tensor], shifts: Sequence[KeyShifts | None], num_kv_heads: int,
    rope: ShiftRope, device: torch.device | str, num_queries: Sequence[int] | None = None,
) -> ShiftedPlan:
    """Plan a batch: row ``i`` reads pool slots ``kv_indices[i]`` ([n_i] int) with its keys at
    ``shifts[i]`` (None: plain); its last ``num_queries[i]`` tokens (default 1: decode) are the
    queries."""
    counts = [1] * len(kv_indices) if num_queries is None else list(num_queries)
    reqs = [DeltaRequest(kv, n, row_runs(s, int(kv.numel()) - n))
            for kv, s, n in zip(kv_indices, shifts, counts)]
    plan = plan_delta_batch(reqs, BLOCK_N, device)
    packed = pack_delta_factors(plan, None, num_kv_heads, rope.head_dim, torch.float32, device)
    return ShiftedPlan(plan, packed, rope.inv_freq.to(device), num_queries is None)


def shifted_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                      planned: ShiftedPlan, sm_scale: float) -> torch.Tensor:
    """[queries, H, d] attention of ``q`` (the planned rows' queries, in row order) over their
    rows, keys re-positioned."""
    from sglang_kvcmas.attention.triton_delta import (  # imports triton
        delta_decode_triton,
        delta_extend_triton,
    )

    args = (q, k_buffer, v_buffer, planned.plan, planned.packed, planned.inv_freq, sm_scale)
    if planned.decode:
        return delta_decode_triton(*args)
    group = q.shape[1] // k_buffer.shape[1]
    return delta_extend_triton(*args, block_m=max(32, 1 << (group - 1).bit_length()))
