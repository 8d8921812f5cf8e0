"""An adapter reader's picks (``policy/lora_share.py``): under ``lora_share=borrow`` a
reader that names an adapter recomputes at least the last ``LORA_RECOMPUTE_TAIL`` borrowed tokens
before its suffix, the first ``LORA_RECOMPUTE_BOUNDARY`` of every span and message, and the LoRA
share by owner head mass, each in place of the deployment's (the tree cache, no server); a
request's own ``kvcmas_recompute_tail`` / ``kvcmas_recompute_boundary`` /
``kvcmas_recompute_mass_fraction`` and requests without an adapter are left as they are."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from test_shared_tree_cache import END, NL, SUFFIX, T1, T2, Harness, Req, head  # noqa: E402


@pytest.fixture(autouse=True)
def lora_picks(monkeypatch):
    """``lora_picks(tail=, boundary=, mass=)``: an adapter reader's picks as the tree cache reads
    them (``policy/lora_share.py``); the boundary starts at 0, the harness's deployment boundary
    (``lora_picks(served=True)``: the served ones)."""
    from sglang_kvcmas.integration import shared_tree_cache

    names = {"tail": "LORA_RECOMPUTE_TAIL", "boundary": "LORA_RECOMPUTE_BOUNDARY",
             "mass": "LORA_RECOMPUTE_MASS_FRACTION"}
    served = {k: getattr(shared_tree_cache, v) for k, v in names.items()}

    def set_picks(served_picks: bool = False, **values) -> None:
        for k, v in {**(served if served_picks else {}), **values}.items():
            monkeypatch.setattr(shared_tree_cache, names[k], v)

    set_picks(boundary=0)
    return set_picks


class LoraHarness(Harness):
    """The harness with SGLang's radix key as a LoRA request has it: the adapter id in
    ``extra_key``, so each adapter matches only its own radix prefixes."""

    def match(self, req):
        n = len(req.origin_input_ids)
        res = self.cache.match_prefix(MatchPrefixParams(
            key=RadixKey(req.origin_input_ids, req.extra_key, cache_salt=req.cache_salt,
                         limit=n - 1), req=req))
        req.prefix_len, req.last_node = res.device_prefix_len, res.last_device_node
        req.kv.cache_protected_len = req.num_matched_prefix_tokens = req.prefix_len


def _req(rid: str, ids: list[int], adapter: str | None) -> Req:
    req = Req(rid, ids)
    if adapter is not None:
        req.lora_id = req.extra_key = adapter  # SGLang appends the adapter id to extra_key
    return req


def _recomputed(lora_picks, tail: int | None, adapter: str | None, mode: str = "borrow",
                lora_mass: float = 0.0, mass: float = 0.0, custom: dict | None = None) -> int:
    """Borrowed tokens a second agent recomputes when it reads the first one's T2 (each agent's
    head cached by its first turn, as a reader can only borrow after its own head); the owner's
    pass records head mass 0.9 on three of T2's tokens (``tail`` / ``lora_mass``: the LoRA tail
    and share by mass, None: the served picks; ``mass``: the deployment's share by mass;
    ``custom``: the reader's own knobs)."""
    if tail is None:
        lora_picks(served_picks=True)
    else:
        lora_picks(tail=tail, mass=lora_mass)
    h = LoraHarness(boundary=0)
    h.cache.requests.lora_share = mode
    h.cache.recompute_config = replace(h.cache.recompute_config, mass_fraction=mass)
    a, b = head(50, 20), head(60, 8)
    owner = "planner"  # another adapter
    h.serve(_req("a1", a + T1 + SUFFIX, adapter and owner), 0)
    h.serve(_req("b1", b + T1 + SUFFIX, adapter), 1)
    peaks = {len(a) + len(T1) + i for i in (3, 9, 17)}
    h.serve(_req("a2", a + T1 + T2 + SUFFIX, adapter and owner), 2,  # it owns T2
            mass=lambda i: 0.9 if i in peaks else 0.01)
    b2 = _req("b2", b + T1 + T2 + SUFFIX, adapter)
    if custom:
        b2.sampling_params.custom_params = custom
    h.serve(b2, 3)
    rec = b2.customized_info["kvcmas_reuse"][0]
    assert rec["reused_repositioned"] + rec["recomputed_borrowed"] == len(T2) + END
    return rec["recomputed_borrowed"]


def test_an_adapter_reader_recomputes_the_tail(lora_picks):
    assert _recomputed(lora_picks, 0, "solver") == 0  # no boundary, no head mass recorded here
    assert _recomputed(lora_picks, 8, "solver") == 8
    with pytest.raises(AssertionError):  # separate: nothing borrowed across adapters
        _recomputed(lora_picks, 8, "solver", mode="separate")


def test_requests_without_an_adapter_are_left_alone(lora_picks):
    assert _recomputed(lora_picks, 8, None) == _recomputed(lora_picks, 0, None) == 0


def test_the_served_picks_and_a_requests_own(lora_picks):
    """Served: the first 8 borrowed tokens and the last 32 (T2 and its end marker: 32 tokens),
    within the deployment's cap of half of them; a request's own tail and boundary win."""
    from sglang_kvcmas.policy import lora_share

    assert (lora_share.LORA_RECOMPUTE_TAIL, lora_share.LORA_RECOMPUTE_BOUNDARY,
            lora_share.LORA_RECOMPUTE_MASS_FRACTION) == (32, 8, 0.0)
    borrowed = len(T2) + END
    assert _recomputed(lora_picks, None, "solver") == borrowed // 2
    assert _recomputed(lora_picks, None, "solver", custom={
        "kvcmas_recompute_tail": 4, "kvcmas_recompute_boundary": 0}) == 4
    assert _recomputed(lora_picks, None, None) == 0  # no adapter: the deployment's picks


