"""Factored leaves on a shared node: a reader agent's recomputed tokens as low-rank factors.

The second leaf type (``policy/leaf_mode.py``: ``factored``). Where an exact leaf
(``tree/pool_overrides.py``) holds a token's full K/V in a pool slot, a factored leaf holds the
token's deviation from the owner's KV as coefficients under its fit's basis
(``attention.deviation_factors.TokenFactors``): host memory, not pool slots, so the tree counts its
bytes and the leaf budget (``shared_tree.trim_leaves``) bounds it with the other types::

    node tokens        0 1 2 3 4 5 6 7 8 ...      (owner's slots, owner positions)
    agent b's leaf     0 1     4                  (coefficients; b's positions)
    b reads            o+Δ o+Δ o o o+Δ o o o ...  (owner's slot re-positioned, + its deviation)

A leaf is a list of parts, one per fit that added tokens to the node (one basis each); a node's
split splits every part by offset, the basis shared by both halves.

Bookkeeping only: factors are opaque values with ``__len__``, ``select`` and ``nbytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class FactorPart:
    """Some of a node's tokens under one fit.

    Attributes:
        offsets: [m] int64 node-local offsets, sorted and distinct.
        factors: an ``attention.deviation_factors.TokenFactors`` of those ``m`` tokens, in order.
    """

    offsets: torch.Tensor
    factors: Any

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or self.offsets.numel() != len(self.factors):
            raise ValueError(f"{self.offsets.numel()} offsets for {len(self.factors)} tokens")
        if self.offsets.numel() > 1 and not bool((self.offsets[1:] > self.offsets[:-1]).all()):
            raise ValueError("factored leaf offsets must be sorted and distinct")

    def __len__(self) -> int:
        return int(self.offsets.numel())

    def select(self, mask: torch.Tensor, shift: int = 0) -> FactorPart:
        """The tokens ``mask`` ([m] bool), offsets moved by ``-shift``."""
        return FactorPart(self.offsets[mask] - shift, self.factors.select(mask))


@dataclass(eq=False)
class FactorLeaf:
    """One agent's factored leaf on one shared node.

    Attributes:
        reader_start: the agent's position of the node's first token (a read at another
            position cannot use the leaf: the deviations were taken there).
        parts: one per fit, offsets disjoint across parts.
    """

    reader_start: int
    parts: list[FactorPart] = field(default_factory=list)
    last_access: float = 0.0

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def nbytes(self) -> int:
        return sum(int(p.factors.nbytes()) for p in self.parts)

    def offsets(self) -> torch.Tensor:
        """[len] int64 every offset held (parts in order, not sorted across them)."""
        if not self.parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([p.offsets for p in self.parts])

    def split(self, n: int) -> tuple[FactorLeaf, FactorLeaf]:
        """The leaves of the node's first ``n`` tokens and of the rest (offsets re-based)."""
        head, tail = [], []
        for p in self.parts:
            lo = p.offsets < n
            if bool(lo.any()):
                head.append(p.select(lo))
            if bool((~lo).any()):
                tail.append(p.select(~lo, n))
        return (FactorLeaf(self.reader_start, head, self.last_access),
                FactorLeaf(self.reader_start + n, tail, self.last_access))

    def with_part(self, offsets: torch.Tensor, factors: Any) -> tuple[FactorLeaf, int]:
        """This leaf plus the tokens of a new fit it does not hold yet.

        Args:
            offsets: [k] int64 node-local offsets, sorted and distinct.
            factors: their ``TokenFactors``.
        Returns:
            (the new leaf, tokens added).
        """
        new = ~torch.isin(offsets, self.offsets())
        if not bool(new.any()):
            return self, 0
        part = FactorPart(offsets[new], factors.select(new))
        return FactorLeaf(self.reader_start, [*self.parts, part], self.last_access), len(part)
