"""Decode over re-positioned borrowed keys with the delta kernel (the GPU path).

A decode batch's rows are planned once per forward (:func:`plan_shifted_decode`: each row's pool
slots and its runs of one shift, tiled so that no tile crosses a run), and every layer is one
launch of :func:`~sglang_kvcmas.attention.triton_delta.delta_decode_triton`, which rotates each
KV tile by its run's shift in registers (``R(δ)·k``, no rotated copy of any key) and attends all
of a KV head's query heads at once. The factors are zero (re-positioning only): rows with a
low-rank correction keep the torch path.

Reference: :func:`~sglang_kvcmas.attention.shifted_query.grouped_shift_decode` (keys grouped by
shift, the query rotated once per shift), the path on CPU and the oracle in tests. Shapes:
``q`` [B, H, d]; pool buffers [slots, H_kv, d]; output [B, H, d].
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
"""KV tile of the decode kernel (a run shorter than this leaves a partly filled tile)."""


def kernel_serves(rope: ShiftRope) -> bool:
    """Whether the kernel re-positions this model's keys exactly: neox layout over the whole
    head, and a head size the kernel tiles (a power of two, at least 32)."""
    d = rope.head_dim
    return rope.neox and rope.rotary_dim == d and d >= 32 and d & (d - 1) == 0


@dataclass(frozen=True)
class ShiftedDecodePlan:
    """One decode batch's kernel inputs, shared by every layer.

    Attributes:
        plan: tiles of every row (runs of one shift kept apart).
        packed: zero factors (rank padded to the kernel's minimum).
        inv_freq: [d / 2] float32 rotary frequencies on the batch's device.
    """

    plan: DeltaPlan
    packed: PackedFactors
    inv_freq: torch.Tensor


def row_runs(shifts: KeyShifts | None, prefix_len: int) -> tuple[SharedSpan, ...]:
    """A row's runs of one non-zero shift inside its cached prefix (row coordinates)."""
    if shifts is None:
        return ()
    runs = []
    for span in shifts.spans():
        end = min(span.end, prefix_len)
        if end > span.start:
            runs.append(SharedSpan(span.start, end - span.start, span.shift))
    return tuple(runs)


def plan_shifted_decode(
    kv_indices: Sequence[torch.Tensor], shifts: Sequence[KeyShifts | None], num_kv_heads: int,
    rope: ShiftRope, device: torch.device | str,
) -> ShiftedDecodePlan:
    """Plan a decode batch: row ``i`` reads pool slots ``kv_indices[i]`` ([n_i] int, its new
    token last) with its keys at ``shifts[i]`` (None: plain)."""
    reqs = [DeltaRequest(kv, 1, row_runs(s, int(kv.numel()) - 1))
            for kv, s in zip(kv_indices, shifts)]
    plan = plan_delta_batch(reqs, BLOCK_N, device)
    packed = pack_delta_factors(plan, None, num_kv_heads, rope.head_dim, torch.float32, device)
    return ShiftedDecodePlan(plan, packed, rope.inv_freq.to(device))


def shifted_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                   planned: ShiftedDecodePlan, sm_scale: float) -> torch.Tensor:
    """[B, H, d] decode attention of ``q`` over the planned rows, keys re-positioned."""
    from sglang_kvcmas.attention.triton_delta import delta_decode_triton  # imports triton

    return delta_decode_triton(q, k_buffer, v_buffer, planned.plan, planned.packed,
                               planned.inv_freq, sm_scale)