def test_an_adapter_reader_takes_the_lora_mass_share(lora_picks):
    """Of T2's borrowed tokens (plus the end marker), an adapter reader recomputes by mass the
    LoRA share (here 0.1: three tokens) whatever the deployment's share; a reader without an
    adapter the deployment's; a request's own share wins."""
    borrowed = len(T2) + END
    three = round(0.1 * borrowed)
    assert _recomputed(lora_picks, 0, "solver", mass=0.5) == 0  # the LoRA share (0) replaces it
    assert _recomputed(lora_picks, 0, "solver", lora_mass=0.1) == three
    assert _recomputed(lora_picks, 0, "solver", lora_mass=0.1, mass=0.5) == three
    assert _recomputed(lora_picks, 0, None, lora_mass=0.5, mass=0.1) == three
    assert _recomputed(lora_picks, 0, "solver", lora_mass=0.5,
                       custom={"kvcmas_recompute_mass_fraction": 0.1,
                               "kvcmas_recompute_boundary": 0}) == three


def test_an_adapter_reader_keeps_what_it_recomputes_unless_it_asks_not_to(lora_picks):
    """An adapter reader keeps the tail it recomputes as leaves (the tree holds its delta tokens
    after it); one whose request sets ``kvcmas_read_leaves: false`` recomputes the same tail and
    keeps nothing."""
    lora_picks(tail=8)
    h = LoraHarness(boundary=0)
    h.cache.requests.lora_share = "borrow"
    a, b = head(50, 20), head(60, 8)
    h.serve(_req("a1", a + T1 + SUFFIX, "planner"), 0)
    h.serve(_req("b1", b + T1 + SUFFIX, "solver"), 1)
    h.serve(_req("c1", b + T1 + SUFFIX, "critic"), 2)
    h.serve(_req("a2", a + T1 + T2 + SUFFIX, "planner"), 3)
    b2 = _req("b2", b + T1 + T2 + SUFFIX, "solver")
    h.serve(b2, 4)
    assert b2.customized_info["kvcmas_reuse"][0]["recomputed_borrowed"] == 8
    assert h.cache.shared.exact_leaf_tokens() == 8
    c2 = _req("c2", b + T1 + T2 + SUFFIX, "critic")
    c2.sampling_params.custom_params = {"kvcmas_read_leaves": False}
    h.serve(c2, 5)
    assert c2.customized_info["kvcmas_reuse"][0]["recomputed_borrowed"] == 8
    assert h.cache.shared.exact_leaf_tokens() == 8


def test_an_adapter_reader_takes_the_lora_boundary(lora_picks):
    """The LoRA boundary replaces the deployment's boundary for an adapter reader (the harness's
    deployment boundary is 0); a reader without an adapter keeps it."""
    def recomputed(lora_boundary: int, adapter: str | None) -> int:
        lora_picks(tail=0, boundary=lora_boundary)
        h = LoraHarness(boundary=0)
        h.cache.requests.lora_share = "borrow"
        a, b = head(50, 20), head(60, 8)
        owner = "planner" if adapter else None
        h.serve(_req("a1", a + T1 + SUFFIX, owner), 0)
        h.serve(_req("b1", b + T1 + SUFFIX, adapter), 1)
        h.serve(_req("a2", a + T1 + T2 + SUFFIX, owner), 2)
        b2 = _req("b2", b + T1 + T2 + SUFFIX, adapter)
        h.serve(b2, 3)
        return b2.customized_info["kvcmas_reuse"][0]["recomputed_borrowed"]

    assert recomputed(0, "solver") == 0
    assert recomputed(6, "solver") == 6
    assert recomputed(6, None) == 0


def test_an_adapter_readers_boundary_opens_every_message_it_borrows(lora_picks):
    """A turn's new messages, prefilled by another adapter in one pass, are one borrowed span; the
    reader's boundary picks open each message the chat template closes inside it, and without a
    detected chat template only the span."""
    def picks(template: bool) -> tuple[int, ...]:
        lora_picks(tail=0, boundary=3)
        h = LoraHarness(boundary=0)
        h.cache.requests.lora_share = "borrow"
        if not template:
            h.cache.markers = None
        a, b = head(50, 20), head(60, 8)
        msgs = T2[:10] + [2, NL] + T2[10:20] + [2, NL] + T2[20:]  # three messages
        h.serve(_req("a1", a + T1 + SUFFIX, "planner"), 0)
        h.serve(_req("b1", b + T1 + SUFFIX, "solver"), 1)
        h.serve(_req("a2", a + T1 + msgs + SUFFIX, "planner"), 2)
        b2 = _req("b2", b + T1 + msgs + SUFFIX, "solver")
        h.match(b2)
        return b2.last_node.recompute

    start = len(T1)
    assert picks(template=False) == (start, start + 1, start + 2)
    assert picks(template=True) == tuple(o for s in (start, start + 12, start + 24)
                                         for o in range(s, s + 3))
