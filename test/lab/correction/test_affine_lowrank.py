"""The affine low-rank correction the lab studies fit (``correction/affine_lowrank.py``): the
estimator, its held-out shrink, chaining from a prior, and the frame it is fitted and applied
in."""

from __future__ import annotations

import torch
from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
from sglang_kvcmas.attention.span_reads import rotate_keys
from sglang_kvcmas.attention.spans import KeyShifts

from sglang_kvcmas_lab.correction.affine_lowrank import (
    MAX_CHAIN_WEIGHT,
    MIN_PAIRS,
    Factors,
    chain_weight,
    fit_factors,
)

ROPE = ShiftRope.full(rope_inv_freq(64, 1e5))


def _factors(hkv: int, d: int, r: int, scale: float = 0.1, seed: int = 0) -> Factors:
    g = torch.Generator().manual_seed(seed)
    return Factors(torch.randn(hkv, d, r, generator=g) * scale,
                   torch.randn(hkv, d, r, generator=g) * scale,
                   torch.randn(hkv, r, generator=g) * scale)


def test_fit_recovers_a_planted_affine_low_rank_map():
    torch.manual_seed(0)
    true = _factors(3, 64, 4, scale=0.3)
    x = torch.randn(400, 3, 64)
    y = true.apply(x) + 1e-3 * torch.randn(400, 3, 64)
    f = fit_factors(x[:300], y[:300], rank=4)
    err = (f.apply(x[300:]) - y[300:]).norm() / (x[300:] - y[300:]).norm()
    assert f.rank == 4 and err < 0.1  # held-out: 90%+ of the deviation recovered
    assert fit_factors(x[: MIN_PAIRS - 1], y[: MIN_PAIRS - 1], rank=4) is None


def test_fit_of_noise_is_shrunk_towards_no_correction():
    torch.manual_seed(1)
    x = torch.randn(40, 2, 64)
    y = x + 0.5 * torch.randn(40, 2, 64)  # a deviation unrelated to x: nothing to learn
    f = fit_factors(x, y, rank=8)
    held = torch.randn(200, 2, 64)
    # the held-out shrink keeps the map from moving unseen tokens much (noise: 0.5 per dim)
    moved = (f.apply(held) - held).norm() / held.norm()
    unshrunk = fit_factors(x, y, rank=8, shrink=False)
    assert moved < 0.1 and moved < 0.5 * (unshrunk.apply(held) - held).norm() / held.norm()


def test_chain_weight_counts_the_prior_pairs_discounted_and_capped():
    assert chain_weight(40, 40, 1.0) == 1.0 and chain_weight(40, 40, 0.5) == 0.5
    assert chain_weight(1000, 20, 1.0) == MAX_CHAIN_WEIGHT  # a long history never freezes it
    assert chain_weight(40, 40, 0.0) == chain_weight(0, 40, 1.0) == 0.0


def test_a_chained_fit_with_zero_weight_is_the_per_turn_fit_bit_for_bit():
    torch.manual_seed(2)
    x = torch.randn(50, 2, 64)
    y = _factors(2, 64, 3, scale=0.3).apply(x) + 0.05 * torch.randn(50, 2, 64)
    alone = fit_factors(x, y, rank=4)
    same = fit_factors(x, y, rank=4, prior=_factors(2, 64, 5, seed=9), prior_weight=0.0)
    for t, u in ((alone.a, same.a), (alone.b, same.b), (alone.c, same.c)):
        assert torch.equal(t, u)


def test_chaining_carries_the_evidence_of_earlier_turns():
    """Two turns of noisy pairs of one planted map, fewer pairs than input directions (as a
    served turn had): the second turn's fit chained from the first recovers the map better
    than the second turn alone, not better than both turns pooled (the ceiling; chaining stores
    only the factors), and the prior's dense map is [A; c]·Bᵀ."""
    torch.manual_seed(3)
    true = _factors(3, 64, 4, scale=0.3)
    scale = torch.linspace(0.2, 2.0, 64)  # K/V coordinates differ in scale

    def turn(n):
        x = torch.randn(n, 3, 64) * scale
        return x, true.apply(x) + 0.3 * torch.randn(n, 3, 64)

    (x1, y1), (x2, y2), (xt, yt) = turn(40), turn(40), turn(500)

    def err(f):
        return float((f.apply(xt) - yt).norm() / (xt - yt).norm())

    first = fit_factors(x1, y1, rank=4)
    alone = fit_factors(x2, y2, rank=4)
    chained = fit_factors(x2, y2, rank=4, prior=first, prior_weight=chain_weight(40, 40, 1.0))
    pooled = fit_factors(torch.cat([x1, x2]), torch.cat([y1, y2]), rank=4)
    assert err(chained) < min(err(alone), err(first)) - 0.05
    assert err(pooled) < err(chained)
    w = first.dense()
    z = torch.cat([xt[:7], torch.ones(7, 3, 1)], dim=2).double()
    assert torch.allclose(xt[:7].double() + torch.einsum("nhd,hde->nhe", z, w),
                          first.apply(xt[:7]).double(), atol=1e-4)


def test_the_map_is_applied_in_the_readers_frame_after_the_shift():
    """Fitted on pairs (owner key re-positioned, reader's exact key), the map recovers the
    reader's keys applied after the shift; before the shift (the owner's frame) it does not:
    R(δ) does not commute with A·Bᵀ."""
    torch.manual_seed(3)
    true = _factors(2, 64, 4, scale=0.3)
    raw = torch.randn(300, 2, 64)
    owner_pos, shift = torch.arange(300) + 40, -25
    stored = apply_rope(raw, owner_pos, ROPE)  # the pool: keys at the owner's positions
    shifts = KeyShifts.of_row(0, torch.full((300,), shift))
    x = rotate_keys(stored, shifts, ROPE)  # what the reader reads re-positioned
    exact = true.apply(x)  # a reader whose keys deviate linearly in its own frame
    f = fit_factors(x[:200], exact[:200], rank=4)
    after = f.apply(x[200:])
    before = rotate_keys(f.apply(stored[200:]), KeyShifts.of_row(0, torch.full((100,), shift)),
                         ROPE)
    err_after = (after - exact[200:]).norm() / (x[200:] - exact[200:]).norm()
    err_before = (before - exact[200:]).norm() / (x[200:] - exact[200:]).norm()
    assert err_after < 0.15 and err_before > 3 * err_after, (err_after, err_before)
