"""The leaf-mode frontier's report (``benchmark/serving/frontier.py``) over made-up arms."""

from __future__ import annotations

import pytest
from helpers.bench_scripts import load_script

frontier = load_script("benchmark/serving/frontier.py")
ARMS, DEFAULT_ARM, EXACT_ARM, TARGETS = (frontier.ARMS, frontier.DEFAULT_ARM, frontier.EXACT_ARM,
                                         frontier.TARGETS)
arm_row, main, meets, pick = frontier.arm_row, frontier.main, frontier.meets, frontier.pick
turn_selection, with_leaf_ratios = frontier.turn_selection, frontier.with_leaf_ratios
with_pooled_kl = frontier.with_pooled_kl


def panel_run(ttft: float, peak: int, leaves: dict | None = None, kl=None,
              texts: str = "a") -> dict:
    turns = [{"round": r, "agent": a, "text": texts if r else "hi", "ttft": ttft,
              "borrowed": 100 if r and a else 0, "computed": 50, "recomputed": 5 if a else 0}
             for r in range(3) for a in range(3)]
    fid = None if kl is None else {"kl_recovered": kl, "kl20": 0.1, "kl20_naive": 0.2,
                                   "top1": 0.99, "top1_naive": 0.98, "agents": [{}, {}]}
    return {"turns": turns, "peak_kv_tokens": peak, "one_copy_ideal_tokens": 1000,
            "leaf_bytes_by_agent": leaves, "fidelity": fid, "makespan_s": 10.0, "flags": []}


def test_arm_row_counts_factored_leaves_in_kv_and_compares_with_radix():
    panel = {"radix": panel_run(4.0, 3000),
             "factored8": panel_run(1.0, 1100, {"b": {"exact": 0, "factored": 64_000},
                                                "c": {"exact": 0, "factored": 64_000}}, 0.4)}
    panel["factored8"]["flags"] = ARMS["factored8"]
    row = arm_row(panel, "factored8", kv_bytes_per_token=640)
    assert row["kv_vs_ideal"] == pytest.approx((1100 + 128_000 / 640) / 1000)
    assert row["ttft_speedup_vs_radix"] == 4.0
    assert row["same_answer_as_radix"] == 1.0
    assert row["leaf_bytes_per_agent"] == 64_000
    assert row["computed_tokens"] == 9 * 50 and row["recomputed_tokens"] == 4 * 5
    assert row["probed"] == 2 and row["kl_recovered"] == 0.4 and row["factored_bytes"] == 128_000
    # An exact arm probed as in its turn too: that figure leads, the reader-alone one stays
    # beside it; its leaves are pool slots, already in its peak.
    panel["exact"] = panel_run(1.0, 1100, {"b": {"exact": 64_000, "factored": 0}}, 0.4)
    panel["exact"]["flags"] = ARMS["exact"]
    panel["exact"]["fidelity"] |= {"kl_recovered_turn": 0.1, "top1_turn": 0.95,
                                   "turn_config": [16, 0.0133, 0]}
    row = arm_row(panel, "exact", kv_bytes_per_token=640)
    assert row["kv_vs_ideal"] == pytest.approx(1.1)
    assert (row["kl_recovered"], row["kl_recovered_alone"]) == (0.1, 0.4)
    assert (row["top1"], row["top1_alone"]) == (0.95, 0.99)


def test_turn_selection_is_the_policys_split_among_waiting_readers(monkeypatch):
    for var in ("KVCMAS_RECOMPUTE_MASS_FRACTION", "KVCMAS_RECOMPUTE_BOUNDARY"):
        monkeypatch.delenv(var, raising=False)
    boundary, mass, tail = turn_selection(ARMS["exact"], 16)  # 15 readers split 20%
    assert (boundary, tail) == (16, 0) and mass == pytest.approx(0.2 / 15)
    assert turn_selection(ARMS["exact"], 3)[1] == pytest.approx(0.1)  # 2 readers: 10% each
    assert turn_selection(ARMS["naive"], 16) == (0, 0.0, 0)


