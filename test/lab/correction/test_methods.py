"""Exact identities of every sharing method on a tiny random model in float64."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_cache_close, make_request

from sglang_kvcmas_lab.correction import create_builder, registered
from sglang_kvcmas_lab.correction.selective import block_of, naive_selective, selective_prefill


def dense(tiny, ids):
    out = tiny.forward(ids)
    return out.kv, out.logits[-1]


def test_registry_has_every_method():
    assert {"no_sharing", "prefix_caching", "naive", "cacheblend", "kvcomm", "oracle",
            "kvcmas"} <= set(registered())


@pytest.mark.parametrize("name", ["no_sharing", "prefix_caching"])
def test_exact_methods_reproduce_dense(tiny, name):
    req, ids, _ = make_request(tiny)
    ref_kv, ref_logits = dense(tiny, ids)
    res = create_builder(name).build(tiny, req)
    torch.testing.assert_close(res.last_logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_cache_close(res.cache, ref_kv)


def test_layer0_of_shared_segment_is_prefix_free(tiny):
    req, _, _ = make_request(tiny)
    for r, ref in zip(req.reads, req.reference):
        torch.testing.assert_close(r.base.k[0], ref.k[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r.base.v[0], ref.v[0], rtol=1e-12, atol=1e-12)


def test_naive_deviates_but_exact_delta_reproduces_dense(tiny):
    """base + (true delta) == recomputed: the oracle at full rank is exact; naive is not."""
    req, ids, _ = make_request(tiny)
    ref_kv, ref_logits = dense(tiny, ids)
    naive = create_builder("naive").build(tiny, req)
    assert (naive.last_logits - ref_logits).abs().max() > 1e-6
    full = create_builder("oracle", rank=tiny.spec.head_dim).build(tiny, req)
    torch.testing.assert_close(full.last_logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_cache_close(full.cache, ref_kv)


def test_oracle_error_decreases_with_rank(tiny):
    req, ids, _ = make_request(tiny)
    _, ref_logits = dense(tiny, ids)
    errs = [float((create_builder("oracle", rank=r).build(tiny, req).last_logits
                   - ref_logits).abs().max()) for r in (1, 4, tiny.spec.head_dim)]
    assert errs[0] > errs[2] and errs[1] > errs[2]


@pytest.mark.parametrize("name,kw", [("cacheblend", {"rho": 1.0}),
                                     ("kvcmas", {"rho": 1.0, "estimator": "online"}),
                                     ("kvcmas", {"rho": 1.0, "estimator": "sparse"})])
def test_selective_recompute_at_100_percent_is_dense(tiny, name, kw):
    req, ids, _ = make_request(tiny)
    ref_kv, ref_logits = dense(tiny, ids)
    res = create_builder(name, **kw).build(tiny, req)
    torch.testing.assert_close(res.last_logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_cache_close(res.cache, ref_kv)


def test_selective_with_nothing_selected_matches_exact_layer1_then_naive(tiny):
    """rho = 0: layer-1 K/V exact for every token, deeper layers the base's."""
    req, _, _ = make_request(tiny)
    ids, base, starts = block_of(req.reads)
    out = selective_prefill(tiny, req.prefix, ids, base, starts, req.suffix_ids,
                            req.suffix_positions(), lambda c: torch.empty(0, dtype=torch.long))
    ref = torch.cat([r.k[1] for r in req.reference])
    torch.testing.assert_close(out.block_view.k[1], ref, rtol=1e-9, atol=1e-9)
    for layer in range(2, tiny.spec.num_layers):
        assert torch.equal(out.block_view.k[layer], base.k[layer])


