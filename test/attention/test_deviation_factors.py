"""Factored leaves (leaf mode ``factored``): the truncated SVD of a deviation, the stored factors
and their bytes, the backend's extend and decode through them against the naive reference over
awkward sizes, zero factors reading bit for bit as today, and the extend's factoring of the pairs
its recomputed tokens give."""

from __future__ import annotations

import pytest
import torch
from sglang_kvcmas.attention.deviation_factors import (
    FactorBasis,
    LeafFactorFit,
    LeafReads,
    RowLeaves,
    TokenFactors,
    factor_deviation,
    factor_deviation_reference,
    reference_leaf_attention,
)
from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
from sglang_kvcmas.attention.span_reads import gather_pairs
from sglang_kvcmas.attention.spans import BatchRow, KeyShifts, RowSpans

ROPE = ShiftRope.full(rope_inv_freq(64, 1e5))


def _factors(layers: int, m: int, hkv: int, d: int, r: int, seed: int,
             scale: float = 0.3) -> TokenFactors:
    g = torch.Generator().manual_seed(seed)
    basis = FactorBasis(torch.linalg.qr(torch.randn(layers, hkv, d, r, generator=g))[0],
                        torch.linalg.qr(torch.randn(layers, hkv, d, r, generator=g))[0], m)
    return TokenFactors(torch.randn(layers, m, hkv, r, generator=g) * scale,
                        torch.randn(layers, m, hkv, r, generator=g) * scale, basis)


@pytest.mark.parametrize("p,hkv,d,rank", [(40, 2, 64, 8), (5, 3, 16, 8), (1, 1, 8, 4),
                                          (64, 2, 64, 4), (130, 3, 64, 4), (7, 2, 64, 16)])
def test_factor_deviation_is_the_best_rank_r_approximation(p, hkv, d, rank):
    g = torch.Generator().manual_seed(p)
    dev = torch.randn(p, hkv, d, generator=g)
    coef, basis = factor_deviation(dev, rank)
    assert coef.shape == (p, hkv, rank) and basis.shape == (hkv, d, rank)
    got = torch.einsum("phr,hdr->phd", coef, basis)
    for h in range(hkv):
        u, s, vh = torch.linalg.svd(dev[:, h].double(), full_matrices=False)
        r = min(rank, s.shape[0])
        want = (u[:, :r] * s[:r]) @ vh[:r]
        torch.testing.assert_close(got[:, h].double(), want, atol=1e-5, rtol=1e-5)
    if min(p, d) <= rank:  # the whole deviation fits: exact
        torch.testing.assert_close(got, dev, atol=1e-5, rtol=1e-5)
    assert factor_deviation(torch.zeros(0, hkv, d), rank)[0].shape == (0, hkv, rank)
    ref = torch.einsum("phr,hdr->phd", *factor_deviation_reference(dev, rank))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    _, basis_ref = factor_deviation_reference(dev, rank)
    # The same subspace: the columns span what the SVD's do (the same projector).
    torch.testing.assert_close(basis @ basis.transpose(1, 2),
                               basis_ref @ basis_ref.transpose(1, 2), atol=1e-4, rtol=1e-4)


def test_factor_deviation_of_a_rank_deficient_deviation():
    dev = torch.zeros(3, 1, 8)
    dev[:, 0, 0] = torch.tensor([1.0, 2.0, 3.0])  # rank 1, p < d
    coef, basis = factor_deviation(dev, 4)
    assert torch.isfinite(coef).all() and torch.isfinite(basis).all()
    torch.testing.assert_close(torch.einsum("phr,hdr->phd", coef, basis), dev)


def test_token_factors_select_and_count_their_share_of_the_basis():
    f = _factors(3, 10, 2, 16, 4, seed=1)
    coef_bytes = 2 * 3 * 10 * 2 * 4 * 4
    assert f.nbytes() == coef_bytes + f.basis.nbytes()
    a, b = f.select(torch.arange(4)), f.select(torch.arange(4, 10))
    assert a.basis is f.basis and len(a) == 4 and len(b) == 6
    assert a.nbytes() + b.nbytes() in (f.nbytes(), f.nbytes() + 1)  # rounded up per part
    dk, dv = f.deviations(2)
    torch.testing.assert_close(dk[3], torch.einsum("hr,hdr->hd", f.k[2, 3], f.basis.k[2]))
    torch.testing.assert_close(dv[3], torch.einsum("hr,hdr->hd", f.v[2, 3], f.basis.v[2]))
    with pytest.raises(ValueError):
        TokenFactors(f.k, f.v[:, :3], f.basis)


