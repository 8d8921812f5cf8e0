"""Shared-context segments and the tree of them that every agent matches against.

A shared transcript is a path of segments (question, each agent's answer, ...). A node holds its
owner's exact cache of the segment (``base``: pre-RoPE K/V at the owner's positions), which is
never modified, and a map agent -> delta leaf (how that agent's view deviates from the base).
The tree is keyed by tokens only, never by agent: the same transcript matches for every agent.

Engine-agnostic bookkeeping: no sglang imports; tensors only as opaque payloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_kvcmas.models.reference_llama import KVCache

__all__ = ["Segment", "SegmentNode", "SegmentTree"]


@dataclass(frozen=True)
class Segment:
    """A run of shared tokens. ids: [num_tokens] int64; owner: the agent that computed its base."""

    segment_id: int
    ids: torch.Tensor
    owner: str

    def __post_init__(self):
        if self.ids.ndim != 1 or self.ids.numel() == 0:
            raise ValueError("a segment is a non-empty 1-D token sequence")

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.ids)

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass(eq=False)
class SegmentNode:
    """One segment on a transcript path.

    base: the owner's exact cache of the segment (positions = where the owner read it).
    deltas: agent -> delta leaf (any object with ``nbytes()``); the owner has none.
    depth: number of segments on the path up to and including this one.
    """

    segment: Segment | None
    parent: SegmentNode | None
    base: KVCache | None
    depth: int = 0
    children: dict[tuple[int, ...], SegmentNode] = field(default_factory=dict)
    deltas: dict[str, object] = field(default_factory=dict)

    @property
    def owner(self) -> str | None:
        return self.segment.owner if self.segment is not None else None


class SegmentTree:
    """A radix-like tree over whole segments (a growing transcript is a growing path)."""

    def __init__(self):
        self.root = SegmentNode(segment=None, parent=None, base=None)
        self._next_id = 0

    def new_segment(self, ids: torch.Tensor, owner: str) -> Segment:
        seg = Segment(self._next_id, ids.clone(), owner)
        self._next_id += 1
        return seg

    def insert(self, parent: SegmentNode, segment: Segment, base: KVCache) -> SegmentNode:
        """Attach ``segment`` under ``parent`` with the owner's cache; an existing child with the
        same tokens is returned unchanged (its base stays the first owner's)."""
        if len(base) != len(segment):
            raise ValueError(f"base holds {len(base)} tokens, segment {len(segment)}")
        child = parent.children.get(segment.key)
        if child is None:
            child = SegmentNode(segment, parent, base, depth=parent.depth + 1)
            parent.children[segment.key] = child
        return child

    def match(self, segments: list[torch.Tensor]) -> list[SegmentNode]:
        """The longest chain of existing nodes matching ``segments`` (token runs) from the root."""
        node, out = self.root, []
        for ids in segments:
            node = node.children.get(tuple(int(t) for t in ids))
            if node is None:
                break
            out.append(node)
        return out

    @staticmethod
    def path(node: SegmentNode) -> list[SegmentNode]:
        """Root-to-node list of segment nodes (root excluded)."""
        out = []
        while node is not None and node.segment is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def nodes(self) -> list[SegmentNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def base_nbytes(self) -> int:
        return sum(n.base.nbytes() for n in self.nodes() if n.base is not None)

    def delta_nbytes(self) -> int:
        return sum(d.nbytes() for n in self.nodes() for d in n.deltas.values())
