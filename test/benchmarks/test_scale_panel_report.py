"""The review panel's report (``sglang_kvcmas_bench.review_panel``, run by
``benchmark/serving/scale.py`` and ``frontier.py``) over made-up turns (no server)."""

from __future__ import annotations

import pytest
from helpers.bench_scripts import load_script
from sglang_kvcmas_bench.review_panel import leaf_bytes_per_agent, nonowner_ttft, same_answers

parse_variants = load_script("benchmark/serving/scale.py").parse_variants


def turns(texts: dict[tuple[int, int], str], ttft: float, borrowed: int = 0) -> list[dict]:
    return [{"round": r, "agent": a, "text": t, "ttft": ttft,
             "borrowed": borrowed if r and a else 0} for (r, a), t in texts.items()]


def test_variants_parse_and_bad_ones_are_refused():
    assert parse_variants("") == {}
    assert parse_variants("exact=--kvcmas-leaf-mode exact; b0=--x") == {
        "exact": ["--kvcmas-leaf-mode", "exact"], "b0": ["--x"]}
    for bad in ("cap64", "=--x", "radix=--x", "kvcmas=--x"):
        with pytest.raises(SystemExit, match="NAME=FLAGS"):
            parse_variants(bad)


def test_same_answers_per_round_and_nonowner_ttft_of_a_variant():
    radix = {(r, a): f"{r}{a}" for r in range(3) for a in range(4)}
    ours = dict(radix) | {(1, 2): "other", (2, 0): "x", (2, 3): "y"}
    panel = {"radix": {"turns": turns(radix, 4.0)},
             "cap": {"turns": turns(ours, 1.0, borrowed=100)}}
    assert same_answers(panel, "cap") == {"round1": 0.75, "round2": 0.5}
    assert nonowner_ttft(panel, "cap") == {"radix": 4.0, "cap": 1.0}
    panel["cap"]["turns"] = turns(ours, 1.0, borrowed=0)
    assert nonowner_ttft(panel, "cap") == {}


def test_probe_pools_kl_over_the_probed_readers(monkeypatch):
    """KL recovered = 1 - mean served KL / mean naive KL, against the salted exact read."""
    from sglang_kvcmas_bench import review_panel as scale

    tops = {"exact": {1: -0.1, 2: -2.5}, "served": {1: -0.2, 2: -2.0},
            "naive": {1: -0.5, 2: -1.2}}

    def fake_forced(url, ids, cont, salt=None, config=None, custom=None, body=None):
        kind = "exact" if salt else ("naive" if config else "served")
        return {"tops": [tops[kind]] * len(cont), "chosen": [-0.1] * len(cont),
                "reuse": {"recomputed": 7, "borrowed": 70} if kind == "served" else {}}

    monkeypatch.setattr(scale, "generate", lambda url, ids, new, salt=None: {
        "output_ids": [1, 1, 1][:new]})
    monkeypatch.setattr(scale, "forced", fake_forced)
    got = scale.probe_readers("http://x", [[0], [0, 5]], [1], new=3)
    exact = fake_forced("", [], [1], salt="s")
    served = scale.compare(exact, fake_forced("", [], [1]), [1])
    naive = scale.compare(exact, fake_forced("", [], [1], config=(0, 0.0, 0)), [1])
    assert got["agents"][0]["recomputed"] == 7 and got["top1"] == 1.0
    assert got["kl_recovered"] == pytest.approx(1 - served["kl20"] / naive["kl20"])
    assert 0 < got["kl_recovered"] < 1
    assert scale.probe_readers("http://x", [[0]], [], new=3)["kl_recovered"] is None


def test_leaf_bytes_come_from_the_shared_tree_entry_of_server_info(monkeypatch):
    """``/server_info`` → ``internal_states[i].kvcmas.shared_tree``; leaf types add up."""
    import io
    import json

    from sglang_kvcmas_bench import server_arms

    tree = {"factored_bytes": 27, "leaf_bytes_by_agent": {
        "a": {"exact": 100, "factored": 20}, "b": {"exact": 0, "factored": 7}}}
    info = {"internal_states": [{"other": 1}, {"kvcmas": {"shared_tree": tree}}]}
    monkeypatch.setattr(server_arms.urllib.request, "urlopen",
                        lambda url, timeout: io.BytesIO(json.dumps(info).encode()))
    got = server_arms.shared_tree_stats("http://x")
    assert got == tree
    assert leaf_bytes_per_agent(got["leaf_bytes_by_agent"]) == [7, 120]
    assert leaf_bytes_per_agent(None) == []
    info["internal_states"] = [{"kvcmas": {"tree_cache_class": "stock"}}]
    assert server_arms.shared_tree_stats("http://x") == {}


def test_a_turn_record_keeps_what_it_borrowed_computed_and_recomputed():
    from sglang_kvcmas_bench.review_panel import turn_record

    meta = {"prompt_tokens": 10, "cached_tokens": 7, "kvcmas_reuse": [
        {"reused_exact": 2, "reused_repositioned": 5, "recomputed": 3,
         "recomputed_borrowed": 1}]}
    turn = {"round": 1, "agent": 2, "prompt_len": 10, "ttft": 0.5, "tokens": 3, "text": "a",
            "start": 0.0, "meta": meta}
    assert turn_record(turn) == {"round": 1, "agent": 2, "prompt_len": 10, "ttft": 0.5,
                                 "tokens": 3, "text": "a", "borrowed": 5, "computed": 3,
                                 "recomputed": 1}
