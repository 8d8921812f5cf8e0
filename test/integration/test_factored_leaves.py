"""Factored leaves in the tree and the tree cache (no server): a reader under ``factored`` keeps
the factors its extend made of the tokens it recomputed (no exact leaves, its recomputed slots
freed), byte-counted per agent; its next turn reads those tokens through them (counted
``reused_factored``) and never recomputes them; a node's split, the leaf budget and the
invariants hold them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang_kvcmas.attention.deviation_factors import factor_deviation  # noqa: E402
from sglang_kvcmas.integration import inflight_fence  # noqa: E402
from sglang_kvcmas.policy.leaf_mode import LeafConfig  # noqa: E402
from sglang_kvcmas.policy.recompute import RecomputeConfig  # noqa: E402
from sglang_kvcmas.tree.factored_leaves import FactorLeaf  # noqa: E402
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
    assert_slots_conserved,
    head,
)

K = 20  # boundary tokens recomputed
HKV, D, RANK = 2, 16, 4


def _harness(mode: str = "factored") -> Harness:
    """A harness whose readers' extend 'factors' layer 0 (the backend's job) from a made-up
    deviation of the pairs it recomputes."""
    h = Harness(boundary=K)
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=K, min_borrowed=0,
                                               max_fraction=1.0)
    h.cache.leaf_config = LeafConfig(mode, RANK)
    hand = h.cache.maybe_hand_to_session

    def hand_and_factor(req):
        hand(req)
        row = getattr(req, "kvcmas_row", None)
        leaves = row.spans.leaves if row is not None and row.spans is not None else None
        if leaves is not None and leaves.factor is not None:
            dev = torch.randn(leaves.factor.pairs, HKV, D)
            leaves.factor.layers[0] = (*factor_deviation(dev, RANK),
                                       *factor_deviation(-dev, RANK))

    h.cache.maybe_hand_to_session = hand_and_factor
    return h


def _turns(h: Harness):
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)  # a owns T2
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)
    return b, b2, spans


def test_a_factored_reader_keeps_factors_not_slots_and_reads_them_next_turn():
    h = _harness()
    b, b2, spans = _turns(h)
    fit = spans.leaves.factor
    at = len(b) + len(T1)
    borrowed = len(T2) + END - K
    assert fit is not None and fit.pairs == K and fit.rank == RANK
    assert fit.exact_rows.tolist() == list(range(at + borrowed, at + borrowed + K))
    assert spans.leaves.reads is None and spans.leaves.layer(0) is None  # reads exact
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert (rec["reused_factored"], rec["reused_repositioned"]) == (0, borrowed)
    assert h.cache.shared.exact_leaf_tokens() == 0  # no exact leaves: the recomputed slots freed
    assert_slots_conserved(h)
    stats = h.cache.shared_stats()
    assert stats["factored_tokens"] == K and stats["factored_bytes"] > 0
    (agent,) = stats["leaf_bytes_by_agent"]
    assert stats["leaf_bytes_by_agent"][agent] == {"exact": 0,
                                                  "factored": stats["factored_bytes"]}
    assert not h.cache.shared.check_invariants()

    b3 = Req("b3", b + T1 + T2 + SUFFIX + [9])  # its next turn reads the factored tokens
    spans3, _ = h.serve(b3, 4)
    assert spans3.recomputed is None  # nothing left to recompute: the picks are held
    leaves = spans3.leaves.reads
    assert sorted(leaves.rows.tolist()) == list(range(at, at + K))
    rec3 = b3.customized_info["kvcmas_reuse"][0]
    assert (rec3["reused_factored"], rec3["reused_repositioned"]) == (K, borrowed)
    deltas = spans3.leaves.layer(0)
    assert deltas.k.shape == (K, HKV, D)
    assert_slots_conserved(h)


def test_the_picks_are_read_through_the_leaves_right_after_the_prefill(monkeypatch):
    """At the prefill's checkpoint the reader's recomputed slots are freed and its row points
    at the owner's slots in shared order, read (decode) through the factored leaves just kept.
    With one batch in flight (overlap scheduler on an accelerator) the same happens behind a
    fence on the forward stream, set before the row changes; where no fence can be set, the
    slots stay until release and the row does not change."""
    for in_flight, fenced in ((False, False), (True, True), (True, False)):
        h = _harness()
        h.cache._overlap = in_flight  # ``rows_in_flight``
        seen, checkpoint, fences = {}, h.cache.checkpoint, []

        def fence(device, h=h, fences=fences, fenced=fenced):
            fences.append(h.pool.req_to_token[3].clone())  # the row when the fence is set
            return fenced

        monkeypatch.setattr(inflight_fence, "fence", fence)

        def spy(req, *, up_to, **kw):
            first = req.rid == "b2" and not seen
            before = h.pool.req_to_token[3].clone()
            checkpoint(req, up_to=up_to, **kw)
            if first:
                seen.update(before=before, after=h.pool.req_to_token[3].clone(),
                            row=req.kvcmas_row, freed=list(h.alloc.freed),
                            release=getattr(req, "_kvcmas_release_slots", None))

        h.cache.checkpoint = spy
        at_a = len(head(50, 20)) + len(T1)
        b, _, spans = _turns(h)
        at, n = len(b) + len(T1), len(T2) + END
        owner = h.pool.req_to_token[2, at_a : at_a + n]
        picks = seen["before"][at + n - K : at + n]  # the extend's recomputed slots
        assert spans.recomputed is not None and len(spans.recomputed.token_ids) == K
        assert torch.equal(seen["before"][at : at + n - K], owner[K:])
        assert bool(fences) == in_flight  # fenced only with a batch in flight
        if in_flight:  # set before the row changed
            assert torch.equal(fences[0], seen["before"])
        if in_flight and not fenced:  # nothing changes under a launched batch: at release
            assert torch.equal(seen["after"], seen["before"])
            assert seen["row"].spans.recomputed is not None
            assert not set(picks.tolist()) & set(seen["freed"])
            assert torch.equal(seen["release"], picks.to(torch.int64))
        else:
            assert torch.equal(seen["after"][at : at + n], owner)  # the picks: a's slots too
            assert set(picks.tolist()) <= set(seen["freed"]) and seen["release"] is None
            new_spans = seen["row"].spans
            assert new_spans.recomputed is None
            assert sorted(new_spans.leaves.reads.rows.tolist()) == list(range(at, at + K))
            assert new_spans.leaves.layer(0).k.shape == (K, HKV, D)
        assert_slots_conserved(h)


def test_exact_mode_keeps_no_factors():
    h = _harness("exact")
    _, _, spans = _turns(h)
    assert spans.leaves is None and h.cache.shared.exact_leaf_tokens() == K
    assert h.cache.shared_stats()["factored_tokens"] == 0


def _tree_with_node(n: int = 30):
    freed = []
    tree = SharedTree(freed.append)
    ns = ("k", None)
    _, node = tree.insert(ns, np.arange(n, dtype=np.int64), 0, torch.arange(n), "a", 5,
                          anchor=None)
    return tree, node, freed


def test_a_node_split_keeps_each_factored_token_on_its_half_under_its_basis():
    tree, node, _ = _tree_with_node()
    f = _factors(1, 6, HKV, D, RANK, seed=2)
    assert tree.add_factors(node, "b", torch.tensor([1, 4, 10, 11, 20, 29]), f, 12) == 6
    assert tree.add_factors(node, "b", torch.tensor([4, 5]), f.select(torch.arange(2)), 12) == 1
    assert tree.add_factors(node, "b", torch.tensor([7]), f.select(torch.arange(1)), 13) == 0
    whole = node.factors["b"].nbytes()
    dk_before = f.deviations(0)[0]
    tree.match(("k", None), np.arange(11, dtype=np.int64), split=True)  # split after 11 tokens
    head_node = node.parent
    first, rest = head_node.factors["b"], node.factors["b"]
    assert first.offsets().tolist() == [1, 4, 10, 5] and rest.offsets().tolist() == [0, 9, 18]
    assert (first.reader_start, rest.reader_start) == (12, 23)
    assert abs(first.nbytes() + rest.nbytes() - whole) <= 3
    torch.testing.assert_close(rest.parts[0].factors.deviations(0)[0], dk_before[3:])
    assert not tree.check_invariants()


def test_the_leaf_budget_drops_factored_leaves_least_recently_used_first():
    tree, node, freed = _tree_with_node()
    f = _factors(1, 6, HKV, D, RANK, seed=2)
    tree.add_factors(node, "b", torch.arange(6), f, 12)
    tree.add_factors(node, "c", torch.arange(6), f, 40)
    node.factors["b"].last_access, node.factors["c"].last_access = 1.0, 2.0
    per = -(-node.factors["b"].nbytes() // 100)
    assert tree.trim_leaves(per, bytes_per_token=100) == per  # one leaf goes: b, the older
    assert list(node.factors) == ["c"] and not freed  # host memory: no pool slot freed
    assert tree.leaf_bytes_by_agent()["c"]["factored"] == node.factors["c"].nbytes()


def test_a_factored_leaf_merges_only_new_offsets():
    f = _factors(2, 4, HKV, D, RANK, seed=5)
    leaf, added = FactorLeaf(7).with_part(torch.tensor([0, 2, 4, 6]), f)
    leaf2, added2 = leaf.with_part(torch.tensor([2, 3]), f.select(torch.arange(2)))
    assert (added, added2, len(leaf2)) == (4, 1, 5)
    assert leaf2.parts[1].offsets.tolist() == [3]


def test_a_request_with_its_own_knobs_reads_the_leaves_only_when_it_asks():
    """Own recompute knobs measure the owner's KV under them (no leaves read, none kept);
    ``kvcmas_read_leaves`` reads the agent's leaves with them: nothing recomputed, the picks
    through their factors (the frontier's probe of what a turn left its reader)."""
    from types import SimpleNamespace

    h = _harness()
    b, _, _ = _turns(h)
    borrowed = len(T2) + END - K
    none = {"kvcmas_recompute_boundary": 0, "kvcmas_recompute_mass_fraction": 0.0}
    for row, custom, corrected in ((4, none, 0), (5, none | {"kvcmas_read_leaves": True}, K)):
        req = Req(f"b{row}", b + T1 + T2 + SUFFIX + [row])
        req.sampling_params = SimpleNamespace(custom_params=custom)
        h.serve(req, row)
        rec = req.customized_info["kvcmas_reuse"][0]
        assert (rec["reused_factored"], rec["reused_repositioned"], rec["recomputed_borrowed"]
                ) == (corrected, borrowed + K - corrected, 0), rec
    assert h.cache.shared_stats()["factored_tokens"] == K  # nothing more kept
    assert_slots_conserved(h)


def test_a_prompt_readers_recomputed_slots_go_right_after_its_prefill():
    """A factored prompt reader's row is re-pointed at the owners' slots after its prefill (its
    decode reads the recomputed tokens through its leaves); the leaves are kept."""
    h = _harness()
    h.cache._overlap = False
    _turns(h)
    assert h.cache.rows_reread == 1
    assert h.cache.shared_stats()["factored_tokens"] == K
    assert_slots_conserved(h)


def test_an_adapter_reader_at_its_own_positions_keeps_its_slots():
    from types import SimpleNamespace

    h = _harness()
    h.cache._overlap = False

    def handle(shift):
        return SimpleNamespace(borrowed=lambda: SimpleNamespace(shift=np.array(shift)))

    adapter, prompt = Req("r1", [1, 2, 3]), Req("r2", [1, 2, 3])
    adapter.lora_id = adapter.extra_key = "solver"
    h.cache.requests.lora_share = "borrow"
    assert not h.cache._rereads(adapter, handle([0, 0, 0]))  # the owner's own positions
    assert h.cache._rereads(adapter, handle([0, 7, 7]))
    assert h.cache._rereads(prompt, handle([0, 0, 0]))  # prompt agents: as measured before
    h.cache._overlap = True  # a launched batch may read the row: only behind a fence
    assert not h.cache._rereads(adapter, handle([0, 7, 7]))  # none registered on CPU
