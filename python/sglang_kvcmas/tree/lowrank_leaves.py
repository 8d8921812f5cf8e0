"""The shared tree's low-rank leaves: one reader agent's correction factors per namespace.

An agent's leaves on the shared transcript are typed:

- **exact**: :class:`~sglang_kvcmas.tree.pool_overrides.PoolOverrides` on shared nodes (pool
  slots of tokens it recomputed; per node, since they are tokens of that node);
- **low-rank**: one :class:`LowRankLeaf` per (namespace, agent) holding its
  ``attention.lowrank.LowRankCorrection`` (factors of its deviation from the owners' KV, per
  layer and KV head), read for every borrowed token that no exact leaf holds; not pool slots,
  so it is byte-counted here and bounded by :data:`MAX_BYTES` (least recently used dropped) and,
  with exact leaves, by the deployment's leaf budget (``shared_tree.trim_leaves``);
- **both** (``policy/leaf_mode.py``: ``lowrank+exact``).

Bookkeeping only: a correction is an opaque value with ``nbytes()``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

MAX_BYTES = 256 << 20
"""Most bytes of low-rank leaves kept (host memory; about 0.7 MB per agent at rank 8 on the
embedded model); the least recently used go first."""


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

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self._leaves: OrderedDict[tuple[Hashable, str], LowRankLeaf] = OrderedDict()
        self._nbytes = 0

    def clear(self) -> None:
        self._leaves.clear()
        self._nbytes = 0

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
        """Keep (or replace) the agent's correction; drops the least recently used (never the
        one just kept) while over the byte cap."""
        key = (namespace, agent)
        old = self._leaves.pop(key, None)
        if old is not None:
            self._nbytes -= old.nbytes()
        leaf = self._leaves[key] = LowRankLeaf(correction)
        self._nbytes += leaf.nbytes()
        while self._nbytes > self.max_bytes and len(self._leaves) > 1:
            _, dropped = self._leaves.popitem(last=False)
            self._nbytes -= dropped.nbytes()

    def items(self) -> list[tuple[tuple[Hashable, str], LowRankLeaf]]:
        """((namespace, agent), leaf) pairs, least recently used first."""
        return list(self._leaves.items())

    def drop(self, namespace: Hashable, agent: str) -> int:
        """Drop the agent's leaf (if any); returns the bytes freed."""
        leaf = self._leaves.pop((namespace, agent), None)
        if leaf is None:
            return 0
        self._nbytes -= leaf.nbytes()
        return leaf.nbytes()

    def drop_namespace(self, namespace: Hashable) -> None:
        for key in [k for k in self._leaves if k[0] == namespace]:
            self._nbytes -= self._leaves.pop(key).nbytes()

    def nbytes(self) -> int:
        return self._nbytes

    def bytes_by_agent(self) -> dict[str, int]:
        """agent -> bytes of its low-rank leaves (summed over namespaces)."""
        out: dict[str, int] = {}
        for (_, agent), leaf in self._leaves.items():
            out[agent] = out.get(agent, 0) + leaf.nbytes()
        return out
