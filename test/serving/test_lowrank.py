"""The served low-rank correction: the estimator, the frame it is fitted and applied in, the
backend's extend and decode against the naive reference over awkward sizes, and zero factors
reading bit for bit as today."""

from __future__ import annotations

import pytest
import torch
from sglang_kvcmas.attention.corrected_reads import (
    correct_rows,
    corrected_grouped_decode,
    gather_pairs,
    grouped_marked,
    reference_corrected_attention,
)
from sglang_kvcmas.attention.lowrank import (
    MAX_CHAIN_WEIGHT,
    MIN_PAIRS,
    CorrectionFit,
    Factors,
    LayerCorrection,
    LowRankCorrection,
    RowCorrection,
    chain_weight,
    fit_factors,
)
from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
from sglang_kvcmas.attention.span_reads import rotate_keys
from sglang_kvcmas.attention.spans import BatchRow, KeyShifts, RowSpans

ROPE = ShiftRope.full(rope_inv_freq(64, 1e5))


def _factors(hkv: int, d: int, r: int, scale: float = 0.1, seed: int = 0) -> Factors:
    g = torch.Generator().manual_seed(seed)
    return Factors(torch.randn(hkv, d, r, generator=g) * scale,
                   torch.randn(hkv, d, r, generator=g) * scale,
                   torch.randn(hkv, r, generator=g) * scale)


def _layer(hkv=2, d=64, r=3, seed=0) -> LayerCorrection:
    return LayerCorrection(_factors(hkv, d, r, seed=seed), _factors(hkv, d, r, seed=seed + 1))


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
    served turn has): the second turn's fit chained from the first recovers the map better
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


def test_a_fit_chains_from_its_priors_layer_and_counts_its_pairs():
    torch.manual_seed(4)
    p = 24
    x, y = torch.randn(p, 2, 64), torch.randn(p, 2, 64)
    prior_lc = LayerCorrection(_factors(2, 64, 3, seed=5), _factors(2, 64, 3, seed=6))
    prior = LowRankCorrection({0: prior_lc}, 3, pairs=48)
    fit = CorrectionFit(torch.arange(p), torch.zeros(p, dtype=torch.int64), torch.arange(p), 4,
                        prior=prior, chain=0.5)
    assert fit.prior_weight == 0.5 * 48 / p
    lc = fit.fit_layer(0, x, y, x, y)
    want_k = fit_factors(x, y, 4, prior=prior_lc.k, prior_weight=1.0)
    want_v = fit_factors(x, y, 4, prior=prior_lc.v, prior_weight=1.0)
    assert torch.equal(lc.k.b, want_k.b) and torch.equal(lc.v.a, want_v.a)
    assert not torch.equal(lc.k.b, fit_factors(x, y, 4).b)
    no_prior_layer = fit.fit_layer(1, x, y, x, y)  # the prior has no layer 1: per turn
    assert torch.equal(no_prior_layer.k.b, fit_factors(x, y, 4).b)
    assert fit.result().pairs == round(p * (1 + 1.0))


