"""``kvcmas:leaf_bytes{agent, type}``: rate-limited, label-bounded, zero once an agent's leaves
are gone."""

from __future__ import annotations

import pytest
from sglang_kvcmas.integration.leaf_metrics import OTHER, LeafGauge

prometheus_client = pytest.importorskip("prometheus_client")


def _value(agent: str, kind: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(
        "kvcmas:leaf_bytes", {"agent": agent, "type": kind})


def test_labels_are_bounded_and_gone_agents_read_zero():
    g = LeafGauge(min_interval_s=0, max_agents=2)
    got = g.values({"a": {"exact": 10, "factored": 1}, "b": {"exact": 5},
                    "c": {"exact": 7, "factored": 2}, "d": {"exact": 1, "factored": 0}})
    assert got == {("a", "exact"): 10, ("a", "factored"): 1, ("b", "exact"): 5,
                   ("b", "factored"): 0, (OTHER, "exact"): 8, (OTHER, "factored"): 2}
    later = g.values({"b": {"exact": 3, "factored": 0}})
    assert later[("a", "exact")] == 0 and later[(OTHER, "factored")] == 0
    assert later[("b", "exact")] == 3


def test_the_gauge_is_set_at_most_once_per_interval():
    g = LeafGauge(min_interval_s=1.0)
    calls = []

    def by_agent():
        calls.append(1)
        return {"leaf-metric-agent": {"exact": 4096, "factored": 512}}

    assert g.maybe_update(by_agent, now=100.0)
    assert not g.maybe_update(by_agent, now=100.5)  # the tree is not walked again
    assert len(calls) == 1
    assert _value("leaf-metric-agent", "exact") == 4096
    assert _value("leaf-metric-agent", "factored") == 512
    assert g.maybe_update(lambda: {}, now=101.5)
    assert _value("leaf-metric-agent", "exact") == 0
