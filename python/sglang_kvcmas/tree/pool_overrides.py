"""Exact token overrides held in the serving KV pool: the exact leaf of the serving path.

When a reader agent recomputes some borrowed shared tokens in its own context
(``policy/recompute.py``), their KV is exact for that agent. Kept as the agent's exact leaf on the
shared-tree node, the agent's later turns read those tokens exactly without recomputing them;
every other token of the node is still the owner's KV, re-positioned::

    node tokens       0 1 2 3 4 5 6 7 8 ...        (owner's slots, owner positions)
    agent b's leaf    0 1 2 3                       (b's slots, b's positions: shift 0)
    b reads           b b b b o o o o o ...

Bookkeeping only: slots are opaque int64 pool indices; the shared tree frees them when the leaf
or its node is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class PoolOverrides:
    """One agent's exact KV for some tokens of one shared node.

    Attributes:
        offsets: [m] int64 node-local token offsets, sorted and distinct.
        slots: [m] int64 pool slots holding the agent's exact KV of those tokens (keys rotated at
            the agent's own positions).
        reader_start: the agent's position of the node's first token; a read at another
            position cannot use the leaf.
        bytes_per_token: KV bytes one pool slot holds (all layers, K and V).
    """

    offsets: torch.Tensor
    slots: torch.Tensor
    reader_start: int
    bytes_per_token: int = 0
    last_access: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.offsets.shape != self.slots.shape or self.offsets.ndim != 1:
            raise ValueError(f"offsets {tuple(self.offsets.shape)} and slots "
                             f"{tuple(self.slots.shape)} must be matching vectors")
        if self.offsets.numel() > 1 and not bool((self.offsets[1:] > self.offsets[:-1]).all()):
            raise ValueError("override offsets must be sorted and distinct")

    def __len__(self) -> int:
        return int(self.offsets.numel())

    def nbytes(self) -> int:
        return len(self) * self.bytes_per_token

    def lookup(self) -> dict[int, int]:
        """``node offset -> slot``."""
        return dict(zip(self.offsets.tolist(), self.slots.tolist()))

    def split(self, n: int) -> tuple[PoolOverrides, PoolOverrides]:
        """The leaves of the node's first ``n`` tokens and of the rest (offsets re-based)."""
        lo = self.offsets < n
        hi = ~lo
        return (
            PoolOverrides(self.offsets[lo], self.slots[lo], self.reader_start,
                          self.bytes_per_token, self.last_access),
            PoolOverrides(self.offsets[hi] - n, self.slots[hi], self.reader_start + n,
                          self.bytes_per_token, self.last_access),
        )

    def merged(self, offsets: torch.Tensor, slots: torch.Tensor) -> tuple[PoolOverrides,
                                                                          torch.Tensor]:
        """This leaf plus new overrides; offsets it already holds keep their slot.

        Args:
            offsets: [k] int64 node-local offsets.
            slots: [k] int64 their slots.
        Returns:
            (the merged leaf, [j] int64 slots not adopted: the caller still owns them).
        """
        have = set(self.offsets.tolist())
        new = torch.tensor([o not in have for o in offsets.tolist()], dtype=torch.bool)
        all_offsets = torch.cat([self.offsets, offsets[new]])
        order = torch.argsort(all_offsets)
        leaf = PoolOverrides(all_offsets[order], torch.cat([self.slots, slots[new]])[order],
                             self.reader_start, self.bytes_per_token, self.last_access)
        return leaf, slots[~new]
