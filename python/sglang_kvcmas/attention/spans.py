"""The span type of the read path and the per-row metadata the tree cache hands the backend.

A reader's KV row (``req_to_token[req_pool_idx]``) mixes its own KV with KV borrowed from another
agent's context. The tree cache decides, when the row is allocated, which ranges are borrowed and
by how much each must be re-positioned (:class:`RowSpans`), which borrowed tokens the reader
recomputes (:class:`RecomputedTokens`), and whether the row's new shared tokens record their
attention mass on the agent head (:class:`HeadMassProbe`). It keeps them on the request; every
forward carries them with its batch (:class:`BatchRow`, one per row, in batch order), so a later
or overlapped batch never reads another batch's rows.

Pure values and one small accumulator; no SGLang import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from sglang_kvcmas.attention.deviation_factors import RowLeaves


@dataclass(frozen=True)
class SharedSpan:
    """A range of a request's KV tokens owned by another agent.

    Attributes:
        start: request-local index of the span's first token (= its reader position).
        length: number of tokens.
        shift: δ = reader position − owner position, the same for every token of the span.
    """

    start: int
    length: int
    shift: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"bad span start={self.start} length={self.length}")

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class RecomputedTokens:
    """Borrowed shared tokens the reader recomputes, moved to the front of its extend.

    SGLang extends a row from ``prefix_len`` on, in token order. A reader that recomputes some
    shared tokens exactly (``policy/recompute.py``) leaves them out of its prefix; the tree cache
    shortens the prefix by as many tokens, and the backend puts these tokens, at their true
    positions, into the first extend slots (whose ids SGLang filled from the prompt's tail)::

        row index   0 ....... prefix_len ........ prefix_len + n ........... seq_len
                    | own + borrowed | recomputed | suffix (row index = position) |

    Attributes:
        row_start: row index of the first recomputed token (the row's prefix length).
        token_ids: the recomputed tokens' ids, in position order.
        positions: their true positions in the reader's sequence.
    """

    row_start: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.positions) or not self.token_ids:
            raise ValueError("recomputed tokens need one position each, and at least one token")


@dataclass(frozen=True)
class KeyShifts:
    """Per-key shift of one row's keys, as a gather map (any number of runs, no Python loop).

    Attributes:
        shifts: [S] int64 distinct shifts, ``shifts[0] == 0``.
        index: [m] int64 index into ``shifts`` of row indices ``0 .. m-1``; row indices ``>= m``
            are read at shift 0 (the row's own tokens after its borrowed part).
    """

    shifts: torch.Tensor
    index: torch.Tensor

    @classmethod
    def none(cls) -> KeyShifts:
        return cls(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))

    @classmethod
    def of_row(cls, start: int, shift: torch.Tensor) -> KeyShifts:
        """Row indices ``start .. start + len(shift) - 1`` read at ``shift`` ([B] int64),
        every row index before them at 0."""
        shifts, inverse = torch.unique(torch.cat([torch.zeros(1, dtype=torch.int64),
                                                  shift.to(torch.int64)]), return_inverse=True)
        zero = int(inverse[0])
        if zero:  # put 0 first: swap it with whatever sorted before it
            order = torch.arange(shifts.numel())
            order[0], order[zero] = zero, 0
            shifts, inverse = shifts[order], torch.argsort(order)[inverse]
        index = torch.cat([torch.zeros(start, dtype=torch.int64), inverse[1:]])
        return cls(shifts, index)

    @classmethod
    def of_spans(cls, reads: Sequence[SharedSpan]) -> KeyShifts:
        """The map of sorted, disjoint spans (the reference construction)."""
        end = max((r.end for r in reads), default=0)
        shift = torch.zeros(end, dtype=torch.int64)
        for r in reads:
            shift[r.start : r.end] = r.shift
        return cls.of_row(0, shift)

    @property
    def any(self) -> bool:
        """Whether some key is read at a non-zero shift (every shift listed is some key's)."""
        return self.shifts.numel() > 1

    def index_upto(self, n: int) -> torch.Tensor:
        """[n] int64 index into ``shifts`` of row indices ``0 .. n-1``."""
        m = self.index.numel()
        if n <= m:
            return self.index[:n]
        return torch.cat([self.index, torch.zeros(n - m, dtype=torch.int64)])

    @cached_property
    def _group_order(self) -> tuple[torch.Tensor, list[int]]:
        """(order of row indices ``0 .. m-1`` with shift 0 last, keys per shift index)."""
        idx, s = self.index, self.shifts.numel()
        order = torch.sort(torch.where(idx == 0, s, idx), stable=True).indices
        return order, torch.bincount(idx, minlength=s).tolist()

    def grouped(self, n: int) -> tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]:
        """Row indices ``0 .. n-1`` ordered by shift: the order and its groups.

        Args:
            n: row length, at least ``len(index)`` (a decode row only grows).
        Returns:
            (order, groups): order [n] int64, a permutation of the row indices with each
            non-zero shift's keys together (in ``shifts`` order), then the shift-0 keys, the
            row's own tokens after its borrowed part last; groups ``(lo, hi, i)``:
            ``order[lo:hi]`` are the keys read at ``shifts[i]``.
        """
        m = self.index.numel()
        if n < m:
            raise ValueError(f"row of {n} keys is shorter than its shift map ({m})")
        order, counts = self._group_order
        counts = [counts[0] + n - m, *counts[1:]]
        groups, at = [], 0
        for i in [*range(1, len(counts)), 0]:
            if counts[i]:
                groups.append((at, at + counts[i], i))
                at += counts[i]
        return torch.cat([order, torch.arange(m, n)]), tuple(groups)

    def spans(self) -> tuple[SharedSpan, ...]:
        """The runs of one non-zero shift, in row order."""
        idx = self.index
        if not idx.numel():
            return ()
        cut = (torch.nonzero(idx[1:] != idx[:-1]).flatten() + 1).tolist()
        starts, ends = [0, *cut], [*cut, idx.numel()]
        values = idx[torch.tensor(starts)].tolist()
        shifts = self.shifts.tolist()
        return tuple(SharedSpan(a, b - a, shifts[i]) for a, b, i in zip(starts, ends, values)
                     if i)


@dataclass(frozen=True)
class RowSpans:
    """How one request row is read: per-key shifts of its borrowed keys, and recomputed tokens.

    Attributes:
        rid: request id.
        key_shifts: the shift each row index is read at (0 for the row's own tokens and the
            reader's exact leaves; reader position − owner position for borrowed ones).
        recomputed: borrowed tokens recomputed in this request's extend, or None.
        positions: [row_start + len(recomputed)] int64 true position of each row index up to the
            end of the recomputed tokens (rows after them sit at their own index); None when
            every row index is its position.
        leaves: the tokens the row reads through its agent's factored leaves and those its
            extend factors into new ones (``attention/deviation_factors.py``), or None (read
            re-positioned only).
    """

    rid: str
    key_shifts: KeyShifts
    recomputed: RecomputedTokens | None = None
    positions: torch.Tensor | None = None
    leaves: RowLeaves | None = None

    @classmethod
    def of_reads(cls, rid: str, reads: Sequence[SharedSpan],
                 recomputed: RecomputedTokens | None = None,
                 positions: torch.Tensor | None = None) -> RowSpans:
        """A row from its re-positioned spans (sorted, disjoint, row coordinates)."""
        return cls(rid, KeyShifts.of_spans(reads), recomputed, positions)

    @property
    def reads(self) -> tuple[SharedSpan, ...]:
        """The borrowed spans read re-positioned (shift != 0), in row coordinates (derived from
        ``key_shifts``; for the reference path and tests)."""
        return self.key_shifts.spans()

    @property
    def reads_transformed(self) -> bool:
        """Whether any borrowed span is read re-positioned (what decode must do)."""
        return self.key_shifts.any

    @property
    def needs_transform(self) -> bool:
        """Whether extend must differ from plain attention (spans, or a position mask)."""
        return self.positions is not None or self.reads_transformed

    def positions_upto(self, n: int) -> torch.Tensor:
        """[n] int64 true positions of row indices ``0 .. n-1``."""
        if self.positions is None:
            return torch.arange(n)
        have = self.positions.shape[0]
        if n <= have:
            return self.positions[:n]
        return torch.cat([self.positions, torch.arange(have, n)])


PROBE_EVERY, PROBE_PHASE = 4, 2
"""Probe layers: ``layer_id % PROBE_EVERY == PROBE_PHASE`` (2, 6, 10, ...;
benchmark/lab/owner_mass_study.py compares them with all layers)."""


def is_probe_layer(layer_id: int) -> bool:
    """Whether extend records head mass at this layer."""
    return layer_id % PROBE_EVERY == PROBE_PHASE


@dataclass
class HeadMassProbe:
    """Records, for a row's extended tokens, their attention mass on the row's agent head.

    The attention backend adds, at each probe layer (:func:`is_probe_layer`), the mass every
    extended token puts on key rows ``[head_from, head_to)`` (``probe_reads.py``); the tree cache
    reads the mean when it registers the tokens as shared, for ``policy/recompute.py``.

    Attributes:
        head_from: first head row that can differ across agents (the shared chat preamble and
            the attention sink before it do not).
        head_to: one past the last head row.
        sums: [row_len] float32 summed mass per row index (rows never extended stay 0).
        counts: [row_len] float32 probe layers summed per row index.
    """

    head_from: int
    head_to: int
    sums: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def for_row(cls, head_from: int, head_to: int, row_len: int) -> HeadMassProbe:
        return cls(head_from, head_to, torch.zeros(row_len), torch.zeros(row_len))

    def add(self, start: int, mass: torch.Tensor) -> None:
        """mass: [n] float for row indices ``start .. start + n - 1``."""
        end = min(start + mass.shape[0], self.sums.shape[0])
        if end <= start:
            return  # rows past the shared context (suffix, a resumed request): nothing to keep
        self.sums[start:end] += mass[: end - start].float().cpu()
        self.counts[start:end] += 1

    def mean(self, start: int, end: int) -> torch.Tensor:
        """[end - start] mean mass of row indices ``start .. end - 1`` (0 where unprobed)."""
        out = torch.zeros(max(0, end - start))
        lo, hi = max(start, 0), min(end, self.sums.shape[0])
        if hi > lo:
            out[lo - start : hi - start] = self.sums[lo:hi] / self.counts[lo:hi].clamp(min=1)
        return out


@dataclass(frozen=True)
class BatchRow:
    """What the attention backend does differently for one row of one forward batch.

    Attributes:
        spans: the row's borrowed spans and recomputed tokens, or None (plain attention).
        probe: where the row's extend records head mass, or None.
    """

    spans: RowSpans | None = None
    probe: HeadMassProbe | None = None

