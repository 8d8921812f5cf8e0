"""The shared tree's low-rank leaves: one reader agent's correction factors per namespace.

An agent's leaves on the shared transcript are typed:

- **exact**: :class:`~sglang_kvcmas.tree.pool_overrides.PoolOverrides` on shared nodes (pool
  slots of tokens it recomputed; per node, since they are tokens of that node);
- **low-rank**: one :class:`LowRankLeaf` per (namespace, agent) holding its
  ``attention.lowrank.LowRankCorrection`` (factors of its deviation from the owners' KV, per
  layer and KV head), read for every borrowed token that no exact leaf holds; not pool slots,
  so it is byte-counted here and bounded by :data:`MAX_LEAVES` (least recently used dropped);
- **both** (``policy/leaf_mode.py``: ``lowrank+exact``).

Bookkeeping only: a correction is an opaque value with ``nbytes()``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

MAX_LEAVES = 4096
"""Most (namespace, agent) low-rank leaves kept (about 0.7 MB each at rank 8 on the embedded
model); the least recently used go first."""


@dataclass(eq=False)
class LowRankLeaf:
    """One agent's low-rank correction in one namespace.

    Attributes:
        correction: an ``attention.lowrank.LowRankCorrection``.
        updated: monotonic time it was last fitted; last_access: last read or fitted.
    """

    correction: Any
    updated: float = field(default_factory=time.monotonic)
    last_access: float = field(default_factory=time.monotonic)

    def nbytes(self) -> int:
        return int(self.correction.nbytes())


class LowRankLeaves:
    """(namespace, agent) -> :class:`LowRankLeaf`, least recently used first."""

    def __init__(self, max_leaves: int = MAX_LEAVES):
        self.max_leaves = max_leaves
        self._leaves: OrderedDict[tuple[Hashable, str], LowRankLeaf] = OrderedDict()

    def clear(self) -> None:
        self._leaves.clear()

    def __len__(self) -> int:
        return len(self._leaves)

    def get(self, namespace: Hashable, agent: str) -> Any | None:
        """The agent's correction (marked used), or None."""
        leaf = self._leaves.get((namespace, agent))
        if leaf is None:
            return None
        leaf.last_access = time.monotonic()
        self._leaves.move_to_end((namespace, agent))
        return leaf.correction

    def put(self, namespace: Hashable, agent: str, correction: Any) -> None:
        """Keep (or replace) the agent's correction; drops the least recently used over the
        cap."""
        self._leaves[(namespace, agent)] = LowRankLeaf(correction)
        self._leaves.move_to_end((namespace, agent))
        while len(self._leaves) > self.max_leaves:
            self._leaves.popitem(last=False)

    def drop_namespace(self, namespace: Hashable) -> None:
        for key in [k for k in self._leaves if k[0] == namespace]:
            del self._leaves[key]

    def nbytes(self) -> int:
        return sum(leaf.nbytes() for leaf in self._leaves.values())

    def bytes_by_agent(self) -> dict[str, int]:
        """agent -> bytes of its low-rank leaves (summed over namespaces)."""
        out: dict[str, int] = {}
        for (_, agent), leaf in self._leaves.items():
            out[agent] = out.get(agent, 0) + leaf.nbytes()
        return out
