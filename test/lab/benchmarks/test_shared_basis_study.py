"""The shared-basis lab's ways of keeping a reader's deviation (``kept``): each is what its
docstring says, checked on made-up deviations."""

from __future__ import annotations

import torch
from helpers.bench_scripts import load_script

study = load_script("benchmark/lab/shared_basis_study.py")
kept, leaf_bytes, svd_basis = study.kept, study.leaf_bytes, study.svd_basis


def _low_rank(n: int, dim: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g, dtype=torch.float64) @ torch.randn(
        r, dim, generator=g, dtype=torch.float64)


def test_every_variant_is_exact_when_the_deviation_fits_its_rank():
    dev = _low_rank(23, 16, 3, seed=1)
    first = torch.arange(23) < 11
    for variant in ("one", "turn", "chain"):
        torch.testing.assert_close(kept(dev, first, 3, variant), dev)
    torch.testing.assert_close(kept(dev, first, 3, "pooled", svd_basis(dev, 3)[0]), dev)


def test_one_is_the_truncated_svd_and_turn_cuts_each_turn_alone():
    dev = torch.randn(30, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    first = torch.arange(30) < 13
    u, s, vh = torch.linalg.svd(dev, full_matrices=False)
    torch.testing.assert_close(kept(dev, first, 4, "one"), (u[:, :4] * s[:4]) @ vh[:4])
    got = kept(dev, first, 4, "turn")
    torch.testing.assert_close(got[first], kept(dev[first], first[first], 4, "one"))
    torch.testing.assert_close(got[~first], kept(dev[~first], ~first[~first], 4, "one"))


def test_chain_reads_both_turns_through_one_basis_no_better_than_per_turn():
    """Turns in disjoint subspaces of rank 2 each: a rank-2 chain keeps the stronger; per turn
    keeps both; the chain's error is never below the per-turn bases'."""
    a, b = _low_rank(10, 8, 2, seed=3), _low_rank(10, 8, 2, seed=4)
    q = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(5)))[0]
    a, b = a @ q[:, :2] @ q[:, :2].T, 3 * b @ q[:, 2:4] @ q[:, 2:4].T
    dev, first = torch.cat([a, b]), torch.arange(20) < 10
    chain, turn = kept(dev, first, 2, "chain"), kept(dev, first, 2, "turn")
    torch.testing.assert_close(turn, dev)
    torch.testing.assert_close(chain[~first], dev[~first])  # the stronger turn 2 won the basis
    assert float((chain[first] - dev[first]).norm()) > 0.9 * float(dev[first].norm())
    assert leaf_bytes("chain", 40, 64, 8, 6) < leaf_bytes("turn", 40, 64, 8, 6)
    assert leaf_bytes("pooled", 40, 64, 8, 6) < leaf_bytes("chain", 40, 64, 8, 6)
