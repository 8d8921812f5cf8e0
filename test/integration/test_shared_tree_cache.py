"""KvcmasSharedTreeCache without a server: composite matches, span metadata, cache_salt
isolation, slot conservation, and parity with RadixCache when sharing is off."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from sglang_kvcmas.tree.template_markers import TemplateMarkers  # noqa: E402
from sglang_kvcmas.integration.shared_tree_cache import (  # noqa: E402
    KvcmasSharedTreeCache,
    SharedPrefixHandle,
)
from sglang_kvcmas.policy.leaf_mode import LeafConfig  # noqa: E402
from sglang_kvcmas.policy.recompute import RecomputeConfig  # noqa: E402

NL = 5
CHAT = TemplateMarkers.chatml(1, 2, NL, system=(9,), user=(7,), assistant=(8,))


def head(agent_tok: int, n: int) -> list[int]:
    return [1, 9, NL] + [agent_tok] * n + [2, NL]


T1 = [1, 7, NL] + list(range(100, 140))
T2 = list(range(200, 230))
SUFFIX = [2, NL, 1, 8, NL]
END = 2  # the user turn's <|im_end|>\n is shared context too; the opener <|im_start|>... is not


class Allocator:
    device = "cpu"

    def __init__(self):
        self.freed: list[int] = []

    def free(self, idx):
        self.freed.extend(int(i) for i in idx)

    def free_segment(self, idx, *, start_pos):
        self.free(idx)


class Pool:
    def __init__(self):
        self.req_to_token = torch.zeros(8, 512, dtype=torch.int64)

    def write(self, where, values):
        self.req_to_token[where] = values


class Req:
    def __init__(self, rid, ids, salt=None):
        self.rid, self.cache_salt, self.extra_key = rid, salt, None
        self.origin_input_ids = array("q", ids)
        self.full_untruncated_fill_ids = array("q", ids)
        self.sampling_params = SimpleNamespace(custom_params=None)
        self.kv = SimpleNamespace(req_pool_idx=None, cache_protected_len=0, cache_inserted_len=0,
                                  swa_evict_floor=0)
        self.lock = self.last_node = self.customized_info = None
        self.prefix_len, self.priority, self.done = 0, None, False

    def finished(self):
        return self.done


class Harness:
    def __init__(self, share=True, boundary=0, min_borrowed=0):
        self.alloc, self.pool = Allocator(), Pool()
        self.cache = KvcmasSharedTreeCache(
            CacheInitParams(disable=False, req_to_token_pool=self.pool,
                            token_to_kv_pool_allocator=self.alloc, page_size=1),
            markers=CHAT, share_context=share)
        self.cache.recompute_config = RecomputeConfig(boundary_tokens=boundary,
                                                      min_borrowed=min_borrowed)
        # Exact leaves (the tree's pool-slot invariants these tests check); the factored
        # default has its own tests (test_factored_leaves.py).
        self.cache.leaf_config = LeafConfig("exact")
        self.next_slot, self.allocated = 1000, []

    def match(self, req):
        """Match the request's prefix and adopt it, as SGLang's ``match_kv_cache``."""
        n = len(req.origin_input_ids)
        res = self.cache.match_prefix(MatchPrefixParams(
            key=RadixKey(req.origin_input_ids, None, cache_salt=req.cache_salt, limit=n - 1),
            req=req))
        req.prefix_len, req.last_node = res.device_prefix_len, res.last_device_node
        req.kv.cache_protected_len = req.num_matched_prefix_tokens = req.prefix_len

    def serve(self, req, row, mass=None, outputs=()):
        """Match, lock, allocate, prefill, checkpoint, finish and release, as the scheduler.

        ``mass(i)`` stands in for the backend's head-mass probe: the mass of row index i.
        ``outputs``: tokens the request generated; its last checkpoint covers them too."""
        n = len(req.origin_input_ids)
        total = n + len(outputs)
        if outputs:
            req.full_untruncated_fill_ids = array("q", [*req.origin_input_ids, *outputs])
        self.match(req)
        req.lock = self.cache.lock(req.last_node)
        prefix = (self.cache.prefix_device_indices(req) if req.prefix_len
                  else torch.empty(0, dtype=torch.int64))
        new = torch.arange(self.next_slot, self.next_slot + total - req.prefix_len)
        self.next_slot += len(new)
        self.allocated += new.tolist()
        self.pool.req_to_token[row, :total] = torch.cat([prefix, new])
        req.kv.req_pool_idx = row
        self.cache.maybe_hand_to_session(req)
        entry = getattr(req, "kvcmas_row", None)
        probe = entry.probe if entry is not None else None
        if probe is not None and mass is not None:
            probe.add(req.prefix_len, torch.tensor([mass(i) for i in range(req.prefix_len, n)]))
        spans = entry.spans if entry is not None else None
        prefix_slots = self.pool.req_to_token[row, : req.prefix_len].tolist()
        self.cache.checkpoint(req, up_to=n)
        req.done = True
        self.cache.checkpoint(req, up_to=total)
        self.alloc.free(self.pool.req_to_token[row, req.kv.cache_protected_len : total])
        self.cache.unlock(req.lock)
        self.cache.on_release(req, checkpointed=True)
        assert self.cache.shared.check_invariants() == []
        return spans, prefix_slots

    def held(self) -> set[int]:
        radix = set(self.cache.all_values_flatten().tolist()) if self.cache.root_node.children else set()
        owned = {int(s) for n in self.cache.shared.nodes() if n.owns_slots for s in n.slots}
        leaves = {int(s) for n in self.cache.shared.nodes() for d in n.exact_leaves.values()
                  for s in d.slots}
        return radix | owned | leaves


def test_reader_borrows_owner_span_with_shift():
    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)  # b's head is not cached yet: exact
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)  # a owns T2
    a2_slots = h.pool.req_to_token[2, len(a) + len(T1) : len(a) + len(T1) + len(T2) + END].tolist()
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, prefix = h.serve(b2, 3)
    assert b2.prefix_len == len(b) + len(T1) + len(T2) + END
    assert prefix[len(b) + len(T1):] == a2_slots  # a's KV, one copy
    (read,) = spans.reads
    assert (read.start, read.length, read.shift) == (
        len(b) + len(T1), len(T2) + END, len(b) - len(a))
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert rec["reused_repositioned"] == len(T2) + END and rec["reused_exact"] == len(b) + len(T1)
    # conservation: every allocated slot is freed exactly once or still held by a tree
    assert len(h.alloc.freed) == len(set(h.alloc.freed))
    assert set(h.alloc.freed) | h.held() == set(h.allocated)
    assert not set(h.alloc.freed) & h.held()


def test_cache_salt_isolation():
    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX, salt="tenant1"), 0)
    h.serve(Req("b1", b + T1 + SUFFIX, salt="tenant2"), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX, salt="tenant1"), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX, salt="tenant2")
    spans, _ = h.serve(b2, 3)
    assert spans is None and not isinstance(b2.last_node, SharedPrefixHandle)
    assert b2.prefix_len == len(b) + len(T1)  # only its own (exact) prefix


def test_reader_publishes_its_new_tokens_for_the_next_reader():
    h = Harness()
    a, b, c = head(50, 20), head(60, 8), head(70, 12)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1), ("c1", c, 2)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + SUFFIX[:0] + T2[:10] + SUFFIX), 3)
    h.serve(Req("b2", b + T1 + T2 + SUFFIX), 4)  # borrows T2[:10] from a, owns T2[10:]
    spans, _ = h.serve(Req("c2", c + T1 + T2 + SUFFIX), 5)
    owners = [r.shift for r in spans.reads]
    assert owners == [len(c) - len(a), len(c) - len(b)]
    assert len(h.alloc.freed) == len(set(h.alloc.freed))
    assert set(h.alloc.freed) | h.held() == set(h.allocated)


def test_sharing_off_is_radix_cache():
    on, off = Harness(share=True), Harness(share=False)
    for hrn in (on, off):
        hrn.serve(Req("a1", head(50, 20) + T1 + SUFFIX), 0)
        hrn.serve(Req("b1", head(60, 8) + T1 + SUFFIX), 1)
    b2 = Req("b2", head(60, 8) + T1 + T2 + SUFFIX)
    spans, _ = off.serve(b2, 2)
    assert spans is None and b2.prefix_len == len(head(60, 8)) + len(T1)
    assert len(list(off.cache.shared.nodes())) == 0


def assert_slots_conserved(h):
    assert len(h.alloc.freed) == len(set(h.alloc.freed))
    assert set(h.alloc.freed) | h.held() == set(h.allocated)
    assert not set(h.alloc.freed) & h.held()


def test_reader_recomputes_boundary_tokens_of_the_borrowed_span():
    k = 4
    h = Harness(boundary=k)
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    start = len(a) + len(T1)
    a2_slots = h.pool.req_to_token[2, start : start + len(T2) + END].tolist()
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, prefix = h.serve(b2, 3)
    borrowed_at = len(b) + len(T1)  # b's own exact prefix ends here; T2 is a's
    assert b2.prefix_len == borrowed_at + len(T2) + END - k
    assert prefix[borrowed_at:] == a2_slots[k:]  # the boundary is not borrowed
    moved = spans.recomputed
    assert moved.row_start == b2.prefix_len
    assert moved.token_ids == tuple(T2[:k])
    assert moved.positions == tuple(range(borrowed_at, borrowed_at + k))
    (read,) = spans.reads  # still one span, in row coordinates, same shift
    assert (read.start, read.length, read.shift) == (
        borrowed_at, len(T2) + END - k, len(b) - len(a))
    pos = spans.positions_upto(len(b2.origin_input_ids)).tolist()
    assert pos[:borrowed_at] == list(range(borrowed_at))
    assert pos[borrowed_at : b2.prefix_len] == list(range(borrowed_at + k, b2.prefix_len + k))
    assert pos[b2.prefix_len : b2.prefix_len + k] == list(range(borrowed_at, borrowed_at + k))
    assert pos[b2.prefix_len + k :] == list(range(b2.prefix_len + k, len(pos)))
    assert sorted(pos) == list(range(len(pos)))
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert rec["reused_repositioned"] == len(T2) + END - k
    assert rec["recomputed"] == k + len(SUFFIX) - END
    assert (rec["recomputed_borrowed"], rec["exact_from_leaves"]) == (k, 0)
    assert_slots_conserved(h)


def test_recompute_boundary_per_span_and_slots_when_the_reader_publishes():
    """Two borrowed spans (two owners): each boundary recomputed; a reader that also publishes
    new transcript tokens frees its recomputed slots at release, once."""
    k = 3
    h = Harness(boundary=k)
    a, b, c = head(50, 20), head(60, 8), head(70, 12)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1), ("c1", c, 2)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2[:10] + SUFFIX), 3)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    h.serve(b2, 4)  # borrows T2[:10] from a (boundary recomputed), owns T2[10:]
    assert b2.customized_info["kvcmas_reuse"][0]["recomputed"] == k + len(T2) - 10 + len(
        SUFFIX)
    assert_slots_conserved(h)
    c2 = Req("c2", c + T1 + T2 + SUFFIX)
    spans, _ = h.serve(c2, 5)
    at = len(c) + len(T1)
    assert spans.recomputed.positions == (*range(at, at + k), *range(at + 10, at + 10 + k))
    assert [r.shift for r in spans.reads] == [len(c) - len(a), len(c) - len(b)]
    assert_slots_conserved(h)


def test_boundary_policy_per_request_and_disabled_for_prompt_logprobs():
    h = Harness(boundary=4)
    a, b = head(50, 20), head(60, 8)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    b2.sampling_params = SimpleNamespace(custom_params={"kvcmas_recompute_boundary": 0})
    spans, _ = h.serve(b2, 3)
    assert spans.recomputed is None and spans.positions is None
    b3 = Req("b3", b + T1 + T2 + SUFFIX)
    b3.return_logprob, b3.logprob_start_len = True, 0  # prompt logprobs: keep token order
    spans, _ = h.serve(b3, 4)
    assert spans.recomputed is None
    assert_slots_conserved(h)


def test_recomputed_boundary_becomes_the_readers_delta_leaf():
    """The boundary a reader recomputed is kept as its exact leaf: its next turn over the same
    span reads those tokens exactly (own slots, no shift) and recomputes nothing there; another
    reader still recomputes its own; leaves are evictable like any cached KV."""
    k = 4
    h = Harness(boundary=k)
    a, b, c = head(50, 20), head(60, 8), head(70, 12)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1), ("c1", c, 2)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 3)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    h.serve(b2, 4)
    at = len(b) + len(T1)
    recomputed_slots = h.pool.req_to_token[4, b2.prefix_len : b2.prefix_len + k].tolist()
    assert h.cache.shared.exact_leaf_tokens() == k
    assert h.cache.shared_stats()["exact_leaf_tokens"] == k
    b3 = Req("b3", b + T1 + T2 + SUFFIX + [9])  # b again, same transcript
    spans, prefix = h.serve(b3, 5)
    assert b3.prefix_len == at + len(T2) + END  # nothing recomputed
    assert prefix[at : at + k] == recomputed_slots  # its own exact KV
    assert spans.recomputed is None
    (read,) = spans.reads  # the rest of the span, re-positioned
    assert (read.start, read.length) == (at + k, len(T2) + END - k)
    rec = b3.customized_info["kvcmas_reuse"][0]
    assert rec["reused_repositioned"] == len(T2) + END - k
    assert rec["reused_exact"] == at + k
    assert (rec["recomputed_borrowed"], rec["exact_from_leaves"]) == (0, k)
    b4 = Req("b4", b + T1 + T2 + SUFFIX + [8])
    b4.sampling_params = SimpleNamespace(custom_params={"kvcmas_recompute_boundary": 0})
    h.serve(b4, 7)  # an explicit boundary measures the owner's KV alone: no leaf read
    assert b4.customized_info["kvcmas_reuse"][0]["reused_repositioned"] == len(T2) + END
    assert h.cache.shared.exact_leaf_tokens() == k
    c2 = Req("c2", c + T1 + T2 + SUFFIX)
    spans, _ = h.serve(c2, 6)
    assert len(spans.recomputed.token_ids) == k  # c has no leaf: it recomputes its own
    assert h.cache.shared.exact_leaf_tokens() == 2 * k
    assert_slots_conserved(h)
    assert h.cache.evictable_size() == len(h.held())  # leaves are evictable once unlocked
    h.cache.evict(EvictParams(num_tokens=10**6))
    assert h.cache.shared.exact_leaf_tokens() == 0 and h.cache.evictable_size() == 0
    assert_slots_conserved(h)


def test_eviction_frees_leaves_and_owned_nodes_before_exact_radix_nodes():
    """What is cheapest to lose goes first: a reader's exact leaves and the approximate nodes
    it owns are evicted before any exact radix node (the owners' paths anchoring the bases)."""
    k = 4
    h = Harness(boundary=k)
    a, b, c = head(50, 20), head(60, 8), head(70, 12)
    for rid, hd, row in (("a1", a, 0), ("b1", b, 1), ("c1", c, 2)):
        h.serve(Req(rid, hd + T1 + SUFFIX), row)
    h.serve(Req("a2", a + T1 + T2[:10] + SUFFIX), 3)
    h.serve(Req("b2", b + T1 + T2 + SUFFIX), 4)  # leaves on a's T2[:10], owns T2[10:]
    leaves, owned = h.cache.shared.exact_leaf_tokens(), h.cache.shared.owned_size
    assert leaves == k and owned > leaves
    radix = h.cache.evictable_size() - h.cache.shared.evictable_owned_size()
    assert h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted >= 1
    assert h.cache.evictable_size() - h.cache.shared.evictable_owned_size() == radix
    h.cache.evict(EvictParams(num_tokens=h.cache.shared.owned_size))
    assert h.cache.shared.owned_size == 0  # every leaf and owned node went first
    assert h.cache.evictable_size() == radix  # and no exact radix node
    h.cache.evict(EvictParams(num_tokens=1))
    assert h.cache.evictable_size() < radix  # only then the radix LRU
    assert_slots_conserved(h)


def test_reader_recomputes_the_tokens_with_the_largest_owner_head_mass():
    """The owner's pass records each new shared token's head mass on the shared node; a reader
    recomputes its boundary plus the largest-mass tokens (mass_fraction of what it borrows)."""
    h = Harness(boundary=2)
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=2, mass_fraction=0.1, min_borrowed=0,
                                               max_fraction=0.5)
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    t2_at = len(a) + len(T1)
    peaks = {t2_at + 7, t2_at + 20, t2_at + 25}  # the owner's tokens that read its head most
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2, mass=lambda i: 0.9 if i in peaks else 0.01)
    (node,) = [n for n in h.cache.shared.nodes() if n.head_mass is not None and
               float(n.head_mass.max()) > 0.5]
    assert sorted((node.head_mass > 0.5).nonzero().flatten().tolist()) == [7, 20, 25]
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)
    at = len(b) + len(T1)
    borrowed = len(T2) + END
    n_mass = round(0.1 * borrowed)  # 3
    assert spans.recomputed.positions == (at, at + 1, at + 7, at + 20, at + 25)[: 2 + n_mass]
    assert b2.customized_info["kvcmas_reuse"][0]["reused_repositioned"] == borrowed - 2 - n_mass
    b3 = Req("b3", b + T1 + T2 + SUFFIX + [9])  # b again: its leaves hold the top tokens now
    spans, _ = h.serve(b3, 4)
    assert spans.recomputed is None
    assert b3.customized_info["kvcmas_reuse"][0]["exact_from_leaves"] == 2 + n_mass
    assert_slots_conserved(h)