def test_leaf_ratio_against_exact_and_the_pick_among_arms_meeting_the_targets():
    rows = {
        "naive": {"kl_recovered": 0.0, "ttft_speedup_vs_radix": 3.0, "kv_vs_ideal": 1.05,
                  "leaf_bytes_per_agent": 0},
        "exact": {"kl_recovered": 0.7, "ttft_speedup_vs_radix": 3.0, "kv_vs_ideal": 2.3,
                  "leaf_bytes_per_agent": 40_000},
        "factored4": {"kl_recovered": 0.3, "ttft_speedup_vs_radix": 3.0, "kv_vs_ideal": 1.1,
                      "leaf_bytes_per_agent": 5_000},
        "factored16": {"kl_recovered": 0.35, "ttft_speedup_vs_radix": 1.5, "kv_vs_ideal": 1.1,
                       "leaf_bytes_per_agent": 9_000},
    }
    with_leaf_ratios(rows)
    assert rows["naive"]["leaf_bytes_ratio_vs_exact"] == float("inf")
    assert rows["exact"]["leaf_bytes_ratio_vs_exact"] == 1.0
    assert rows["factored4"]["leaf_bytes_ratio_vs_exact"] == 8.0
    # exact fails KV and leaves, factored16 fails TTFT: factored4 beats naive on KL
    assert pick(rows) == "factored4"
    assert not meets(rows["factored4"], TARGETS)  # its KL misses the 0.6 target
    assert meets(rows["factored4"], TARGETS, skip="kl_recovered")
    rows["factored4"]["kv_vs_ideal"] = None  # a missing figure fails
    assert pick(rows) == "naive"


