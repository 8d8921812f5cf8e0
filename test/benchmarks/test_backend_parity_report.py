"""backend_parity's comparison: same greedy tokens per turn, and the largest logprob gap over the
chosen tokens and the top alternatives both backends name."""

from __future__ import annotations

from helpers.bench_scripts import load_script

compare = load_script("benchmark/serving/backend_parity.py").compare


def turn(tokens, logprobs, top):
    return {"tokens": tokens, "logprobs": logprobs, "top": top}


def test_compare_reports_tokens_and_the_largest_gap():
    ref = {"a": turn([1, 2], [-0.1, -0.2], [[(-0.1, 1, None), (-3.0, 7, None)],
                                            [(-0.2, 2, None)]])}
    got = {"a": turn([1, 2], [-0.1, -0.25], [[(-0.1, 1, None), (-3.5, 7, None)],
                                             [(-0.25, 2, None), (-4.0, 9, None)]])}
    row = compare(ref, got)["a"]
    assert row["same_tokens"] and abs(row["max_logprob_diff"] - 0.5) < 1e-9  # token 7's gap
    got["a"]["tokens"] = [1, 3]
    assert not compare(ref, got)["a"]["same_tokens"]
