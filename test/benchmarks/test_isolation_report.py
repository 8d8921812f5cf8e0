"""The isolation benchmark's figures from its runs' turns (no server): a leak is seen."""

from __future__ import annotations

import pytest
from helpers.bench_scripts import load_script

iso = load_script("benchmark/serving/isolation.py")


def turns(reuse: list[tuple[int, int]], seconds: list[float]) -> list[dict]:
    """Two workflows of two turns each; ``reuse``: (cached, borrowed) a turn."""
    return [{"workflow": f"debate-{i // 2}", "step": 0, "agent": "ab"[i % 2], "ids": [i],
             "cached": c, "borrowed": b, "seconds": s}
            for i, ((c, b), s) in enumerate(zip(reuse, seconds))]


FORGED = {"reserved_salt_status": 400, "unknown_key_status": 401, "forged_header_turns": 4}


def test_the_same_reuse_in_both_tenants_is_no_leak():
    first = turns([(0, 0), (10, 40), (0, 0), (10, 30)], [2.0, 1.0, 4.0, 1.0])
    second = turns([(0, 0), (10, 40), (0, 0), (10, 30)], [2.2, 1.0, 4.0, 1.0])
    ref = turns([(0, 0), (10, 40), (0, 0), (10, 40)], [1, 1, 1, 1])
    out = iso.summarize(ref, first, second, [0.5, 1.0], FORGED)
    assert out["cross_tenant_reused_tokens"] == 0 and out["forged_salt_rejected"] == 1
    assert out["within_tenant_sharing_ratio"] == pytest.approx(70 / 80)
    assert out["timing_probe"]["second_over_first"] == pytest.approx((1.1 + 1.0) / 2)
    assert out["timing_probe"]["repeat_over_first"] == pytest.approx((0.25 + 0.25) / 2)


def test_reuse_beyond_the_first_tenants_is_counted_and_fails_the_check():
    first = turns([(0, 0), (10, 40), (0, 0), (10, 30)], [2.0, 1.0, 4.0, 1.0])
    leaked = turns([(300, 0), (10, 40), (0, 0), (10, 35)], [0.4, 1.0, 4.0, 1.0])
    out = iso.summarize(first, first, leaked, [0.5, 1.0], FORGED)
    assert out["cross_tenant_reused_tokens"] == 305 and out["forged_salt_rejected"] == 0
    accepted = iso.summarize(first, first, first, [0.5, 1.0],
                             {**FORGED, "reserved_salt_status": 200})
    assert accepted["forged_salt_rejected"] == 0
    with pytest.raises(AssertionError, match="prompts differ"):
        iso.summarize(first, first, turns([(0, 0)] * 3, [1.0] * 3) + [{**first[3], "ids": [9]}],
                      [0.5, 1.0], FORGED)