def test_a_reader_recomputes_the_first_tokens_of_each_new_segment_of_one_owner():
    """a computes T1, then T2 after it; b borrowed T1 (its boundary now b's leaves), and over
    T1 + T2 recomputes T2's first tokens: one owner, one shift, but two segments, two spans."""
    from sglang_kvcmas.tree.borrowed import borrowed_spans

    h = Harness(boundary=4)
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a0", a + [1, 7, NL, 900, 901] + SUFFIX), 0)  # both heads cached, nothing shared
    h.serve(Req("b0", b + [1, 7, NL, 910, 911] + SUFFIX), 1)
    h.serve(Req("a1", a + T1 + SUFFIX), 2)
    spans, _ = h.serve(Req("b1", b + T1 + SUFFIX), 3)
    at = len(b)
    assert spans.recomputed.positions == tuple(range(at + 3, at + 7))  # b0 computed T1[:3]
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 4)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    h.match(b2)
    got = borrowed_spans(b2.last_node)
    assert [(s.begin, s.end) for s in got] == [(3, len(T1)), (len(T1), len(T1) + len(T2) + END)]
    assert len({(s.owner, s.shift) for s in got}) == 1  # one owner, one shift: split by segment
    assert b2.last_node.recompute == tuple(range(len(T1), len(T1) + 4))


