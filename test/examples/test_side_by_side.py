"""The side-by-side report: per-turn rows from each arm's own record, and an honest summary."""

from __future__ import annotations

from sglang_kvcmas_examples.debate import Turn
from sglang_kvcmas_examples.side_by_side import ArmResult, prefilled, summary, table


def turn(agent, prompt, cached, answer, reuse=None, ttft=1.0, round_=1):
    return Turn(round_, agent, answer, prompt, cached, 8, ttft, None, 2.0, reuse)


def rec(exact, repos, recomputed):
    return {"reused_exact": exact, "reused_factored": 0, "reused_repositioned": repos,
            "recomputed": recomputed}


def test_rows_and_summary():
    radix = ArmResult("radix", [turn("A", 100, 0, "x"), turn("B", 100, 0, "y"),
                                turn("C", 100, 0, "z"), turn("A", 300, 100, "p", ttft=2.0, round_=2)],
                      1000, 9.0)
    ours = ArmResult("kvcmas", [turn("A", 100, 0, "x", rec(0, 0, 100)),
                                turn("B", 100, 0, "y", rec(0, 0, 100)),
                                turn("C", 100, 0, "z", rec(0, 0, 100)),
                                turn("A", 310, 100, "q", rec(100, 180, 30), ttft=1.0,
                                     round_=2)],
                     500, 8.0)
    assert prefilled(radix.turns[3]) == 200 and prefilled(ours.turns[3]) == 30
    rows = table(radix, ours)
    assert len(rows) == 2 + 4 and "310" in rows[-1] and rows[-1].endswith("no")
    line = summary(radix, ours)
    assert "prefill_tokens radix=500 kvcmas=330" in line
    assert "(2.00x)" in line and "kv_held radix=1000 kvcmas=500 (0.50x)" in line
    assert line.endswith("same_answers=3/4")


def test_the_workflow_line_reads_the_servers_ledger():
    from sglang_kvcmas_examples.side_by_side import workflow_line

    ledger = {"workflow": "side-by-side-1", "requests": 9, "prompt_tokens": 4000,
              "reused_exact": 1000, "reused_factored": 0, "reused_repositioned": 2500,
              "recomputed": 500, "completion_tokens": 576, "computed": 1076,
              "kv_bytes_written": 3 * 2**20, "forecast": {"total": 1076}}
    line = workflow_line(ledger)
    assert line.startswith("WORKFLOW side-by-side-1 requests=9 prompt=4000 exact=1000")
    assert "computed=1076 kv_written_mib=3.0 forecast_total=1076" in line
    assert workflow_line({**ledger, "forecast": None}).endswith("forecast_total=None")
