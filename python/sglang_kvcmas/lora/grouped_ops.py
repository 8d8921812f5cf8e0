"""A batch's LoRA deltas grouped by adapter: one matmul per adapter present, not per request.

SGLang's ``torch_native`` LoRA ops (the LoRA backend that runs without an accelerator) walk a
batch segment by segment, a segment being consecutive tokens of one adapter, and read each
segment's rank and scaling out of tensors on the way. A decode batch whose requests alternate
adapters has one segment per request, so every projection of every layer pays a few dozen small
tensor operations per request, not per token: most of a CPU decode step at a handful of
requests.

Here the batch's tokens are grouped by adapter once per forward (:meth:`AdapterGroups.build`,
ranks and scalings as Python numbers), and each projection's delta is one matmul per adapter
present (at most ``max_loras_per_batch``): a group's short runs (decode) are gathered into one
matmul and scattered back, its long runs (prefill) multiplied in place run by run. The math is
SGLang's:

    a = scaling * x @ A[slot, :slices * rank].T                     (lora_a)
    out[:, off_i:off_{i+1}] += a[:, i * rank:(i + 1) * rank] @ B[slot, off_i:off_{i+1}, :rank].T

with ``i`` over the slices a projection stacks (q, k, v; gate, up). Tokens of rank-0 slots (the
base model) get no delta, so their rows are bit-identical to the base layer's output.
:func:`lora_a_reference` and :func:`lora_b_reference` compute the same token by token, the
reference the tests hold the grouped ops to.

Shapes: ``x`` [T, d_in]; ``A`` [num_slots, slices * max_rank, d_in]; ``B`` [num_slots, d_out,
max_rank]; lora_a's output [T, slices * max_rank]; ``offsets``: slices + 1 ints, d_out at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

__all__ = ["AdapterGroup", "AdapterGroups", "lora_a", "lora_a_reference", "lora_b",
           "lora_b_reference"]


GATHER_BELOW = 16
"""Mean run length (tokens) under which a group's rows are gathered into one matmul; longer runs
(prefill) are multiplied in place, run by run, which skips the gather and the scatter back."""


@dataclass(frozen=True)
class AdapterGroup:
    """The tokens of one adapter in a batch.

    Attributes:
        slot: the adapter's index in the LoRA weight buffers' first dimension.
        rank: its rank (> 0).
        scaling: its ``lora_alpha / r`` (PEFT's scaling).
        rows: its token rows: runs of consecutive tokens (slices), or, when its runs are short
            (decode: one token per request), one int64 index tensor [n] gathered once.
    """

    slot: int
    rank: int
    scaling: float
    rows: tuple[slice, ...] | torch.Tensor

    def row_list(self) -> list[int]:
        """The group's token rows as ints (for references and tests)."""
        if isinstance(self.rows, torch.Tensor):
            return self.rows.tolist()
        return [t for run in self.rows for t in range(run.start, run.stop)]


@dataclass(frozen=True)
class AdapterGroups:
    """A batch's tokens grouped by adapter (rank-0 slots, the base model, left out)."""

    num_tokens: int
    groups: tuple[AdapterGroup, ...]

    @classmethod
    def build(cls, seg_lens: Sequence[int], slots: Sequence[int], ranks: Sequence[int],
              scalings: Sequence[float], device: torch.device | str = "cpu",
              gather_below: int = GATHER_BELOW) -> AdapterGroups:
        """Group segments (``seg_lens[i]`` consecutive tokens of adapter slot ``slots[i]``) by
        slot; ``ranks`` and ``scalings`` are indexed by slot."""
        if len(seg_lens) != len(slots):
            raise ValueError(f"{len(seg_lens)} segment lengths for {len(slots)} slots")
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for n, slot in zip(seg_lens, slots):
            n, slot = int(n), int(slot)
            if n > 0 and int(ranks[slot]) > 0:
                runs.setdefault(slot, []).append((start, start + n))
            start += n
        groups = []
        for slot, parts in runs.items():
            tokens = sum(b - a for a, b in parts)
            if len(parts) > 1 and tokens < gather_below * len(parts):
                rows: tuple[slice, ...] | torch.Tensor = torch.cat(
                    [torch.arange(a, b, device=device) for a, b in parts])
            else:
                rows = tuple(slice(a, b) for a, b in parts)
            groups.append(AdapterGroup(slot, int(ranks[slot]), float(scalings[slot]), rows))
        return cls(start, tuple(groups))


def lora_a(x: torch.Tensor, weights: torch.Tensor, groups: AdapterGroups,
           num_slices: int = 1) -> torch.Tensor:
    """Each token's scaled down-projection ``scaling * x @ A.T`` under its adapter.

    x: [T, d_in]; weights: [num_slots, num_slices * max_rank, d_in] -> [T, num_slices * max_rank]
    (zeros past a token's ``num_slices * rank`` columns and for base-model tokens).
    """
    out = x.new_zeros(x.shape[0], weights.shape[1])
    for g in groups.groups:
        cols = num_slices * g.rank
        w = weights[g.slot, :cols].T
        if isinstance(g.rows, torch.Tensor):
            out[g.rows, :cols] = (x[g.rows] @ w).mul_(g.scaling)
        else:
            for run in g.rows:
                out[run, :cols].addmm_(x[run], w, beta=0, alpha=g.scaling)
    return out


def lora_b(a: torch.Tensor, weights: torch.Tensor, groups: AdapterGroups,
           offsets: Sequence[int], base_output: torch.Tensor | None = None) -> torch.Tensor:
    """``base_output`` (or zeros) plus each token's up-projection of its slices, in place.

    a: [T, num_slices * max_rank] (lora_a's output); weights: [num_slots, d_out, max_rank];
    offsets: num_slices + 1 output offsets -> [T, d_out].
    """
    bounds = [int(o) for o in offsets]
    slices = list(pairwise(bounds))
    out = base_output if base_output is not None else a.new_zeros(a.shape[0], bounds[-1])
    for g in groups.groups:
        r = g.rank
        if isinstance(g.rows, torch.Tensor):
            rows = a[g.rows]
            delta = torch.cat([rows[:, i * r:(i + 1) * r] @ weights[g.slot, lo:hi, :r].T
                               for i, (lo, hi) in enumerate(slices)], dim=1)
            out.index_add_(0, g.rows, delta)
            continue
        for run in g.rows:
            for i, (lo, hi) in enumerate(slices):
                out[run, lo:hi].addmm_(a[run, i * r:(i + 1) * r], weights[g.slot, lo:hi, :r].T)
    return out


def _token_slots(groups: AdapterGroups) -> list[AdapterGroup | None]:
    per_token: list[AdapterGroup | None] = [None] * groups.num_tokens
    for g in groups.groups:
        for t in g.row_list():
            per_token[t] = g
    return per_token


def lora_a_reference(x: torch.Tensor, weights: torch.Tensor, groups: AdapterGroups,
                     num_slices: int = 1) -> torch.Tensor:
    """:func:`lora_a` token by token (the tests' reference)."""
    out = x.new_zeros(x.shape[0], weights.shape[1])
    for t, g in enumerate(_token_slots(groups)):
        if g is not None:
            cols = num_slices * g.rank
            out[t, :cols] = g.scaling * (weights[g.slot, :cols] @ x[t])
    return out


def lora_b_reference(a: torch.Tensor, weights: torch.Tensor, groups: AdapterGroups,
                     offsets: Sequence[int], base_output: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """:func:`lora_b` token by token, into a copy of ``base_output`` (the tests' reference)."""
    bounds = [int(o) for o in offsets]
    out = base_output.clone() if base_output is not None else \
        a.new_zeros(a.shape[0], bounds[-1])
    for t, g in enumerate(_token_slots(groups)):
        if g is not None:
            r = g.rank
            for i, (lo, hi) in enumerate(pairwise(bounds)):
                out[t, lo:hi] += weights[g.slot, lo:hi, :r] @ a[t, i * r:(i + 1) * r]
    return out
