"""The accuracy benchmark's parts without a server: sandbox, answer extraction, grading, stats."""

from __future__ import annotations

import itertools
import random

import pytest
from sglang_kvcmas_bench import accuracy_tasks as tasks
from sglang_kvcmas_bench.paired_stats import mcnemar_exact, paired_diff
from sglang_kvcmas_bench.sandbox import run_python


def test_sandbox_runs_code_and_stops_what_it_must():
    ok = run_python("print(6 * 7)")
    assert ok.ok and ok.stdout.strip() == "42" and not ok.timed_out
    slow = run_python("while True:\n    pass", timeout_s=1.0)
    assert not slow.ok and slow.timed_out and slow.seconds < 5
    net = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert not net.ok and ("disabled" in net.stderr or "Network is unreachable" in net.stderr
                           or "Connection refused" in net.stderr)
    big = run_python("x = bytearray(4 << 30)")
    assert not big.ok and "MemoryError" in big.stderr
    env = run_python("import os\nprint(sorted(os.environ))")
    assert env.ok and "KVCMAS" not in env.stdout


def test_answers_are_extracted_from_replies():
    reply = "Here:\n```python\nx = 1\n```\nand better:\n```python\nprint(18.0)\n```\nDone."
    assert tasks.code_block(reply) == "print(18.0)"
    assert tasks.code_block("```python\nprint(3)") == "print(3)"  # cut off before the fence
    assert tasks.code_block("print(3)") == "print(3)"
    assert tasks.printed_number("The answer is 1,234.0\n") == "1234"
    assert tasks.printed_number("0.5") == "0.5" and tasks.printed_number("none") is None
    assert tasks.same_number("18", "18.0") and not tasks.same_number(None, "1")


def test_gsm8k_flow_runs_each_program_and_votes():
    flow = tasks.gsm8k_flow(0, "2 + 2?", rounds=1)
    prog = {"Ada": "```python\nprint(2 + 2)\n```", "Ben": "```python\nprint(4.0)\n```",
            "Cleo": "```python\nprint(5)\n```"}
    flow.record(0, prog)
    assert flow.executions == [{"Ada": "4", "Ben": "4", "Cleo": "5"}]
    assert tasks.gsm8k_vote(flow) == "4"
    tie = tasks.gsm8k_flow(1, "?", rounds=1)
    tie.record(0, {"Ada": "```python\nraise SystemExit(1)\n```", "Ben": "print(7)",
                   "Cleo": "print(8)"})
    assert tasks.gsm8k_vote(tie) == "7"  # ties: the earliest agent's
    # the second round's prompt carries every program and what it printed
    two = tasks.gsm8k_flow(2, "2 + 2?", rounds=2)
    two.record(0, prog)
    user = two.messages(1, "Ben")[1]["content"]
    assert "print(2 + 2)" in user and "printed: 5" in user and user.startswith("Question:")


def test_humaneval_grading_runs_the_problems_own_tests():
    from sglang_kvcmas_examples.datasets import humaneval

    for problem in humaneval()[:3]:
        body = problem["canonical_solution"]
        assert tasks.humaneval_passes(problem, f"```python\n{body}\n```")  # body only
        full = problem["prompt"] + body
        assert tasks.humaneval_passes(problem, f"Sure.\n```python\n{full}```")
        assert not tasks.humaneval_passes(
            problem, f"```python\ndef {problem['entry_point']}(*a):\n    return None\n```")


def test_paired_diff_matches_a_direct_count_and_its_interval_covers_it():
    rng = random.Random(3)
    for n in (1, 7, 33):
        a = [rng.randint(0, 1) for _ in range(n)]
        b = [rng.randint(0, 1) for _ in range(n)]
        d = paired_diff(a, b, resamples=2000)
        assert d.delta == pytest.approx(100 * (sum(b) - sum(a)) / n)
        assert d.ci_low <= d.delta + 1e-9 and d.delta - 1e-9 <= d.ci_high
        assert d.only_a == sum(x and not y for x, y in zip(a, b))
    same = paired_diff([1, 0, 1], [1, 0, 1])
    assert same.delta == same.ci_low == same.ci_high == 0 and same.mcnemar_p == 1.0
    with pytest.raises(ValueError, match="unpaired"):
        paired_diff([1], [1, 0])


def test_mcnemar_exact_matches_the_binomial_by_enumeration():
    for only_a, only_b in [(0, 5), (3, 3), (1, 9), (12, 4)]:
        n = only_a + only_b
        # two-sided: outcomes at least as extreme as min(only_a, only_b) on either side
        k = min(only_a, only_b)
        extreme = sum(1 for bits in itertools.product((0, 1), repeat=n)
                      if min(sum(bits), n - sum(bits)) <= k)
        assert mcnemar_exact(only_a, only_b) == pytest.approx(min(1.0, extreme / 2**n))


def test_agreement_counts_decisions_and_resamples_whole_items():
    from sglang_kvcmas_bench.paired_stats import agreement

    got = agreement([(4, 4), (3, 4), (2, 2), (0, 2)])
    assert (got.n, got.decisions) == (4, 12) and got.rate == pytest.approx(9 / 12)
    assert got.ci_low <= got.rate <= got.ci_high and got.ci_low >= 0 and got.ci_high <= 1
    same = agreement([(3, 3)] * 10)
    assert same.rate == same.ci_low == same.ci_high == 1.0
    with pytest.raises(ValueError):
        agreement([(3, 2)])


def test_judge_consistency_compares_ballots_votes_and_the_fixers_choice():
    from helpers.bench_scripts import load_script

    acc = load_script("benchmark/quality/accuracy.py")

    def debate(printed: list[str], final: str) -> dict:
        return {"final": final, "turns": [{"step": 1, "agent": a, "printed": p, "text": ""}
                                          for a, p in zip(("Ada", "Ben", "Cleo"), printed)]}

    def chain(coder: str, fixer: str, correct: bool) -> dict:
        return {"correct": correct, "turns": [{"step": 0, "agent": "Coder", "text": coder},
                                              {"step": 2, "agent": "Fixer", "text": fixer}]}

    radix = {"g/0": debate(["4", "4", "5"], "4"), "g/1": debate(["1", "1", "1"], "1")}
    ours = {"g/0": debate(["4", "5", "5"], "5"), "g/1": debate(["1", "1", "1"], "1")}
    got = acc.judge_consistency("gsm8k", ours, radix, ["g/0", "g/1"])
    assert got["decisions"] == 8 and got["jcr"] == pytest.approx(6 / 8)
    code = "```python\ndef f():\n    return 1\n```"
    assert acc.decisions("humaneval", chain(code, code + "\n", True)) == ["kept=True",
                                                                         "passed=True"]
    assert acc.decisions("humaneval", chain(code, "```python\nreturn 2\n```", False)) == [
        "kept=False", "passed=False"]