def test_readers_that_waited_together_split_the_segment_share(monkeypatch):
    """b and c wait for a's new segment in one pass: the hook records 2 readers on each, so
    each recomputes segment_share / 2 of its borrowed tokens by mass, where a reader that
    waited alone (d) recomputes the whole mass share."""
    from sglang_kvcmas.integration import turn_order_hook
    from sglang_kvcmas.integration.agent_requests import readers_of

    h = Harness()
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=0, mass_fraction=0.2,
                                               segment_share=0.2, min_borrowed=0,
                                               max_fraction=0.5)
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    a, b, c, d = head(50, 20), head(60, 8), head(70, 9), head(80, 10)
    for row, agent in enumerate((a, b, c, d)):
        h.serve(Req(f"x{row}", agent + T1 + SUFFIX), row)  # every head cached
    t2_at = len(a) + len(T1)
    ranked = [7, 20, 25, 11, 14, 29]  # owner head mass, largest first
    mass = {t2_at + o: 0.9 - 0.1 * r for r, o in enumerate(ranked)}
    a2, b2, c2 = (Req(f"{n}2", x + T1 + T2 + SUFFIX) for n, x in (("a", a), ("b", b), ("c", c)))
    scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=[a2, b2, c2])
    seen = []
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen == [["a2"]] and (readers_of(a2), readers_of(b2), readers_of(c2)) == (1, 2, 2)
    h.serve(a2, 4, mass=lambda i: mass.get(i, 0.01))
    borrowed = len(T2) + END  # 32: 6 by mass at 20%, 3 at 20% / 2
    at = len(b) + len(T1)
    spans, _ = h.serve(b2, 5)
    assert spans.recomputed.positions == tuple(at + o for o in sorted(ranked[:3]))
    spans, _ = h.serve(Req("d2", d + T1 + T2 + SUFFIX), 6)
    at = len(d) + len(T1)
    assert spans.recomputed.positions == tuple(at + o for o in sorted(ranked))
    assert round(0.2 * borrowed) == 6
    assert_slots_conserved(h)