def test_query_and_output_side_equal_the_explicit_correction():
    torch.manual_seed(2)
    f = _factors(2, 64, 5)
    q, k, v = torch.randn(2, 3, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    qc, bias = f.query_side(q)
    explicit = torch.einsum("hgd,nhd->hgn", q, f.apply(k))
    torch.testing.assert_close(torch.einsum("hgd,nhd->hgn", qc, k) + bias[..., None], explicit,
                               atol=1e-5, rtol=1e-5)
    p = torch.softmax(torch.randn(2, 3, 7), -1) * 0.6  # part of the mass
    y = torch.einsum("hgn,nhd->hgd", p, v)
    torch.testing.assert_close(f.output_side(y, p.sum(-1)),
                               torch.einsum("hgn,nhd->hgd", p, f.apply(v)), atol=1e-5, rtol=1e-5)


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
    x = rotate_keys(stored, shifts, ROPE)  # what the reader reads today
    exact = true.apply(x)  # a reader whose keys deviate linearly in its own frame
    f = fit_factors(x[:200], exact[:200], rank=4)
    after = f.apply(x[200:])
    before = rotate_keys(f.apply(stored[200:]), KeyShifts.of_row(0, torch.full((100,), shift)),
                         ROPE)
    err_after = (after - exact[200:]).norm() / (x[200:] - exact[200:]).norm()
    err_before = (before - exact[200:]).norm() / (x[200:] - exact[200:]).norm()
    assert err_after < 0.15 and err_before > 3 * err_after, (err_after, err_before)


def _row_case(n_kv: int, own: int, runs: list[tuple[int, int]], seed: int):
    """A row: ``own`` own keys, then borrowed runs (length, shift), then own keys; a mask that
    corrects every borrowed key but one run's first two (an exact leaf) and includes a
    foreign run at shift 0."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.zeros(n_kv, dtype=torch.int64)
    mask = torch.zeros(n_kv, dtype=torch.bool)
    at = own
    for length, s in runs:
        shift[at : at + length] = s
        mask[at : at + length] = True
        at += length
    mask[own : own + 2] = False
    shift[own : own + 2] = 0  # the leaf: exact, read at shift 0
    m = at
    return shift, mask, m, g


@pytest.mark.parametrize("n_kv,h,hkv,runs", [
    (37, 6, 2, [(9, -7), (5, 0), (11, 13)]),
    (1 + 3 + 2, 4, 4, [(3, 5)]),
    (61, 9, 3, [(17, -30), (20, 4), (6, -30)]),
])
def test_decode_equals_the_reference_over_awkward_sizes(n_kv, h, hkv, runs):
    d = 64
    shift, mask, m, g = _row_case(n_kv, 1, runs, n_kv)
    q = torch.randn(1, h, d, generator=g)
    k, v = torch.randn(n_kv, hkv, d, generator=g), torch.randn(n_kv, hkv, d, generator=g)
    lc = _layer(hkv, d, 5, seed=n_kv)
    ref = reference_corrected_attention(q, k, v, torch.tensor([n_kv]), torch.arange(n_kv),
                                        shift, mask, ROPE, d**-0.5, lc)
    ks = KeyShifts.of_row(0, shift[:m])
    order, groups = grouped_marked(ks, mask[:m], n_kv)
    assert sorted(order.tolist()) == list(range(n_kv))
    out = corrected_grouped_decode(q[0][:, None], k[order].movedim(0, 1),
                                   v[order].movedim(0, 1), ks.shifts, groups, ROPE, d**-0.5, lc)
    torch.testing.assert_close(out[:, 0], ref[0], atol=2e-5, rtol=1e-4)
    for only in (LayerCorrection(lc.k, None), LayerCorrection(None, lc.v)):
        ref1 = reference_corrected_attention(q, k, v, torch.tensor([n_kv]), torch.arange(n_kv),
                                             shift, mask, ROPE, d**-0.5, only)
        out1 = corrected_grouped_decode(q[0][:, None], k[order].movedim(0, 1),
                                        v[order].movedim(0, 1), ks.shifts, groups, ROPE,
                                        d**-0.5, only)
        torch.testing.assert_close(out1[:, 0], ref1[0], atol=2e-5, rtol=1e-4)


def _backend():
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the math only; no model runner
    be.shift_rope, be._layer_id, be._groups, be._batch_rows = ROPE, 0, {}, None
    return be


def _pool(n_kv: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(160, hkv, d, generator=g), torch.randn(160, hkv, d, generator=g)
    req_to_token = torch.zeros(3, 128, dtype=torch.int64)
    req_to_token[2, :n_kv] = torch.randperm(160, generator=g)[:n_kv]
    return k_cache, v_cache, req_to_token, g

def _reads_of_row(row: RowSpans, q: torch.Tensor, qe: torch.Tensor, k_cache, v_cache,
                  req_to_token, n_kv: int) -> list[torch.Tensor]:
    """Pool row 2 read by the backend at layers 0 and 1: decode of ``q`` over its ``n_kv`` keys,
    then extend of ``qe`` as its last tokens."""
    d, n_q, res = q.shape[-1], qe.shape[0], []
    for layer in (0, 1):
        be = _backend()
        be._layer_id, be._batch_rows = layer, (BatchRow(row),)
        out = torch.empty_like(q)
        be._run_sdpa_forward_decode(q, out, k_cache, v_cache, req_to_token, torch.tensor([2]),
                                    torch.tensor([n_kv]), scaling=d**-0.5, enable_gqa=True)
        oute = torch.empty_like(qe)
        be._run_sdpa_forward_extend(qe, oute, k_cache, v_cache, req_to_token, torch.tensor([2]),
                                    torch.tensor([n_kv]), torch.tensor([n_kv - n_q]),
                                    torch.tensor([n_q]), scaling=d**-0.5, enable_gqa=True,
                                    causal=True)
        res += [out, oute]
    return res


@pytest.mark.parametrize("n_kv,h,hkv,runs", [
    (37, 6, 2, [(9, -7), (5, 0), (11, 13)]),
    (58, 9, 3, [(17, -30), (20, 4), (6, -30)]),
])
def test_backend_decode_and_extend_equal_the_reference(n_kv, h, hkv, runs):
    d = 64
    shift, mask, m, _ = _row_case(n_kv, 1, runs, n_kv)
    k_cache, v_cache, req_to_token, g = _pool(n_kv, hkv, d, n_kv)
    lc = _layer(hkv, d, 4, seed=n_kv)
    stored = LowRankCorrection({0: lc}, 4)
    row = RowSpans("r", KeyShifts.of_row(0, shift[:m]),
                   correction=RowCorrection(mask[:m], stored))
    slots = req_to_token[2, :n_kv]
    k, v = k_cache[slots], v_cache[slots]
    be = _backend()
    be._batch_rows = (None, BatchRow(row))
    req_to_token[0, :5] = torch.arange(5)

    q = torch.randn(2, h, d, generator=g)  # decode: row 0 plain (5 keys), row 1 corrected
    out = torch.empty_like(q)
    be._run_sdpa_forward_decode(q, out, k_cache, v_cache, req_to_token, torch.tensor([0, 2]),
                                torch.tensor([5, n_kv]), scaling=d**-0.5, enable_gqa=True)
    ref = reference_corrected_attention(q[1:], k, v, torch.tensor([n_kv]), torch.arange(n_kv),
                                        shift, mask, ROPE, d**-0.5, lc)
    torch.testing.assert_close(out[1:], ref, atol=2e-5, rtol=1e-4)
    assert (1, n_kv, True) in be._groups

    n_q = 6  # extend: the last 6 keys are the row's new tokens
    qe = torch.randn(n_q, h, d, generator=g)
    out = torch.empty_like(qe)
    be._batch_rows = (BatchRow(row),)
    be._run_sdpa_forward_extend(qe, out, k_cache, v_cache, req_to_token, torch.tensor([2]),
                                torch.tensor([n_kv]), torch.tensor([n_kv - n_q]),
                                torch.tensor([n_q]), scaling=d**-0.5, enable_gqa=True,
                                causal=True)
    ref = reference_corrected_attention(qe, k, v, torch.arange(n_kv - n_q, n_kv),
                                        torch.arange(n_kv), shift, mask, ROPE, d**-0.5, lc)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_zero_factors_read_bit_for_bit_as_today():
    n_kv, h, hkv, d = 37, 6, 2, 64
    shift, mask, m, _ = _row_case(n_kv, 1, [(9, -7), (5, 0), (11, 13)], 5)
    k_cache, v_cache, req_to_token, g = _pool(n_kv, hkv, d, 5)
    ks = KeyShifts.of_row(0, shift[:m])
    zero = RowCorrection(mask[:m], LowRankCorrection.zero(2, hkv, d))
    q, qe = torch.randn(1, h, d, generator=g), torch.randn(7, h, d, generator=g)
    outs = [_reads_of_row(RowSpans("r", ks, correction=corr), q, qe, k_cache, v_cache,
                          req_to_token, n_kv) for corr in (None, zero)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_extend_fits_each_layer_from_the_recomputed_pairs_and_reads_corrected():
    """A row whose recomputed tokens sit after its borrowed ones: the backend fits the layer's
    factors on (owner key re-positioned, exact key) of those tokens, then reads its borrowed
    keys through them; decode reads the same fit."""
    torch.manual_seed(7)
    h, hkv, d, shift = 6, 2, 64, -9
    own, n_borrowed, n_rec, n_new = 3, 30, 90, 4
    n_kv = own + n_borrowed + n_rec + n_new
    true = _layer(hkv, d, 3, seed=11)
    k_cache, v_cache = torch.zeros(400, hkv, d), torch.zeros(400, hkv, d)
    slots = torch.randperm(400)[:n_kv]
    owner_slots = torch.tensor([s for s in range(400) if s not in set(slots.tolist())][:n_rec])
    pos = torch.arange(n_kv)
    raw_k, raw_v = torch.randn(n_kv, hkv, d), torch.randn(n_kv, hkv, d)
    rows = slice(own, own + n_borrowed)  # borrowed: stored at the owner's positions
    k_cache[slots[rows]] = apply_rope(raw_k[rows], pos[rows] - shift, ROPE)
    v_cache[slots[rows]] = raw_v[rows]
    rec = slice(own + n_borrowed, own + n_borrowed + n_rec)
    owner_k = apply_rope(raw_k[rec], pos[rec] - shift, ROPE)
    k_cache[owner_slots], v_cache[owner_slots] = owner_k, raw_v[rec]
    # the reader's exact KV of the recomputed tokens: the true map of the re-positioned owner's
    k_cache[slots[rec]] = true.k.apply(apply_rope(raw_k[rec], pos[rec], ROPE))
    v_cache[slots[rec]] = true.v.apply(raw_v[rec])
    k_cache[slots[:own]] = apply_rope(raw_k[:own], pos[:own], ROPE)
    k_cache[slots[-n_new:]] = apply_rope(raw_k[-n_new:], pos[-n_new:], ROPE)
    req_to_token = torch.zeros(1, 128, dtype=torch.int64)
    req_to_token[0, :n_kv] = slots
    m = own + n_borrowed
    shifts = torch.cat([torch.zeros(own, dtype=torch.int64), torch.full((n_borrowed,), shift)])
    mask = torch.cat([torch.zeros(own, dtype=torch.bool), torch.ones(n_borrowed, dtype=torch.bool)])
    fit = CorrectionFit(owner_slots, torch.full((n_rec,), shift), torch.arange(rec.start,
                        rec.stop), rank=3)
    assert fit.fits
    row = RowSpans("r", KeyShifts.of_row(0, shifts), correction=RowCorrection(mask, None, fit))
    be = _backend()
    be._batch_rows = (BatchRow(row),)
    qe = torch.randn(n_rec + n_new, h, d)
    out = torch.empty_like(qe)
    be._run_sdpa_forward_extend(qe, out, k_cache, v_cache, req_to_token, torch.tensor([0]),
                                torch.tensor([n_kv]), torch.tensor([m]),
                                torch.tensor([n_rec + n_new]), scaling=d**-0.5,
                                enable_gqa=True, causal=True)
    lc = fit.layers[0]
    want = LayerCorrection(*(fit_factors(*pair, rank=3) for pair in (
        gather_pairs(k_cache, v_cache, slots, fit, ROPE)[:2],
        gather_pairs(k_cache, v_cache, slots, fit, ROPE)[2:])))
    for got, ref in ((lc.k, want.k), (lc.v, want.v)):
        torch.testing.assert_close(got.a @ got.b.transpose(1, 2), ref.a @ ref.b.transpose(1, 2))
    full_shift = torch.cat([shifts, torch.zeros(n_kv - m, dtype=torch.int64)])
    full_mask = torch.cat([mask, torch.zeros(n_kv - m, dtype=torch.bool)])
    ref = reference_corrected_attention(qe, k_cache[slots], v_cache[slots],
                                        torch.arange(m, n_kv), pos, full_shift, full_mask, ROPE,
                                        d**-0.5, lc)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # the fitted map moves the borrowed keys toward the reader's exact ones
    x = correct_rows(apply_rope(raw_k[own:m], pos[own:m], ROPE), raw_v[own:m],
                     torch.ones(n_borrowed, dtype=torch.bool), lc)[0]
    exact = true.k.apply(apply_rope(raw_k[own:m], pos[own:m], ROPE))
    assert (x - exact).norm() < 0.5 * (apply_rope(raw_k[own:m], pos[own:m], ROPE) - exact).norm()
    assert fit.result().pairs == n_rec and fit.result().nbytes() == lc.nbytes()


def test_row_correction_accounting_flag():
    mask = torch.tensor([False, True, True])
    assert not RowCorrection(mask).corrects
    assert not RowCorrection(mask, LowRankCorrection.zero(2, 2, 64)).corrects
    assert RowCorrection(mask, LowRankCorrection({0: _layer()}, 3)).corrects
    assert not RowCorrection(torch.zeros(3, dtype=torch.bool),
                             LowRankCorrection({0: _layer()}, 3)).corrects
    few = CorrectionFit(torch.arange(3), torch.zeros(3, dtype=torch.int64), torch.arange(3), 4)
    assert not RowCorrection(mask, None, few).corrects
