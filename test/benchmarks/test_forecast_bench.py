"""The spend-forecast benchmark's bookkeeping: in-flight counts rebuilt from a recording, the
graded budget replay, and a whole run over a small synthetic recording."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from helpers.bench_scripts import load_script
from sglang_kvcmas.policy import spend_forecast as sf

fb = load_script("benchmark/serving/forecast_bench.py")


def test_in_flight_is_rebuilt_from_send_and_finish_times():
    # planner 0-1 s; three workers sent at 1.1 s, finishing at 2, 3, 4 s; aggregator 4.1-5 s
    usage = [{"t0": 0.0}, {"t0": 1.1}, {"t0": 1.1}, {"t0": 1.1}, {"t0": 4.1}]
    ledger = [{"t": 1.0}, {"t": 2.0}, {"t": 3.0}, {"t": 4.0}, {"t": 5.0}]
    assert [t["in_flight"] for t in fb.with_in_flight(ledger, usage)] == [0, 2, 1, 0, 0]
    recorded = [{**t, "in_flight": 9} for t in ledger]  # a recording that has it keeps it
    assert fb.with_in_flight(recorded, usage) == recorded
    assert fb.with_in_flight(ledger, usage[:2]) == ledger  # counts that do not match: as is


def test_the_replay_counts_success_only_for_right_answers_that_completed():
    grow = [sf.TrajectoryState(turns=k, recomputed=100 * k) for k in range(1, 6)]  # 500 total
    runs = [fb.ReplayRun(grow, True), fb.ReplayRun(grow, False), fb.ReplayRun(grow, None),
            fb.ReplayRun(grow[:2], True)]
    spent, succeeded = fb.budget_outcome(runs, None, budget=1000, m=1.0)
    assert (spent, succeeded) == (500 * 3 + 200, 3)  # the wrong answer does not succeed
    spent, succeeded = fb.budget_outcome(runs, None, budget=300, m=1.0)
    assert succeeded == 1  # only the 2-turn run ends before the cap refuses


def test_a_refused_run_with_versions_submits_its_latest_version():
    grow = [sf.TrajectoryState(turns=k, recomputed=100 * k) for k in range(1, 6)]  # 500 total
    # versions after turns 1 (wrong) and 3 (right); the final answer (turn 5's) is wrong
    run = fb.ReplayRun(grow, False, ((1, False), (3, True)))
    assert fb.replay(grow, None, 300, 1.0) == (300, 3)  # refused before turn 4
    assert fb.budget_outcome([run], None, budget=300, m=1.0) == (300, 1)  # turn 3's version
    assert fb.budget_outcome([run], None, budget=200, m=1.0) == (200, 0)  # turn 1's: wrong
    assert fb.budget_outcome([run], None, budget=1000, m=1.0) == (500, 0)  # its own end
    assert not fb.ReplayRun(grow, True).succeeded(3)  # no versions: a refused run fails


def synthetic_recording(path: Path, n: int = 30, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            turns, t = [], 0.0
            for k in range(rng.randint(3, 9)):
                t += 1.0
                turns.append({"t": t, "agent": f"a{k % 3}", "prompt_tokens": 100 + 50 * k,
                              "recomputed": 60 + 10 * k,
                              "completion_tokens": rng.randint(20, 120), "in_flight": 0})
            f.write(json.dumps({"kind": ("debate", "panel")[i % 2], "qid": i,
                                "model": "toy", "ledger_turns": turns,
                                "outcome": {"correct": rng.random() < 0.5,
                                            "versions": [[1, rng.random() < 0.5]]}}) + "\n")


def test_a_whole_run_reports_the_headline(tmp_path, monkeypatch, capsys):
    synthetic_recording(tmp_path / "record_runs_toy0.5b.jsonl")  # a dot, as in "qwen2.5"
    monkeypatch.setattr(fb, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["forecast_bench.py", "--runs", "record_runs_toy0.5b",
                                      "--folds", "3"])
    assert fb.main() == 0
    out = capsys.readouterr().out
    assert "succeeded (submitted answer right)" in out and "no budget (every run" in out
    assert "stopped by a refusal, its latest version" in out  # the recording has versions
    headline = out.strip().splitlines()[-1]
    assert headline.startswith("HEADLINE mape_at_50pct=") and "naive_mape_at_50pct=" in headline
    assert (tmp_path / "forecast_bench_toy0.5b.txt").read_text() == out
    assert (tmp_path / "forecast_bench_toy0.5b.png").stat().st_size > 0
    monkeypatch.setattr(sys, "argv", ["forecast_bench.py", "--runs", "record_runs_toy0.5b",
                                      "--fit", "--out", str(tmp_path / "toy.json")])
    assert fb.main() == 0
    assert sf.load(tmp_path / "toy.json").forecast(sf.TrajectoryState(turns=1)).total >= 0
