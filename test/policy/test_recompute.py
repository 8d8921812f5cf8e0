"""Boundary recompute policy: which borrowed shared tokens a reader recomputes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sglang_kvcmas.policy.recompute import (
    BorrowedSpan,
    RecomputeConfig,
    boundary_offsets,
    mass_offsets,
    message_starts,
    split_spans,
)


def test_first_tokens_of_each_foreign_span():
    spans = [BorrowedSpan(0, 40, True), BorrowedSpan(40, 50, False), BorrowedSpan(50, 53, True)]
    got = boundary_offsets(spans, RecomputeConfig(boundary_tokens=4, max_fraction=1.0))
    assert got == (0, 1, 2, 3, 50, 51, 52)  # own span skipped, short span taken whole


def _naive_message_starts(ids: list[int], close: list[int]) -> list[int]:
    return [i + len(close) for i in range(len(ids) - len(close) + 1)
            if ids[i : i + len(close)] == close]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 64])
def test_message_starts_match_a_plain_scan(n):
    rng = random.Random(n)
    ids = [rng.choice([2, 7, 9, 10]) for _ in range(n)]
    for close in ([2, 10], [2], [2, 10, 2]):
        assert message_starts(ids, close).tolist() == _naive_message_starts(ids, close)
    with pytest.raises(ValueError):
        message_starts(ids, [])


def test_spans_are_cut_at_message_starts_inside_them():
    spans = [BorrowedSpan(0, 40, True, 3, "c"), BorrowedSpan(40, 50, False),
             BorrowedSpan(50, 60, True)]
    got = split_spans(spans, [55, 0, 12, 40, 30, 12, 60, 70])
    assert [(s.begin, s.end, s.foreign) for s in got] == [
        (0, 12, True), (12, 30, True), (30, 40, True), (40, 50, False), (50, 55, True),
        (55, 60, True)]
    assert got[1].shift == 3 and got[1].owner == "c"
    assert split_spans(spans, []) == spans
    picks = boundary_offsets(got, RecomputeConfig(boundary_tokens=2, max_fraction=1.0))
    assert picks == (0, 1, 12, 13, 30, 31, 50, 51, 55, 56)


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


def test_mass_offsets_add_the_largest_owner_head_mass_within_budget():
    from sglang_kvcmas.policy.recompute import mass_offsets

    cand = [10, 11, 12, 13, 14, 15]
    mass = [0.1, 0.9, 0.0, 0.5, 0.7, 0.2]
    cfg = RecomputeConfig(boundary_tokens=0, mass_fraction=0.3, max_fraction=1.0)
    assert mass_offsets(cand, mass, (), (0, 1), 10, cfg) == (0, 1, 11, 13, 14)  # top 3 of 10
    capped = RecomputeConfig(mass_fraction=0.3, max_fraction=0.4)
    assert mass_offsets(cand, mass, (), (0, 1), 10, capped) == (0, 1, 11, 14)  # 4 in all
    assert mass_offsets(cand, [0.0] * 6, (), (), 10, cfg) == ()  # no signal, nothing added
    with pytest.raises(ValueError):
        mass_offsets(cand, mass[:2], (), (), 10, cfg)


def test_mass_offsets_count_what_the_reader_already_holds_exactly():
    """The top share is taken over exact and deviating tokens alike: tokens the reader's delta
    leaves hold use up their place in it, so only new top tokens are recomputed."""
    from sglang_kvcmas.policy.recompute import mass_offsets

    cand = [10, 11, 12, 13, 14, 15]
    mass = [0.1, 0.9, 0.0, 0.5, 0.7, 0.2]
    cfg = RecomputeConfig(boundary_tokens=0, mass_fraction=0.3, max_fraction=1.0)
    assert mass_offsets(cand, mass, {11, 14}, (), 10, cfg) == (13,)


def test_segment_share_is_split_among_the_readers_that_waited_together():
    """Two readers keep the mass share (0.2 / 2 = 0.1); fifteen take 0.2 / 15 each, so what
    the readers of one segment hold of their own stays about a fifth of it; unset: the share."""
    base = RecomputeConfig(boundary_tokens=0, mass_fraction=0.1, segment_share=0.2,
                           max_fraction=1.0)
    assert base.readers == 1 and base.with_readers(1) is base
    wide = replace(base, mass_fraction=0.3)  # one reader alone keeps its mass share
    assert wide.mass_tokens(1000) == 300 and wide.with_readers(2).mass_tokens(1000) == 100
    assert base.with_readers(2).mass_tokens(1000) == 100 == base.mass_tokens(1000)
    assert base.with_readers(15).mass_tokens(1000) == 13
    assert base.with_readers(15).reader_mass_fraction == pytest.approx(0.2 / 15)
    assert replace(base, segment_share=None).with_readers(15).mass_tokens(1000) == 100
    cand = list(range(1000))
    mass = [(i * 7919 % 1000) / 1000 for i in cand]
    top13 = sorted(sorted(cand, key=lambda i: -mass[i])[:13])
    assert mass_offsets(cand, mass, (), (), 1000, base.with_readers(15)) == tuple(top13)
    for bad in ({"segment_share": 1.5}, {"segment_share": -0.1}, {"readers": 0}):
        with pytest.raises(ValueError):
            RecomputeConfig(**bad)


def test_borrow_pays_only_from_min_borrowed_foreign_tokens():
    from sglang_kvcmas.policy.recompute import borrow_pays

    cfg = RecomputeConfig(min_borrowed=256)
    assert not borrow_pays(255, cfg) and borrow_pays(256, cfg)
    assert borrow_pays(1, RecomputeConfig(min_borrowed=0))
    with pytest.raises(ValueError):
        RecomputeConfig(min_borrowed=-1)


def test_tail_takes_the_last_foreign_tokens_across_spans():
    from sglang_kvcmas.policy.recompute import tail_offsets

    spans = [BorrowedSpan(0, 10, True), BorrowedSpan(10, 13, False), BorrowedSpan(13, 16, True)]
    cfg = RecomputeConfig(tail_tokens=5, max_fraction=1.0)
    assert tail_offsets(spans, cfg) == (8, 9, 13, 14, 15)  # the exact span in between is skipped
    assert tail_offsets(spans, RecomputeConfig(tail_tokens=0)) == ()
    capped = RecomputeConfig(tail_tokens=50, max_fraction=0.25)  # 4 of 16 borrowed tokens
    assert tail_offsets(spans, capped) == (9, 13, 14, 15)


def test_the_served_cap_rises_to_a_larger_mass_share_asked():
    """The deployment's recompute cap is ``MAX_FRACTION``; a request asking a larger mass share
    (every token: 1.0) gets that share as its cap."""
    from sglang_kvcmas.config import ServingConfig
    from sglang_kvcmas.policy.recompute import MAX_FRACTION

    assert RecomputeConfig.from_serving(ServingConfig()).max_fraction == MAX_FRACTION
    every = RecomputeConfig.from_serving(ServingConfig(), recompute_mass_fraction=1.0)
    assert every.max_fraction == 1.0 and every.mass_tokens(40) == 40