def test_a_fit_stacks_every_layer_and_keeps_nothing_unless_each_was_fitted():
    p, hkv, d = 12, 2, 16
    fit = LeafFactorFit(torch.arange(p), torch.zeros(p, dtype=torch.int64), torch.arange(p),
                        torch.arange(p), torch.arange(p) + 40, rank=4)
    x = torch.randn(p, hkv, d)
    rope = ShiftRope.full(rope_inv_freq(d, 1e4))
    ones = torch.ones(p, hkv, d)
    fit.fit_layer(1, x, x + apply_rope(ones, fit.positions, rope), x, x, rope)  # rank 1 pre-RoPE
    assert fit.result() is None  # layer 0 missing
    fit.fit_layer(0, x, x, x, x - 2, rope)
    res = fit.result()
    assert res.k.shape == (2, p, hkv, 4) and res.basis.tokens == p
    dk, dv = res.deviations(1)  # keys before RoPE: the deviation rotated back from its position
    torch.testing.assert_close(dk, ones, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.deviations(0)[1], torch.full((p, hkv, d), -2.0), atol=1e-5,
                               rtol=1e-5)
    assert not LeafFactorFit(torch.empty(0, dtype=torch.int64), torch.empty(0), torch.empty(0),
                             torch.empty(0), torch.empty(0), 4).fits


def _row_case(n_kv: int, own: int, runs: list[tuple[int, int]], seed: int):
    """A row: ``own`` own keys, then borrowed runs (length, shift), then own keys; the first two
    borrowed keys an exact leaf (read at shift 0); a foreign run at shift 0 among them."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.zeros(n_kv, dtype=torch.int64)
    at = own
    for length, s in runs:
        shift[at : at + length] = s
        at += length
    shift[own : own + 2] = 0  # the leaf: exact, read at shift 0
    return shift, at, g


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


def _leaf_reads(rows_a: list[int], rows_b: list[int], hkv: int, d: int, seed: int) -> LeafReads:
    """Two parts (two fits, two bases) over the given row indices, every layer 0..1."""
    return LeafReads([(torch.tensor(rows_a), torch.tensor(rows_a) + 3,
                       _factors(2, len(rows_a), hkv, d, 4, seed)),
                      (torch.tensor(rows_b), torch.tensor(rows_b) * 2,
                       _factors(2, len(rows_b), hkv, d, 6, seed + 1))])


@pytest.mark.parametrize("n_kv,h,hkv,runs", [
    (37, 6, 2, [(9, -7), (5, 0), (11, 13)]),
    (58, 9, 3, [(17, -30), (20, 4), (6, -30)]),
])
def test_backend_decode_and_extend_read_factored_leaves_as_the_reference(n_kv, h, hkv, runs):
    d = 64
    shift, m, _ = _row_case(n_kv, 1, runs, n_kv)
    k_cache, v_cache, req_to_token, g = _pool(n_kv, hkv, d, n_kv)
    leaves = _leaf_reads([3, 4, m - 1], [5, 9, 10, 11], hkv, d, seed=n_kv)
    row = RowSpans("r", KeyShifts.of_row(0, shift[:m]), leaves=RowLeaves(leaves))
    tokens = leaves.layer(0)
    slots = req_to_token[2, :n_kv]
    k, v = k_cache[slots], v_cache[slots]
    be = _backend()
    be._batch_rows = (None, BatchRow(row))
    req_to_token[0, :5] = torch.arange(5)

    q = torch.randn(2, h, d, generator=g)  # decode: row 0 plain (5 keys), row 1 factored
    out = torch.empty_like(q)
    be._run_sdpa_forward_decode(q, out, k_cache, v_cache, req_to_token, torch.tensor([0, 2]),
                                torch.tensor([5, n_kv]), scaling=d**-0.5, enable_gqa=True)
    ref = reference_leaf_attention(q[1:], k, v, torch.tensor([n_kv]), torch.arange(n_kv), shift,
                                   ROPE, d**-0.5, tokens)
    torch.testing.assert_close(out[1:], ref, atol=2e-5, rtol=1e-4)
    plain = reference_leaf_attention(q[1:], k, v, torch.tensor([n_kv]), torch.arange(n_kv),
                                     shift, ROPE, d**-0.5, None)
    assert (out[1:] - plain).abs().max() > 1e-3  # the deviations are read

    n_q = 6  # extend: the last 6 keys are the row's new tokens
    qe = torch.randn(n_q, h, d, generator=g)
    out = torch.empty_like(qe)
    be._batch_rows = (BatchRow(row),)
    be._run_sdpa_forward_extend(qe, out, k_cache, v_cache, req_to_token, torch.tensor([2]),
                                torch.tensor([n_kv]), torch.tensor([n_kv - n_q]),
                                torch.tensor([n_q]), scaling=d**-0.5, enable_gqa=True,
                                causal=True)
    ref = reference_leaf_attention(qe, k, v, torch.arange(n_kv - n_q, n_kv), torch.arange(n_kv),
                                   shift, ROPE, d**-0.5, tokens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_zero_factors_read_bit_for_bit_as_today():
    n_kv, h, hkv, d = 37, 6, 2, 64
    shift, m, _ = _row_case(n_kv, 1, [(9, -7), (5, 0), (11, 13)], 5)
    k_cache, v_cache, req_to_token, g = _pool(n_kv, hkv, d, 5)
    ks = KeyShifts.of_row(0, shift[:m])
    f = _factors(2, 3, hkv, d, 4, seed=3, scale=0.0)
    zero = RowLeaves(LeafReads([(torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5]), f)]))
    q, qe = torch.randn(1, h, d, generator=g), torch.randn(7, h, d, generator=g)
    outs = [_reads_of_row(RowSpans("r", ks, leaves=leaves), q, qe, k_cache, v_cache,
                          req_to_token, n_kv) for leaves in (None, zero)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_extend_factors_the_kept_recomputed_pairs_and_reads_them_exact():
    """The extend that recomputes the tokens factors each layer's deviation (exact key and
    value minus the owner's re-positioned ones) and reads nothing differently itself."""
    torch.manual_seed(3)
    h, hkv, d, shift, rank = 4, 2, 64, -9, 8
    own, n_rec, n_new = 5, 20, 3
    n_kv = own + n_rec + n_new
    k_cache, v_cache = torch.randn(200, hkv, d), torch.randn(200, hkv, d)
    slots = torch.randperm(200)[:n_kv]
    owner_slots = torch.tensor([s for s in range(200) if s not in set(slots.tolist())][:n_rec])
    req_to_token = torch.zeros(1, 64, dtype=torch.int64)
    req_to_token[0, :n_kv] = slots
    rows = torch.arange(own, own + n_rec)
    fit = LeafFactorFit(owner_slots, torch.full((n_rec,), shift), rows, rows + 100, rows, rank)
    row = RowSpans("r", KeyShifts.of_row(0, torch.zeros(own, dtype=torch.int64)),
                   leaves=RowLeaves(factor=fit))
    be = _backend()
    qe = torch.randn(n_rec + n_new, h, d)
    outs = []
    for r in (row, RowSpans("r", row.key_shifts)):
        be._batch_rows, be._groups = (BatchRow(r),), {}
        out = torch.empty_like(qe)
        be._run_sdpa_forward_extend(qe, out, k_cache, v_cache, req_to_token, torch.tensor([0]),
                                    torch.tensor([n_kv]), torch.tensor([own]),
                                    torch.tensor([n_rec + n_new]), scaling=d**-0.5,
                                    enable_gqa=True, causal=True)
        outs.append(out)
    assert torch.equal(*outs)
    x_k, y_k, x_v, y_v = gather_pairs(k_cache, v_cache, slots, fit, ROPE)
    dk, dv = fit.result().deviations(0)
    for got, dev in ((dk, apply_rope(y_k - x_k, -rows, ROPE)), (dv, y_v - x_v)):
        want = torch.einsum("phr,hdr->phd", *factor_deviation(dev, rank))
        torch.testing.assert_close(got, want)
        assert (got - dev).norm() < dev.norm()  # rank 8 of 20 tokens: part of it, the best part