def test_turn_order_holds_a_reader_back_from_when_it_is_first_held(monkeypatch):
    """The wait bound counts from the first hold, not from arrival: a reader that queued for
    longer than the bound before its leader showed up still waits for the leader, and is
    released once it has been held for the bound."""
    from sglang_kvcmas.integration import turn_order_hook

    h = Harness()
    a, b, t2 = head(50, 20), head(60, 8), list(range(200, 260))
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)  # b's head is cached: b can borrow
    leader, reader = Req("a2", a + T1 + t2 + SUFFIX), Req("b2", b + T1 + t2 + SUFFIX)
    clock = [0.0]
    monkeypatch.setattr(turn_order_hook.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    max_wait = h.cache.turn_config.max_wait_s
    scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=[])
    seen = []

    def build_batch(s):
        seen.append([r.rid for r in s.waiting_queue])

    # (time, queue): alone (nobody to wait for), then with its leader for longer than the bound
    after = []
    for t, queue in ((0.0, [reader]), (max_wait + 5, [leader, reader]),
                     (2 * max_wait + 4, [leader, reader]), (2 * max_wait + 6, [leader, reader])):
        clock[0], scheduler.waiting_queue = t, list(queue)
        turn_order_hook.turn_order_around(build_batch, scheduler)
        after.append([r.rid for r in scheduler.waiting_queue])
    assert seen == [["b2"], ["a2"], ["a2"], ["a2", "b2"]]  # what each prefill decision saw
    assert after == [["b2"], ["b2", "a2"], ["b2", "a2"], ["a2", "b2"]]  # held: back in front


