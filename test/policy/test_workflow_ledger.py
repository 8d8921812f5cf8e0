"""The per-workflow ledger and what the HTTP process adds to it, without a server."""

from __future__ import annotations

import pytest

from sglang_kvcmas.integration import workflow_accounting as wa
from sglang_kvcmas.policy.workflow_ledger import Turn, WorkflowLedger


def record(workflow, agent, exact, repositioned, recomputed):
    return {"workflow": workflow, "agent": agent, "prompt_tokens": exact + repositioned + recomputed,
            "reused_exact": exact, "reused_corrected": 0, "reused_repositioned": repositioned,
            "recomputed": recomputed}


def test_totals_add_up_and_the_ledger_stays_bounded():
    ledger = WorkflowLedger(max_workflows=3, max_turns=2)
    for i in range(4):
        ledger.add("a", Turn.of_record(float(i), record("a", f"x{i % 2}", 10, 5, 3), 7))
    a = ledger.get("a")
    assert (a.requests, a.prompt_tokens, a.reused_exact, a.recomputed) == (4, 72, 40, 12)
    assert a.computed == 12 + 28 and len(a.agents) == 2
    assert [t.t for t in a.turns] == [2.0, 3.0]  # the last max_turns
    for w in "bcd":
        ledger.add(w, Turn.of_record(9.0, record(w, None, 1, 0, 1), 1))
    assert ledger.get("a") is None and ledger.dropped == 1 and len(ledger) == 3
    ledger.add("b", Turn.of_record(10.0, record("b", None, 1, 0, 1), 1))  # b most recent now
    assert [w.workflow for w in ledger.recent()] == ["b", "d", "c"]
    snap = ledger.snapshot(limit=2)
    assert [w["workflow"] for w in snap["workflows"]] == ["b", "d"] and snap["dropped"] == 1
    assert snap["workflows"][0]["reused_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        WorkflowLedger(max_workflows=0)


def test_only_finished_requests_of_a_workflow_are_observed(monkeypatch):
    ledger = WorkflowLedger()
    monkeypatch.setattr(wa, "LEDGER", ledger)
    rec = record("wf", "a", 4, 6, 2)
    wa.observe({"meta_info": {"finish_reason": None, "kvcmas_reuse": [rec]}})  # stream chunk
    wa.observe({"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 5}})
    wa.observe({"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 5,
                              "kvcmas_reuse": [{**rec, "workflow": None}]}})
    assert len(ledger) == 0
    wa.observe([{"meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 5,
                               "kvcmas_reuse": [rec]}}] * 2, now=1.0)  # a batch
    wf = ledger.get("wf")
    assert wf.requests == 2 and wf.completion_tokens == 10 and wf.reused_repositioned == 12


def test_metric_labels_are_bounded(monkeypatch):
    monkeypatch.setattr(wa, "_labelled", set())
    monkeypatch.setattr(wa, "METRIC_WORKFLOWS", 2)
    assert [wa.metric_label(w) for w in ("a", "b", "c", "a")] == ["a", "b", wa.OTHER, "a"]
