"""Leaf bytes per agent as a Prometheus gauge: ``kvcmas:leaf_bytes{agent, type}``.

``type`` is ``exact`` (pool bytes of the agent's exact leaves) or ``factored`` (its factored
leaves), as ``/server_info``'s ``leaf_bytes_by_agent``. The scheduler
calls :meth:`maybe_update` after each checkpoint; it walks the tree's leaves at most once per
:data:`MIN_INTERVAL_S`, so the hot path pays nothing between updates. Labels stay bounded: the first
:data:`METRIC_AGENTS` agents seen keep their own, later ones are summed under ``_other``; an agent
whose leaves are gone reads 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sglang_kvcmas.integration import metrics

MIN_INTERVAL_S = 1.0
METRIC_AGENTS = 64
OTHER = "_other"
TYPES = ("exact", "factored")


def _gauge():
    return metrics.gauge("kvcmas:leaf_bytes", "Bytes of readers' leaves per agent, by type "
                         "(exact: pool KV of exact leaves; factored: low-rank deviations of "
                         "recomputed tokens).",
                         ["agent", "type"])


class LeafGauge:
    """Rate-limited, label-bounded updates of ``kvcmas:leaf_bytes``."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S, max_agents: int = METRIC_AGENTS):
        self.min_interval_s = min_interval_s
        self.max_agents = max_agents
        self._last = float("-inf")
        self._labelled: set[str] = set()
        self._set: set[str] = set()

    def label(self, agent: str) -> str:
        """The agent's label value: itself for the first ``max_agents`` agents, ``_other``
        after."""
        if agent in self._labelled:
            return agent
        if len(self._labelled) < self.max_agents:
            self._labelled.add(agent)
            return agent
        return OTHER

    def values(self, by_agent: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
        """(label, type) -> bytes, every label set before included (0 when gone)."""
        out = {(label, t): 0 for label in self._set for t in TYPES}
        for agent, types in by_agent.items():
            label = self.label(agent)
            for t in TYPES:
                out[(label, t)] = out.get((label, t), 0) + int(types.get(t, 0))
        self._set |= {label for label, _ in out}
        return out

    def maybe_update(self, by_agent: Callable[[], dict[str, dict[str, int]]],
                     now: float | None = None) -> bool:
        """Set the gauge from ``by_agent()`` unless it was set less than ``min_interval_s``
        ago (or prometheus_client is missing); returns whether it was set."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.min_interval_s:
            return False
        gauge = _gauge()
        if gauge is None:
            return False
        self._last = now
        for (label, t), value in self.values(by_agent()).items():
            gauge.labels(agent=label, type=t).set(value)
        return True
