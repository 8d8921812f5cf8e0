"""Lab delta leaves: rank = head_dim reproduces the deviation exactly; bytes are counted once."""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas_lab.delta.leaf import DeltaLeaf, LowRankFactors, TokenOverride, svd_factors
from sglang_kvcmas_lab.models.reference_llama import KVCache


def rand_cache(T=17, L=3, H=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: [torch.randn(T, H, d, generator=g, dtype=torch.float64) for _ in range(L)]  # noqa: E731
    return KVCache(mk(), mk(), torch.arange(T))


@pytest.mark.parametrize("T", [1, 17, 81])
def test_full_rank_svd_is_exact_and_truncation_is_optimal(T):
    dev = torch.randn(T, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(svd_factors(dev, 8).dense(), dev, rtol=1e-10, atol=1e-10)
    r = min(2, T)
    err = (svd_factors(dev, r).dense() - dev).norm()
    # any other rank-r per-head factorization is no better (compare with a random one)
    rnd = LowRankFactors(torch.randn(3, T, r, dtype=torch.float64),
                         torch.randn(3, r, 8, dtype=torch.float64))
    assert err <= (rnd.dense() - dev).norm()


def test_leaf_apply_base_plus_exact_delta_is_target():
    base, target = rand_cache(seed=0), rand_cache(seed=1)
    ks = tuple(svd_factors(t - b, 8) for t, b in zip(target.k, base.k))
    vs = tuple(svd_factors(t - b, 8) for t, b in zip(target.v, base.v))
    leaf = DeltaLeaf("b", 0, ks, vs, (None,) * 3)
    out = leaf.apply(base)
    for x, y in zip([*out.k, *out.v], [*target.k, *target.v]):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_overrides_win_and_shared_u_is_counted_once():
    base = rand_cache()
    u = torch.randn(1, 17, 2, dtype=torch.float64)
    f = LowRankFactors(u, torch.randn(2, 2, 8, dtype=torch.float64))
    idx = torch.tensor([0, 5])
    ov = TokenOverride(idx, torch.zeros(2, 2, 8, dtype=torch.float64),
                       torch.ones(2, 2, 8, dtype=torch.float64))
    leaf = DeltaLeaf("b", 0, (f, f, f), (None, None, None), (ov, None, None))
    out = leaf.apply(base)
    assert torch.equal(out.k[0][idx], ov.k) and torch.equal(out.v[0][idx], ov.v)
    assert leaf.nbytes() == (u.numel() + f.c.numel() + 2 + 2 * 2 * 2 * 8) * 8
