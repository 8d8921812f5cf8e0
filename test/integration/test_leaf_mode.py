"""Leaf modes in the tree cache (no server): ``exact`` keeps a reader's recomputed tokens as exact
leaves and reads its other foreign borrowed tokens re-positioned; the leaf-mode knobs from the
deployment, the environment and a request; the leaf budget over exact and factored leaves
together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang_kvcmas.policy.leaf_mode import LeafConfig  # noqa: E402
from sglang_kvcmas.policy.recompute import RecomputeConfig  # noqa: E402
from sglang_kvcmas.tree.shared_tree import SharedTree  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention"))
from test_deviation_factors import _factors  # noqa: E402
from test_shared_tree_cache import (  # noqa: E402
    END,
    SUFFIX,
    T1,
    T2,
    Harness,
    Req,
    head,
)

K = 20  # boundary tokens recomputed


def test_exact_mode_keeps_exact_leaves_and_reads_the_rest_re_positioned():
    h = Harness(boundary=K)
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=K, min_borrowed=0,
                                               max_fraction=1.0)
    h.cache.leaf_config = LeafConfig("exact", 4)
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)  # a owns T2
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)
    assert spans.leaves is None
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert rec["reused_factored"] == 0 and rec["reused_repositioned"] == len(T2) + END - K
    assert h.cache.shared.exact_leaf_tokens() == K


def test_leaf_mode_knob_from_config_environment_and_request():
    from sglang_kvcmas.config import ConfigError, ServingConfig
    from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions

    default = LeafConfig.from_serving(ServingConfig())  # factored leaves at rank 4
    assert (default.mode, default.factor_rank) == ("factored", 4)
    exact = LeafConfig.from_serving(ServingConfig.from_env({"KVCMAS_LEAF_MODE": "exact",
                                                            "KVCMAS_LEAF_RANK": "8"}))
    assert (exact.mode, exact.rank, exact.factor_rank) == ("exact", 8, 0)
    assert LeafConfig.from_serving(ServingConfig(), leaf_rank=16).factor_rank == 16
    with pytest.raises(ConfigError, match="KVCMAS_LEAF_MODE"):
        ServingConfig.from_env({"KVCMAS_LEAF_MODE": "dense"})
    with pytest.raises(RequestOptionError, match="kvcmas_leaf_rank"):
        RequestOptions.parse({"kvcmas_leaf_rank": 0})
    with pytest.raises(ValueError):
        LeafConfig("lowrank", 8)


def test_the_leaf_budget_counts_exact_and_factored_leaves_least_recently_used_first():
    """With the pool's KV bytes per token, ``trim_leaves`` counts every factored leaf as its
    bytes in tokens of KV (rounded up) beside the exact leaves' slots, and frees the least
    recently used of either type until the leaves fit."""
    freed = []
    tree = SharedTree(lambda s: freed.extend(s.tolist()))
    _, node = tree.insert("ns", list(range(1, 41)), 0, torch.arange(40), "a", 5, anchor=None)
    tree.add_overrides(node, "b", torch.arange(8), torch.arange(100, 108), 7)  # 8 slots
    f = _factors(1, 6, 2, 16, 4, seed=2)
    tree.add_factors(node, "c", torch.arange(6), f, 12)
    tree.add_factors(node, "d", torch.arange(6), f, 40)
    node.exact_leaves["b"].last_access = 1.0
    node.factors["c"].last_access, node.factors["d"].last_access = 2.0, 3.0
    per_token = 100
    tokens = -(-node.factors["c"].nbytes() // per_token)
    assert tree.trim_leaves(8 + 2 * tokens, per_token) == 0  # fits: nothing goes
    assert tree.trim_leaves(8, 0) == 0  # without bytes per token, exact leaves only
    # over by the exact leaf's 8 tokens: it (used first) goes, then nothing more is needed
    assert tree.trim_leaves(2 * tokens, per_token) == 8
    assert sorted(freed) == list(range(100, 108)) and tree.leaf_size == 0
    assert tree.trim_leaves(tokens, per_token) == tokens  # then c, the older factored leaf
    assert list(node.factors) == ["d"] and tree.check_invariants() == []