def test_turn_order_lets_the_agent_holding_the_transcript_exactly_lead(monkeypatch):
    """a computed t2 itself, b borrowed it: over the next segment a leads even when b's request
    is first in the queue, so a's turn reads nothing approximate."""
    from sglang_kvcmas.integration import turn_order_hook

    h = Harness()
    a, b = head(50, 20), head(60, 8)
    t2, t3 = list(range(200, 260)), list(range(300, 360))
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)  # b's head is cached: b can borrow
    h.serve(Req("a2", a + T1 + t2 + SUFFIX), 2)
    h.serve(Req("b2", b + T1 + t2 + SUFFIX), 3)  # b borrows t2 from a
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    ahead, behind = Req("b3", b + T1 + t2 + t3 + SUFFIX), Req("a3", a + T1 + t2 + t3 + SUFFIX)
    assert h.cache.radix_peek(behind, len(a + T1 + t2)) == len(a + T1 + t2)
    assert h.cache.radix_peek(ahead, len(b + T1 + t2)) == len(b + T1)
    scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=[ahead, behind])
    seen = []
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen == [["a3"]]


def test_a_request_can_ask_to_read_no_other_agents_kv():
    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    b2.sampling_params.custom_params = {"kvcmas_exact": True}
    spans, _ = h.serve(b2, 3)
    assert spans is None and not isinstance(b2.last_node, SharedPrefixHandle)
    assert b2.prefix_len == len(b) + len(T1)  # only its own exact prefix, as the radix cache
    # a non-boolean never reaches the scheduler (400); if one did, it is served without sharing
    odd = SimpleNamespace(rid="x", origin_input_ids=b + T1 + SUFFIX,
                          sampling_params=SimpleNamespace(custom_params={"kvcmas_exact": "yes"}))
    assert not h.cache.requests.wants_exact(odd) and h.cache.requests.split(odd) is None


