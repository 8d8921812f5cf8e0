"""Low-rank leaves in the tree cache (no server): a reader under ``lowrank`` fits from the tokens
it recomputes, reads its other foreign borrowed tokens corrected (counted ``reused_corrected``),
keeps its factors as its agent's low-rank leaf (byte-counted, read on its next turn) and no exact
leaves; ``lowrank+exact`` keeps both; ``exact`` is today's row."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang_kvcmas.attention.lowrank import LayerCorrection, MIN_PAIRS  # noqa: E402
from sglang_kvcmas.attention.spans import RowSpans  # noqa: E402
from sglang_kvcmas.policy.leaf_mode import LeafConfig  # noqa: E402
from sglang_kvcmas.policy.recompute import RecomputeConfig  # noqa: E402

from test_lowrank import _layer  # noqa: E402
from test_shared_tree_cache import (  # noqa: E402
    END,
    SUFFIX,
    T1,
    T2,
    Harness,
    Req,
    assert_slots_conserved,
    head,
)

K = MIN_PAIRS + 4  # boundary tokens recomputed: enough pairs to fit
T3 = list(range(300, 340))


def _harness(mode: str, fitted: LayerCorrection | None = None) -> Harness:
    """A harness whose readers' extend 'fits' ``fitted`` at layer 0 (the backend's job)."""
    h = Harness(boundary=K)
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=K, min_borrowed=0,
                                               max_fraction=1.0)
    h.cache.leaf_config = LeafConfig(mode, 4)
    hand = h.cache.maybe_hand_to_session

    def hand_and_fit(req):
        hand(req)
        row = getattr(req, "kvcmas_row", None)
        corr = row.spans.correction if row is not None and row.spans is not None else None
        if fitted is not None and corr is not None and corr.fit is not None and corr.fit.fits:
            corr.fit.layers[0] = fitted

    h.cache.maybe_hand_to_session = hand_and_fit
    return h


def _turns(h: Harness):
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)  # a owns T2
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)
    return b, b2, spans


def test_exact_mode_reads_as_today():
    h = _harness("exact", _layer(3, 64, 4))
    _, b2, spans = _turns(h)
    assert spans.correction is None
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert rec["reused_corrected"] == 0 and rec["reused_repositioned"] == len(T2) + END - K
    assert h.cache.shared.delta_tokens() == K and len(h.cache.shared.lowrank) == 0


def test_lowrank_reader_fits_reads_corrected_and_keeps_factors_not_tokens():
    lc = _layer(3, 64, 4)
    h = _harness("lowrank", lc)
    b, b2, spans = _turns(h)
    corr = spans.correction
    at = len(b) + len(T1)
    borrowed = len(T2) + END - K
    assert corr is not None and corr.fit.pairs == K and corr.fit.rank == 4
    assert corr.mask.tolist() == [False] * at + [True] * borrowed  # the foreign borrowed rows
    assert corr.fit.exact_rows.tolist() == list(range(at + borrowed, at + borrowed + K))
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert (rec["reused_corrected"], rec["reused_repositioned"]) == (borrowed, 0)
    assert rec["recomputed_borrowed"] == K
    assert h.cache.shared.delta_tokens() == 0  # no exact leaves: the recomputed slots freed
    assert_slots_conserved(h)
    stats = h.cache.shared_stats()
    assert stats["lowrank_leaves"] == 1 and stats["lowrank_bytes"] == lc.nbytes()
    (agent,) = stats["leaf_bytes_by_agent"]
    assert stats["leaf_bytes_by_agent"][agent] == {"exact": 0, "lowrank": lc.nbytes(),
                                                  "factored": 0}

    b3 = Req("b3", b + T1 + T2 + SUFFIX + [9])  # its next turn reads the stored factors
    spans3, _ = h.serve(b3, 4)
    assert spans3.correction.stored.layer(0) is lc
    assert b3.customized_info["kvcmas_reuse"][0]["reused_corrected"] == borrowed
    # It recomputes the same picks again and refits on them: the stored factors (fitted on
    # those pairs) are not chained, or they would count them twice.
    assert spans3.correction.fit.pairs == K and spans3.correction.fit.prior_weight == 0.0


def _three_turns(h: Harness) -> tuple[RowSpans, RowSpans]:
    """b reads T2 (a's), then T3 (a's again): its second reading turn recomputes T3's picks."""
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    first, _ = h.serve(Req("b2", b + T1 + T2 + SUFFIX), 3)
    h.serve(Req("a3", a + T1 + T2 + T3 + SUFFIX), 4)
    second, _ = h.serve(Req("b3", b + T1 + T2 + T3 + SUFFIX), 5)
    return first, second


