"""Delta store: (segment, agent) -> delta leaf, with byte accounting and eviction.

Bookkeeping only: which leaves exist and what they cost. Tensor work lives in ``leaf.py``.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_kvcmas.delta.leaf import DeltaLeaf, tensors_nbytes

__all__ = ["DeltaStore"]


class DeltaStore:
    """Leaves keyed by (segment_id, agent), least recently used first."""

    def __init__(self, capacity_bytes: int | None = None):
        self.capacity_bytes = capacity_bytes
        self._leaves: OrderedDict[tuple[int, str], DeltaLeaf] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._leaves)

    def put(self, leaf: DeltaLeaf) -> None:
        key = (leaf.segment_id, leaf.agent)
        self._leaves.pop(key, None)
        self._leaves[key] = leaf
        self._evict_to_capacity()

    def get(self, segment_id: int, agent: str) -> DeltaLeaf | None:
        leaf = self._leaves.get((segment_id, agent))
        if leaf is not None:
            self._leaves.move_to_end((segment_id, agent))
        return leaf

    def nbytes(self) -> int:
        return tensors_nbytes(t for leaf in self._leaves.values() for t in leaf.tensors())

    def evict(self, segment_id: int, agent: str) -> bool:
        return self._leaves.pop((segment_id, agent), None) is not None

    def _evict_to_capacity(self) -> None:
        if self.capacity_bytes is None:
            return
        while len(self._leaves) > 1 and self.nbytes() > self.capacity_bytes:
            self._leaves.popitem(last=False)
            self.num_evicted += 1