def test_a_reader_computes_a_short_foreign_span_exactly():
    """Below ``min_borrowed`` foreign tokens a reader borrows nothing (and a turn-order wait for
    them would buy nothing); at or above it, it borrows."""
    from sglang_kvcmas.integration import turn_order_hook

    long_t2 = list(range(300, 360))
    for t2, borrows in ((T2, False), (long_t2, True)):
        h = Harness(min_borrowed=len(long_t2))
        a, b = head(50, 20), head(60, 8)
        h.serve(Req("a1", a + T1 + SUFFIX), 0)
        h.serve(Req("b1", b + T1 + SUFFIX), 1)
        leader, reader = Req("a2", a + T1 + t2 + SUFFIX), Req("b2", b + T1 + t2 + SUFFIX)
        scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=[leader, reader])
        seen = []
        turn_order_hook.turn_order_around(
            lambda s: seen.append([r.rid for r in s.waiting_queue]), scheduler)
        assert seen == [["a2"] if borrows else ["a2", "b2"]]
        h.serve(leader, 2)
        spans, _ = h.serve(reader, 3)
        assert (spans is not None) == borrows
        assert reader.prefix_len == len(b) + len(T1) + (len(t2) + END if borrows else 0)


def test_reader_recomputes_the_tail_of_what_it_borrows():
    """``tail_tokens``: the last borrowed tokens (just before the reader's suffix) are recomputed
    at their true positions, on top of the boundary."""
    h = Harness(boundary=2)
    h.cache.recompute_config = RecomputeConfig(boundary_tokens=2, mass_fraction=0.0,
                                               min_borrowed=0, tail_tokens=3)
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)
    borrowed_at, shared = len(b) + len(T1), T2 + SUFFIX[:END]
    moved = spans.recomputed
    assert moved.token_ids == (*shared[:2], *shared[-3:])
    n = len(shared)
    assert moved.positions == (borrowed_at, borrowed_at + 1,
                               *range(borrowed_at + n - 3, borrowed_at + n))
    assert b2.customized_info["kvcmas_reuse"][0]["recomputed_borrowed"] == 5
    assert_slots_conserved(h)