def test_materialized_deviations_are_counted_while_their_row_lives():
    """A row's deviations are expanded once per layer and kept; the process-wide count holds
    their bytes while the row lives and gives them back when it goes."""
    import gc

    from sglang_kvcmas.attention.deviation_factors import LeafReads, MaterializedBytes

    f = _factors(layers=3, m=5, hkv=2, d=8, r=2, seed=3)
    before = MaterializedBytes.now
    reads = LeafReads([(torch.arange(5), torch.arange(5), f)])
    first = reads.layer(1)
    assert reads.layer(1) is first  # kept, not expanded again
    reads.layer(0)
    held = 2 * (2 * 5 * 2 * 8 * 4)  # two layers of K and V, [5, 2, 8] float32 each
    assert reads.materialized_nbytes() == held == MaterializedBytes.now - before
    assert MaterializedBytes.peak >= MaterializedBytes.now
    shift, rope, cpu = torch.tensor([0, 3, 3, -2, 0]), rope_inv_freq(8), torch.device("cpu")
    dk, _ = reads.in_owner_frame(1, shift, rope, cpu)
    assert reads.in_owner_frame(1, shift.clone(), rope, cpu)[0] is dk
    held += 5 * 2 * 8 * 4  # the keys rotated for the decode's shifts: kept, and counted
    assert reads.materialized_nbytes() == held == MaterializedBytes.now - before
    moved = reads.in_owner_frame(1, shift + 1, rope, cpu)[0]
    torch.testing.assert_close(moved, apply_rope(first.k, first.positions - shift - 1, rope))
    assert reads.materialized_nbytes() == held  # other shifts replace them
    reads.release()  # the request is done: given back at once
    assert reads.materialized_nbytes() == 0 and MaterializedBytes.now == before
    reads.layer(2)  # read again (a stale plan): expanded again, and counted
    assert MaterializedBytes.now > before
    del reads, first
    gc.collect()  # or given back when the row goes
    assert MaterializedBytes.now == before
