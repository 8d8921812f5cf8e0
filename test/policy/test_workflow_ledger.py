"""The per-workflow ledger and what the HTTP process adds to it, without a server."""

from __future__ import annotations

import pytest

from sglang_kvcmas.integration import workflow_accounting as wa
from sglang_kvcmas.policy.workflow_ledger import Turn, WorkflowLedger


def record(workflow, agent, exact, repositioned, recomputed):
    return {"workflow": workflow, "agent": agent, "prompt_tokens": exact + repositioned + recomputed,
            "reused_exact": exact, "reused_factored": 0, "reused_repositioned": repositioned,
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


def test_turns_carry_the_requests_still_in_flight_and_aborts_leave_flight():
    ledger = WorkflowLedger()
    ledger.begin("fan", 0.0, 1)  # the planner
    ledger.add("fan", Turn.of_record(1.0, record("fan", "planner", 0, 0, 10), 5))
    ledger.begin("fan", 1.5, 3)  # three workers
    ledger.add("fan", Turn.of_record(2.0, record("fan", "w", 10, 0, 4), 5))
    ledger.add("fan", Turn.of_record(2.1, record("fan", "w", 10, 0, 4), 5))
    fan = ledger.get("fan")
    assert [t.in_flight for t in fan.turns] == [0, 2, 1]
    assert fan.in_flight == 1 and fan.state.in_flight == 1
    assert fan.to_json()["in_flight"] == 1
    ledger.abandon("fan", 1)  # the last worker was aborted
    assert fan.in_flight == 0
    ledger.abandon("fan", 5)  # never below zero; unknown workflows are ignored
    ledger.abandon("nobody", 1)
    assert fan.in_flight == 0 and ledger.get("nobody") is None
    ledger.add("fan", Turn.of_record(3.0, record("fan", "agg", 20, 0, 4), 5))  # not begun: 0
    assert fan.turns[-1].in_flight == 0


def test_observing_counts_a_request_in_flight_until_it_finishes_or_ends(monkeypatch):
    import asyncio

    ledger = WorkflowLedger()
    monkeypatch.setattr(wa, "LEDGER", ledger)
    rec = record("wf", "a", 4, 6, 2)
    done = {"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 5,
                          "kvcmas_reuse": [rec]}}

    async def stream(items):
        for item in items:
            yield item

    async def consume(gen, stop_after=None):
        seen = 0
        async for _ in gen:
            seen += 1
            if stop_after is not None and seen >= stop_after:
                break
        await gen.aclose()

    first = wa.observing(stream([{"meta_info": {"finish_reason": None}}, done]), ["wf"])
    second = wa.observing(stream([{"meta_info": {"finish_reason": None}}, done]), ["wf"])
    assert ledger.get("wf").in_flight == 2  # both admitted, neither finished
    asyncio.run(consume(first))
    assert ledger.get("wf").in_flight == 1 and ledger.get("wf").turns[-1].in_flight == 1
    asyncio.run(consume(second, stop_after=1))  # the client went away mid-stream
    assert ledger.get("wf").in_flight == 0 and ledger.get("wf").requests == 1
    untracked = wa.observing(stream([done]), [None])  # no workflow: nothing begun
    asyncio.run(consume(untracked))
    assert ledger.get("wf").in_flight == 0 and ledger.get("wf").requests == 2


def test_kv_bytes_follow_the_servers_bytes_per_token():
    ledger = WorkflowLedger()
    rec = {**record("kv", "a", 10, 5, 3), "kv_bytes_per_token": 100}
    ledger.add("kv", Turn.of_record(1.0, rec, 7))
    ledger.add("kv", Turn.of_record(2.0, record("kv", "b", 2, 0, 1), 1))  # unknown: 0 bytes
    kv = ledger.get("kv")
    assert kv.kv_bytes_written == (3 + 7) * 100 and kv.kv_bytes_read == 18 * 100
    out = kv.to_json(with_turns=True)
    assert (out["kv_bytes_written"], out["kv_bytes_read"]) == (1000, 1800)
    assert [t["kv_bytes_written"] for t in out["turns"]] == [1000, 0]
