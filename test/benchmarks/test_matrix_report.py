"""The workload matrix's report (no server): per-run headline ratios, their medians and spreads,
and ``--append``'s check of the runs already in a result file."""

from __future__ import annotations

import json

import pytest
from helpers.bench_scripts import load_script

mx = load_script("benchmark/serving/matrix.py")

NAMES = ["panel", "debate"]


def _compare(makespan: float, kv: float, plain: float = 1.0, reader: float = 1.0,
             ttft: float = 2.0) -> dict:
    return {"makespan_ratio": makespan, "output_tps_ratio": makespan, "kv_ratio": kv,
            "radix_pool_saturated": False, "ttft_ratio_nonowner": ttft,
            "plain_decode_ratio": plain, "reader_decode_ratio": reader,
            "same_turns": 3, "turns": 4, "same_answer": 2, "finals": 2, "readers": 2}


def _run(panel: float, debate: float, kv_debate: float, commit: str = "abc1234") -> dict:
    return {"commit": commit,
            "arms": {"radix": {w: {} for w in NAMES}, "kvcmas": {w: {} for w in NAMES}},
            "compare": {"kvcmas": {"panel": _compare(panel, 0.4, plain=1.1),
                                   "debate": _compare(debate, kv_debate, plain=0.9,
                                                      reader=1.2, ttft=3.0)}}}


def test_headline_is_per_run_then_median_across_runs():
    runs = [_run(1.7, 1.2, 0.5), _run(1.4, 1.3, 0.7), _run(1.9, 1.05, 0.55)]
    head = mx.headline(runs, NAMES)
    assert head["min_makespan_ratio"] == [1.2, 1.3, 1.05]  # each run's worst workload
    assert head["kv_ratio"] == [0.5, 0.7, 0.55]  # each run's largest
    assert head["panel_makespan_ratio"] == [1.7, 1.4, 1.9]
    assert head["plain_decode_ratio"] == pytest.approx([1.0, 1.0, 1.0])  # median of 1.1, 0.9
    assert mx.spread(head["min_makespan_ratio"]) == "1.05–1.30"
    assert mx.spread([1.2]) == ""


def test_report_prints_medians_and_spreads(capsys):
    runs = [_run(1.7, 1.2, 0.5, "aaa"), _run(1.4, 1.3, 0.7, "bbb"), _run(1.9, 1.05, 0.55, "ccc")]
    mx.report(runs, ["radix", "kvcmas"], NAMES)
    out = capsys.readouterr().out
    assert "3 runs (commits aaa, bbb, ccc; first arm radix, radix, radix)" in out
    assert "min_makespan_ratio=1.05–1.30" in out
    head = out.strip().splitlines()[-1]
    assert head.startswith("HEADLINE ")
    assert "min_makespan_ratio=1.20" in head and "kv_ratio=0.55" in head
    assert "panel_makespan_ratio=1.70" in head and "debate_makespan_ratio=1.20" in head


def test_append_reads_earlier_runs_and_tags_their_commit(tmp_path):
    path = tmp_path / "m.json"
    assert mx.earlier_runs(path, ["radix", "kvcmas"], NAMES) == []  # nothing yet
    old = _run(1.5, 1.2, 0.5)
    del old["commit"]  # written before runs carried their commit
    path.write_text(json.dumps({"commit": "96957a2", "runs": [old]}))
    runs = mx.earlier_runs(path, ["kvcmas", "radix"], NAMES)
    assert [r["commit"] for r in runs] == ["96957a2"]
    assert runs[0]["order"] == ["radix", "kvcmas"]  # before the order alternated: as listed


def test_arms_alternate_their_order_run_by_run():
    arms = ["radix", "kvcmas", "radix_delta"]
    assert mx.arm_order(arms, 0) == arms
    assert mx.arm_order(arms, 1) == ["radix_delta", "kvcmas", "radix"]
    assert mx.arm_order(arms, 2) == arms
    assert arms == ["radix", "kvcmas", "radix_delta"]  # the caller's list untouched


def test_append_refuses_other_arms_or_workloads(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"commit": "x", "runs": [_run(1.5, 1.2, 0.5)]}))
    with pytest.raises(SystemExit, match="holds arms radix,kvcmas over panel,debate"):
        mx.earlier_runs(path, ["radix", "kvcmas", "radix_delta"], NAMES)
    with pytest.raises(SystemExit, match="use another --out"):
        mx.earlier_runs(path, ["radix", "kvcmas"], ["panel"])
