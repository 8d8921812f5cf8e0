"""Boundary recompute policy: which borrowed shared tokens a reader recomputes."""

from __future__ import annotations

import pytest

from sglang_kvcmas.policy.recompute import BorrowedSpan, RecomputeConfig, boundary_offsets


def test_first_tokens_of_each_foreign_span():
    spans = [BorrowedSpan(0, 40, True), BorrowedSpan(40, 50, False), BorrowedSpan(50, 53, True)]
    got = boundary_offsets(spans, RecomputeConfig(boundary_tokens=4, max_fraction=1.0))
    assert got == (0, 1, 2, 3, 50, 51, 52)  # own span skipped, short span taken whole


def test_budget_caps_recompute_and_zero_disables():
    spans = [BorrowedSpan(i * 10, i * 10 + 10, True) for i in range(5)]
    got = boundary_offsets(spans, RecomputeConfig(boundary_tokens=8, max_fraction=0.3))
    assert len(got) == 15 and got[:8] == tuple(range(8)) and got[8:] == tuple(range(10, 17))
    assert boundary_offsets(spans, RecomputeConfig(boundary_tokens=0)) == ()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        BorrowedSpan(5, 5, True)
    with pytest.raises(ValueError):
        RecomputeConfig(boundary_tokens=-1)
    with pytest.raises(ValueError):
        RecomputeConfig(max_fraction=1.5)