def test_a_chunked_leader_stays_pending_until_its_last_chunk(monkeypatch):
    """SGLang checkpoints a chunked prefill after every chunk: the leader's first chunks
    publish part of the new segment, and its readers must still wait for the rest."""
    from sglang_kvcmas.integration import turn_order_hook

    h = Harness()
    a, b, t2 = head(50, 20), head(60, 8), list(range(200, 460))
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    leader, reader = Req("a2", a + T1 + t2 + SUFFIX), Req("b2", b + T1 + t2 + SUFFIX)
    n = len(leader.origin_input_ids)
    h.match(leader)
    leader.lock = h.cache.lock(leader.last_node)
    prefix = h.cache.prefix_device_indices(leader)
    h.pool.req_to_token[2, :n] = torch.cat([prefix, torch.arange(5000, 5000 + n - len(prefix))])
    leader.kv.req_pool_idx = 2
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=[])
    seen = []
    for chunk_end in (leader.prefix_len + 64, leader.prefix_len + 128, n):
        h.cache.maybe_hand_to_session(leader)  # SGLang hands the row over at every chunk
        h.cache.checkpoint(leader, up_to=chunk_end)
        scheduler.waiting_queue = [reader]
        turn_order_hook.turn_order_around(
            lambda s: seen.append([r.rid for r in s.waiting_queue]), scheduler)
    assert seen == [[], [], ["b2"]]  # held while a2 has t2 left to compute, then released
    assert "a2" not in h.cache.pending_owners