def test_bad_arms_and_agent_counts_are_refused(capsys):
    for argv in (["--arms", "exact,bogus"], ["--agents", "1"], ["--agents", "17"],
                 ["--arms", ""]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "--arms of" in capsys.readouterr().err
    assert "exact" in ARMS and ARMS["factored4"] == ["--kvcmas-leaf-mode", "factored",
                                                     "--kvcmas-leaf-rank", "4"]


def test_a_factored_arm_counts_its_leaves_in_kv_and_is_judged_alone_over_them():
    panel = {"radix": panel_run(4.0, 3000),
             "factored8": panel_run(1.0, 1100, {"b": {"exact": 0, "factored": 6_400}}, 0.5)}
    panel["factored8"]["flags"] = ARMS["factored8"]
    panel["factored8"]["fidelity"] |= {"kl_recovered_turn": 0.9, "top1_turn": 1.0}
    row = arm_row(panel, "factored8", kv_bytes_per_token=640)
    assert row["kv_vs_ideal"] == pytest.approx((1100 + 6_400 / 640) / 1000)
    # the in-turn probe reads its picks exact: the factored arm is judged over its leaves
    assert (row["kl_recovered"], row["top1"]) == (0.5, 0.99)
    # where the reader was also probed over its leaves alone, every arm is judged so
    for name in ("factored8", "exact"):
        panel[name] = panel["factored8"] | {"flags": ARMS[name]}
        panel[name]["fidelity"] = panel["factored8"]["fidelity"] | {
            "kl_recovered_leaves": 0.7, "top1_leaves": 0.98, "kl20_leaves": 0.06}
        row = arm_row(panel, name, kv_bytes_per_token=640)
        assert (row["kl_recovered"], row["top1"], row["kl20_read"]) == (0.7, 0.98, 0.06)
    rows = with_leaf_ratios({"exact": {"leaf_bytes_per_agent": 8_000},
                             "exact_per_reader": {"leaf_bytes_per_agent": 40_000},
                             "factored8_per_reader": {"leaf_bytes_per_agent": 5_000}})
    f = rows["factored8_per_reader"]
    assert (f["leaf_bytes_ratio_vs_exact"], f["leaf_bytes_ratio_vs_same_picks"]) == (1.6, 8.0)


def test_a_saved_result_is_re_rendered_with_the_derived_columns(tmp_path):
    import json

    rewrite = frontier.rewrite

    arm = {"kl_recovered": 0.7, "kl_recovered_alone": 0.7, "top1": 0.99,
           "same_answer_as_radix": 0.5, "ttft_speedup_vs_radix": 3.0, "kv_vs_ideal": 1.2,
           "leaf_bytes_per_agent": 4_000, "computed_tokens": 10, "recomputed_tokens": 2,
           "makespan_s": 5.0}
    result = {"command": "x", "model": "m", "commit": "c", "machine": "cpu", "pool_tokens": 9,
              "answer_tokens": 3, "doc_tokens": 64, "seconds": 1.0, "by_agents": {"16": {
                  "arms": {"exact": dict(arm, leaf_bytes_per_agent=20_000),
                           "exact_per_reader": dict(arm, leaf_bytes_per_agent=32_000),
                           "factored8_per_reader": arm},
                  "radix_makespan_s": 9.0, "radix_computed_tokens": 90,
                  "one_copy_ideal_tokens": 10}}}
    path = tmp_path / "frontier_x.json"
    path.write_text(json.dumps(result))
    headline = rewrite(path)
    assert headline.startswith("HEADLINE agents=16 kl_recovered=0.700")
    text = (tmp_path / "frontier_x.txt").read_text()
    assert "factored8_per_reader" in text and " 8.00 " in text  # 32000 / 4000, same picks
    assert "by KL recovered: factored8_per_reader" in text  # 5x smaller than the defaults'
    saved = json.loads(path.read_text())["by_agents"]["16"]
    assert saved["best"] == "factored8_per_reader"


def test_arms_on_identical_prompts_are_judged_over_naive_pooled_across_them():
    """Each arm's naive KL comes from its own tree; pooled over the arms, KL recovered ranks
    them as their KL against the exact prefill does, and each arm's own figure stays."""
    rows = {"exact": {"kl20_read": 0.003, "kl20_turn": 0.003, "kl20": 0.002,
                      "kl20_naive": 0.005, "kl_recovered": 0.4, "flags": []},
            "factored8": {"kl20_turn": 0.0025, "kl20": 0.002, "kl20_naive": 0.015,
                          "kl_recovered": 0.87, "flags": ARMS["factored8"]}}
    with_pooled_kl(rows)
    e, f = rows["exact"], rows["factored8"]
    assert e["kl20_naive_pooled"] == pytest.approx(0.01)
    assert e["kl_recovered"] == pytest.approx(0.7) and e["kl_recovered_own"] == 0.4
    assert f["kl20_read"] == 0.002  # saved without it: a factored arm reads through its leaves
    assert f["kl_recovered"] == pytest.approx(0.8) and f["kl_recovered_own"] == 0.87
    assert f["kl_recovered_turn"] == pytest.approx(0.75)
    with_pooled_kl(rows)  # re-rendering keeps the own figures
    assert f["kl_recovered_own"] == 0.87


def test_the_default_arm_is_the_servers_defaults_and_exact_is_exact_leaves():
    from sglang_kvcmas.server.options import parse_launcher_args

    assert parse_launcher_args(ARMS[DEFAULT_ARM]).config == parse_launcher_args([]).config
    assert parse_launcher_args(ARMS[EXACT_ARM]).config.leaf_mode == "exact"


def test_agent_counts_whose_probes_read_nothing_approximate_are_named():
    def block(naive: float, probed: int = 8) -> dict:
        return {"arms": {"exact": {"probed": probed, "kl20_naive_pooled": naive},
                         "factored4": {"probed": probed, "kl20_naive_pooled": naive}}}

    # The 2026-12-07 run with the spare pass on served every probe exactly: KL20 about 1e-13.
    result = {"by_agents": {"3": block(0.0085), "16": block(2.6e-13), "8": block(0.0, probed=0)}}
    assert frontier.unread_probes(result) == [16]