def test_lowrank_and_exact_chains_the_next_segments_refit_from_the_stored_factors():
    lc = _layer(3, 64, 4)
    h = _harness("lowrank+exact", lc)
    first, second = _three_turns(h)
    fit = second.correction.fit
    assert first.correction.stored is None and second.correction.stored.layer(0) is lc
    assert fit is not None and fit.prior is second.correction.stored and fit.chain == 1.0
    assert fit.prior_weight == pytest.approx(min(4.0, K / fit.pairs))

    h0 = _harness("lowrank+exact", lc)
    h0.cache.leaf_config = LeafConfig("lowrank+exact", 4, chain=0.0)  # the ablation
    _, second0 = _three_turns(h0)
    assert second0.correction.stored is not None and second0.correction.fit.prior_weight == 0.0


def test_lowrank_and_exact_keeps_both_and_a_forward_that_fitted_nothing_stores_nothing():
    lc = _layer(3, 64, 4)
    h = _harness("lowrank+exact", lc)
    _, _, spans = _turns(h)
    assert h.cache.shared.delta_tokens() == K and len(h.cache.shared.lowrank) == 1
    assert spans.correction.fit.fits

    h2 = _harness("lowrank", None)  # the forward fitted nothing: nothing is stored
    _, b2, _ = _turns(h2)
    assert len(h2.cache.shared.lowrank) == 0
    assert b2.customized_info["kvcmas_reuse"][0]["reused_corrected"] == len(T2) + END - K


def test_a_request_sets_its_leaf_mode_and_keeps_nothing():
    from types import SimpleNamespace

    h = _harness("exact", _layer(3, 64, 4))
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    b2.sampling_params = SimpleNamespace(custom_params={
        "kvcmas_leaf_mode": "lowrank", "kvcmas_lowrank_rank": 4,
        "kvcmas_recompute_boundary": K})
    spans, _ = h.serve(b2, 3)
    n = len(spans.recomputed.token_ids)  # the deployment's cap: half of the borrowed tokens
    assert spans.correction is not None and spans.correction.fit.rank == 4
    assert spans.correction.fit.pairs == n >= MIN_PAIRS
    assert b2.customized_info["kvcmas_reuse"][0]["reused_corrected"] == len(T2) + END - n
    assert len(h.cache.shared.lowrank) == 0 and h.cache.shared.delta_tokens() == 0


