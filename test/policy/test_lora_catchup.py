"""Which adapters a request of a workflow catches up (``policy/lora_catchup.py``)."""

from __future__ import annotations

from sglang_kvcmas.policy.lora_catchup import CatchupPlanner


def test_the_other_adapters_seen_in_the_workflow_most_recent_first():
    p = CatchupPlanner()
    assert p.on_request("w1", "planner") == []
    assert p.on_request("w1", "solver") == ["planner"]
    assert p.on_request("w1", "critic") == ["solver", "planner"]
    assert p.on_request("w1", "planner") == ["critic", "solver"]
    assert p.on_request("w2", "solver") == []  # workflows are apart


def test_memory_is_bounded_in_workflows_and_adapters():
    p = CatchupPlanner(max_workflows=2, max_adapters=3)
    for w in ("a", "b", "c"):
        p.on_request(w, "x")
    assert len(p) == 2
    assert p.on_request("a", "y") == []  # "a" was the least recently active: forgotten
    for name in ("p", "q", "r", "s"):
        p.on_request("b", name)
    assert p.on_request("b", "t") == ["s", "r"]  # at most max_adapters - 1 others