@pytest.mark.parametrize("seg_lens,frac", [((23, 17), 0.3), ((1, 40, 5), 0.15), ((60,), 0.05)])
def test_selective_pass_equals_the_plain_mixed_cache_forward(tiny, seg_lens, frac):
    """The one-pass selective recompute (layer 0 for all, then selected + suffix) equals running
    every token through every layer over the mixed cache (exact layer 1, base elsewhere except
    the selection), for a selection that is neither empty nor everything."""
    req, _, _ = make_request(tiny, seg_lens=seg_lens)
    ids, base, starts = block_of(req.reads)
    T = ids.numel()
    sel = torch.randperm(T, generator=torch.Generator().manual_seed(T))[:max(1, round(frac * T))]
    out = selective_prefill(tiny, req.prefix, ids, base, starts, req.suffix_ids,
                            req.suffix_positions(), lambda c: sel)
    cache, logits = naive_selective(tiny, req.prefix, ids, base, req.suffix_ids,
                                    req.suffix_positions(), sel)
    torch.testing.assert_close(out.last_logits, logits, rtol=1e-9, atol=1e-9)
    assert_cache_close(out.cache, cache)


@pytest.mark.parametrize("name,kw", [("cacheblend", {"rho": 0.3}), ("oracle", {"rank": 2}),
                                     ("kvcmas", {"rho": 0.2, "num_first": 4}),
                                     ("kvcmas", {"rho": 0.2, "num_first": 2, "score": "impact"}),
                                     ("kvcmas", {"rho": 0.2, "estimator": "transfer"}),
                                     ("kvcmas", {"rho": 0.3, "num_first": 2, "estimator": "interp"}),
                                     ("naive", {}), ("prefix_caching", {})])
def test_leaf_reconstructs_the_view(tiny, name, kw):
    """What a method persists (leaf over the untouched base) is exactly the view it used."""
    req, _, _ = make_request(tiny)
    res = create_builder(name, **kw).build(tiny, req)
    for r, view, leaf in zip(req.reads, res.views, res.leaves, strict=True):
        assert_cache_close(leaf.apply(r.base).with_positions(r.positions), view, 1e-12)


def test_owner_base_is_bit_identical_and_never_modified(tiny):
    req, ids, owner = make_request(tiny)
    snap = [r.base.clone() for r in req.reads]
    for name, kw in [("naive", {}), ("cacheblend", {"rho": 0.3}), ("kvcmas", {"rho": 0.2}),
                     ("oracle", {"rank": 2}), ("kvcomm", {})]:
        create_builder(name, **kw).build(tiny, req)
    for r, s in zip(req.reads, snap):
        for x, y in zip([*r.base.k, *r.base.v], [*s.k, *s.v]):
            assert torch.equal(x, y)
    # and the base is what a plain prefill of the owner's prompt computes, bit for bit
    _, _, again = make_request(tiny)
    for x, y in zip([*owner.k, *owner.v], [*again.k, *again.v]):
        assert torch.equal(x, y)


def test_kvcmas_correction_beats_sparse_only_on_kv_error(tiny):
    """The fitted low-rank part must reduce the deep-layer KV error of unselected tokens."""
    req, _, _ = make_request(tiny, seg_lens=(60,))
    errs = {}
    for est in ("sparse", "transfer"):
        res = create_builder("kvcmas", rho=0.25, num_first=2, estimator=est, feature_dim=4,
                             lam=1e-3).build(tiny, req)
        ref, view = req.reference[0], res.views[0]
        errs[est] = sum(float((view.v[layer] - ref.v[layer]).norm()) for layer in (2, 3))
    assert errs["transfer"] < errs["sparse"]


def test_kvcomm_falls_back_then_reuses_anchors(tiny):
    kv = create_builder("kvcomm")
    res = kv.build(tiny, make_request(tiny, seed=0)[0])
    assert res.info["fallback"] == 1
    kv.build(tiny, make_request(tiny, seed=1)[0])
    assert kv.state_nbytes() > 0 and len(kv.pools["s0"]) == 2
    res = kv.build(tiny, make_request(tiny, seed=2)[0])
    assert res.info["fallback"] in (0, 1)