def test_leaf_mode_knob_from_config_environment_and_request():
    from sglang_kvcmas.config import ConfigError, ServingConfig
    from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions

    default = LeafConfig.from_serving(ServingConfig())  # factored leaves at rank 4
    assert (default.lowrank_rank, default.factor_rank, default.keeps_exact) == (0, 4, False)
    both = LeafConfig.from_serving(ServingConfig.from_env({"KVCMAS_LEAF_MODE": "lowrank+exact",
                                                           "KVCMAS_LOWRANK_RANK": "4"}))
    assert both.keeps_exact and both.lowrank_rank == 4
    assert not LeafConfig("lowrank").keeps_exact
    with pytest.raises(ConfigError, match="KVCMAS_LEAF_MODE"):
        ServingConfig.from_env({"KVCMAS_LEAF_MODE": "dense"})
    with pytest.raises(RequestOptionError, match="kvcmas_lowrank_rank"):
        RequestOptions.parse({"kvcmas_lowrank_rank": 0})
    assert LeafConfig.from_serving(ServingConfig()).chain == 1.0
    assert LeafConfig.from_serving(ServingConfig(), lowrank_chain=0.5).chain == 0.5
    assert LeafConfig("lowrank+exact", 8, 0.5).lowrank_chain == 0.5
    assert LeafConfig("lowrank", 8, 0.5).lowrank_chain == 0.0  # refits on every pick anyway
    with pytest.raises(RequestOptionError, match="kvcmas_lowrank_chain"):
        RequestOptions.parse({"kvcmas_lowrank_chain": 2})
    with pytest.raises(ValueError):
        LeafConfig("lowrank", 8, chain=-0.1)


def test_low_rank_leaves_are_byte_counted_and_capped_least_recently_used_first():
    from sglang_kvcmas.attention.lowrank import LowRankCorrection
    from sglang_kvcmas.tree.lowrank_leaves import LowRankLeaves

    one = LowRankCorrection({0: _layer(3, 64, 4)}, 4)
    leaves = LowRankLeaves(max_bytes=2 * one.nbytes())
    leaves.put("ns", "a", one)
    leaves.put("ns", "b", one)
    leaves.put("ns", "a", one)  # replaced, not counted twice
    assert len(leaves) == 2 and leaves.nbytes() == 2 * one.nbytes()
    assert leaves.get("ns", "b") is one  # b used last: a goes first
    leaves.put("other", "c", one)
    assert leaves.get("ns", "a") is None and leaves.nbytes() == 2 * one.nbytes()
    leaves.drop_namespace("ns")
    assert leaves.bytes_by_agent() == {"c": one.nbytes()} and leaves.nbytes() == one.nbytes()


def test_the_leaf_budget_counts_low_rank_bytes_and_drops_least_recently_used_first():
    """With the pool's KV bytes per token, ``trim_leaves`` counts every low-rank leaf as its
    bytes in tokens of KV (rounded up) beside the exact leaves' slots, and frees the least
    recently used of either type until the leaves fit."""
    import time

    import torch

    from sglang_kvcmas.attention.lowrank import LowRankCorrection
    from sglang_kvcmas.tree.shared_tree import SharedTree

    freed = []
    tree = SharedTree(lambda s: freed.extend(s.tolist()))
    _, node = tree.insert("ns", list(range(1, 41)), 0, torch.arange(40), "a", 5, anchor=None)
    tree.add_overrides(node, "b", torch.arange(8), torch.arange(100, 108), 7)  # 8 slots
    one = LowRankCorrection({0: _layer(3, 64, 4)}, 4)
    per_token = one.nbytes() // 3  # one low-rank leaf: 3 or 4 tokens of KV
    tokens = -(-one.nbytes() // per_token)
    time.sleep(0.01)
    tree.lowrank.put("ns", "c", one)
    time.sleep(0.01)
    tree.lowrank.put("ns", "d", one)
    assert tree.trim_leaves(8 + 2 * tokens, per_token) == 0  # fits: nothing goes
    assert tree.trim_leaves(8, 0) == 0  # without bytes per token, exact leaves only
    # over by one low-rank leaf: the exact leaf (used first) goes, then nothing more is needed
    assert tree.trim_leaves(2 * tokens, per_token) == 8
    assert sorted(freed) == list(range(100, 108)) and tree.leaf_size == 0
    assert tree.trim_leaves(tokens, per_token) == tokens  # then c, the older low-rank leaf
    assert tree.lowrank.get("ns", "c") is None and tree.lowrank.get("ns", "d") is one
    assert tree.lowrank.nbytes() == one.nbytes() and tree.check_invariants() == []
