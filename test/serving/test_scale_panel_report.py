"""The panel report of ``benchmark/serving/scale.py`` over made-up turns (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.serving.scale import nonowner_ttft, parse_variants, same_answers  # noqa: E402


def turns(texts: dict[tuple[int, int], str], ttft: float, borrowed: int = 0) -> list[dict]:
    return [{"round": r, "agent": a, "text": t, "ttft": ttft,
             "borrowed": borrowed if r and a else 0} for (r, a), t in texts.items()]


def test_variants_parse_and_bad_ones_are_refused():
    assert parse_variants("") == {}
    assert parse_variants("cap64=--kvcmas-recompute-mass-max-tokens 64; b0=--x") == {
        "cap64": ["--kvcmas-recompute-mass-max-tokens", "64"], "b0": ["--x"]}
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