def test_a_reader_that_recomputes_is_admitted_whole_or_not_at_all():
    """``admission_hook``: a reader whose extend SGLang would cut ends the batch before it
    when the batch holds others, and drops its recompute when even an empty batch would cut
    it (its prefix then ends at the shared context's end); other admissions pass through."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_kvcmas.integration.admission_hook import admission_around

    k = 4
    h = Harness(boundary=k)
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    n = len(b2.origin_input_ids)
    h.match(b2)
    assert h.cache.recomputes(b2)
    calls = []

    def select(adder, req, budget):
        calls.append(req.prefix_len)
        return SimpleNamespace(is_chunked=n - req.prefix_len > budget)

    whole = SimpleNamespace(tree_cache=h.cache, can_run_list=[])
    assert not admission_around(select, whole, b2, n).is_chunked  # fits: untouched
    busy = SimpleNamespace(tree_cache=h.cache, can_run_list=["other"])
    assert admission_around(select, busy, b2, 2) is AddReqResult.OTHER
    assert h.cache.recomputes(b2) and b2.prefix_len == calls[0]
    before = b2.prefix_len
    assert admission_around(select, whole, b2, 2).is_chunked  # cut as a plain reader
    assert not h.cache.recomputes(b2)
    assert b2.prefix_len == b2.kv.cache_protected_len == b2.num_matched_prefix_tokens == before + k
    assert b2.prefix_len == len(b + T1 + T2) + END
    assert calls == [before, before, before, before + k]


def test_a_fault_in_our_match_serves_the_request_exactly_and_stops_sharing_there(monkeypatch):
    """An internal error of ours inside the scheduler fails (here: exactly serves) one request
    and turns sharing off for its namespace, instead of raising through the event loop."""
    from sglang_kvcmas.integration import shared_tree_cache as stc

    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)

    def broken(handle):
        raise RuntimeError("injected")

    monkeypatch.setattr(stc, "borrowed_spans", broken)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    spans, _ = h.serve(b2, 3)  # no exception reaches the scheduler
    assert spans is None and b2.prefix_len == len(b) + len(T1)  # its own exact prefix only
    assert h.cache.faults == 1 and (None, None) in h.cache.broken_namespaces
    monkeypatch.undo()
    b3 = Req("b3", b + T1 + T2 + SUFFIX + [77])
    spans, _ = h.serve(b3, 4)
    assert spans is None  # sharing stays off in that namespace
    c = Req("c1", b + T1 + SUFFIX, salt="other")
    h.serve(c, 5)  # other namespaces share as before
    assert h.cache.shared.check_invariants() == []


def test_a_fault_at_hand_off_fails_only_that_reader(monkeypatch):
    from sglang_kvcmas.integration import shared_tree_cache as stc

    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(stc, "row_spans", broken)
    b2 = Req("b2", b + T1 + T2 + SUFFIX)
    b2.to_finish = None
    spans, _ = h.serve(b2, 3)
    assert spans is None and b2.to_finish is not None  # aborted with a message, not raised
    assert "internal error" in b2.to_finish.message and h.cache.faults == 1
    assert h.cache.shared.check_invariants() == []


def test_requests_that_never_reach_release_leave_nothing_behind():
    """A request parsed while it waits (turn order reads its split every pass) and then aborted
    before it is scheduled never reaches ``on_release``; the cache keeps nothing for it."""
    h = Harness()
    a = head(50, 20)
    sizes = {k: len(v) for k, v in vars(h.cache).items() if isinstance(v, (dict, set, list))}
    for i in range(50):
        waiting = Req(f"w{i}", a + T1 + [300 + i] + SUFFIX)
        requests = h.cache.requests
        assert requests.split(waiting) is not None and not requests.wants_exact(waiting)
    after = {k: len(v) for k, v in vars(h.cache).items() if isinstance(v, (dict, set, list))}
    assert after == sizes


def test_first_requests_wait_for_the_leader_while_their_heads_are_prefilled(monkeypatch):
    """Three agents open on the same transcript with none of their heads cached. Unmarked,
    nobody waits (none could borrow); marked ``kvcmas_head_first`` (their heads are being
    prefilled on their own), b and c wait for a, and once their heads and a's transcript are
    cached they borrow it."""
    from sglang_kvcmas.integration import turn_order_hook

    h = Harness()
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    monkeypatch.setattr(turn_order_hook, "_head_wait_since", {})
    a, b, c = head(50, 20), head(60, 8), head(70, 9)
    firsts = [Req(f"{n}1", x + T1 + SUFFIX) for n, x in (("a", a), ("b", b), ("c", c))]
    scheduler = SimpleNamespace(tree_cache=h.cache, waiting_queue=list(firsts))
    seen = []
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen == [["a1", "b1", "c1"]]  # no head cached and none coming: nobody waits
    marked = [Req(f"{n}2", x + T1 + SUFFIX) for n, x in (("a", a), ("b", b), ("c", c))]
    for req, x in zip(marked, (a, b, c)):
        req.sampling_params.custom_params = {"kvcmas_head_len": len(x),
                                             "kvcmas_head_first": True}
    scheduler.waiting_queue = list(marked)
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen[-1] == ["a2"] and [r.rid for r in scheduler.waiting_queue] == ["b2", "c2", "a2"]
    h.serve(marked[0], 0)  # the leader computes the transcript
    scheduler.waiting_queue = marked[1:]
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen[-1] == []  # the transcript is there, their heads not yet: they wait for them
    for row, x in enumerate((b, c), start=1):  # the head requests
        head_req = Req(f"head{row}", x)
        head_req.sampling_params.custom_params = {"kvcmas_head_len": len(x),
                                                  "kvcmas_shared_end": len(x),
                                                  "kvcmas_exact": True}
        h.serve(head_req, row)
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      scheduler)
    assert seen[-1] == ["b2", "c2"]
    h.serve(marked[1], 3)
    waiting = [Req("x", a), Req("kvcmas-head-1", b), Req("y", c), Req("kvcmas-head-2", c)]
    assert [r.rid for r in turn_order_hook._heads_first(waiting)] == [
        "kvcmas-head-1", "kvcmas-head-2", "x", "y"]  # head requests go first
    assert marked[1].customized_info["kvcmas_reuse"][0]["reused_repositioned"] > 0  # a's
    assert_slots_conserved(h)


def test_a_cache_reset_empties_the_shared_tree_and_restarts_its_peaks():
    """``/flush_cache`` (SGLang's reset, nothing running): the shared tree empties and the
    high-water marks count from there, so a benchmark can measure one workload's peak after
    another's on the same server."""
    from sglang_kvcmas.attention.deviation_factors import MaterializedBytes

    h = Harness()
    a, b = head(50, 20), head(60, 8)
    h.serve(Req("a1", a + T1 + SUFFIX), 0)
    h.serve(Req("b1", b + T1 + SUFFIX), 1)
    h.serve(Req("a2", a + T1 + T2 + SUFFIX), 2)
    h.cache.peak_held = 123
    MaterializedBytes.peak = MaterializedBytes.now + 456
    assert h.cache.shared_stats()["shared_tokens"] > 0
    h.cache.reset()
    stats = h.cache.shared_stats()
    assert stats["shared_tokens"] == 0 and stats["peak_held_tokens"] == 0
    assert MaterializedBytes.peak == MaterializedBytes.now
    assert not h.cache.pending_owners
