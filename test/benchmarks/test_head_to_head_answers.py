"""The head-to-head's answer extraction (``sglang_kvcmas_bench.answers``): a debate's final answer is the same in every process
(ties included), and answers compare as numbers."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_kvcmas_bench.answers import final_answer, same_answer


def turn(agent: str, step: int, text: str, wid: int = 0) -> dict:
    return {"kind": "debate", "wid": wid, "step": step, "agent": agent, "text": text}


def test_majority_of_the_last_step_and_ties_go_to_the_first_agent():
    turns = [turn("Ada", 0, "Final answer: 1"), turn("Ada", 2, "so 7. Final answer: 12"),
             turn("Ben", 2, "Final answer: 9"), turn("Cleo", 2, "Final answer: 9")]
    assert final_answer(turns, "debate", 0) == "9"
    tie = [turn("Cleo", 2, "Final answer: 5"), turn("Ada", 2, "Final answer: 12"),
           turn("Ben", 2, "no number")]
    assert final_answer(tie, "debate", 0) == "12"
    assert final_answer([turn("Ada", 0, "none")], "debate", 0) is None


def test_a_tie_is_broken_the_same_way_in_every_process():
    code = ("from sglang_kvcmas_bench.answers import final_answer as f; "
            "t = [{'wid': 0, 'step': 0, 'agent': a, 'text': x} for a, x in "
            "(('Ada', '3'), ('Ben', '17'), ('Cleo', '250'))]; print(f(t, 'debate', 0))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip()
            for seed in range(6)}
    assert seen == {"3"}


def test_answers_compare_as_numbers():
    assert same_answer("18", "18.0") and same_answer(None, None)
    assert not same_answer("18", None) and not same_answer("18", "19")
