"""Scheduling passes with prefill to spare (``policy.turn_order.is_spare`` and the turn-order
hook, ``integration/turn_order_hook.py``): when the waiting requests, computed exactly, fit in
one prefill batch and few requests run, nobody is held back and every waiting request is served
exactly, as under radix; otherwise the turn order is as before and nothing is marked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang_kvcmas.integration import turn_order_hook
from sglang_kvcmas.integration.agent_requests import SPARE_ATTR
from sglang_kvcmas.integration.shared_tree_cache import SharedPrefixHandle
from sglang_kvcmas.policy.turn_order import SPARE_RUNNING_ROWS, is_spare
from test_shared_tree_cache import SUFFIX, T1, Harness, Req, head

T2 = list(range(200, 260))
A, B = head(50, 20), head(60, 8)
COST = len(T2) + len(SUFFIX)
"""What each of the leader and the reader computes exactly: the new segment and the suffix."""


def test_spare_when_the_exact_prefill_fits_the_budget_with_few_running():
    assert is_spare([100, 200], 0, 300) and is_spare([300], SPARE_RUNNING_ROWS, 300)
    assert not is_spare([100, 200], 0, 299)  # does not fit one prefill batch
    assert not is_spare([100], SPARE_RUNNING_ROWS + 1, 10_000)  # the machine is busy decoding
    assert not is_spare([], 0, 10_000)  # nobody waits: nothing to spare prefill for
    assert is_spare([0, 0], 0, 0)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(turn_order_hook, "_held_since", {})
    monkeypatch.setattr(turn_order_hook, "_head_wait_since", {})
    monkeypatch.setattr(turn_order_hook, "SPARE", {"passes": 0, "requests": 0})
    monkeypatch.setattr(turn_order_hook, "_SPARE_ON", [True])  # tests' servers turn it off


def test_the_spare_pass_can_be_turned_off_for_read_path_measurements(fresh, monkeypatch):
    """``KVCMAS_SPARE_PREFILL=0`` (read once): no pass is spare, readers borrow as under
    load."""
    monkeypatch.setattr(turn_order_hook, "_SPARE_ON", [])
    monkeypatch.setenv("KVCMAS_SPARE_PREFILL", "0")
    assert not turn_order_hook.spare_on()
    monkeypatch.setattr(turn_order_hook, "_SPARE_ON", [])
    monkeypatch.setenv("KVCMAS_SPARE_PREFILL", "1")
    assert turn_order_hook.spare_on()


def two_turns(share=True):
    """a and b have read T1 (their heads are cached); a2 and b2 bring a new segment: b2 would
    wait for a2 and borrow it."""
    h = Harness(share=share)
    h.serve(Req("a1", A + T1 + SUFFIX), 0)
    h.serve(Req("b1", B + T1 + SUFFIX), 1)
    return h, Req("a2", A + T1 + T2 + SUFFIX), Req("b2", B + T1 + T2 + SUFFIX)


def scheduler(h, waiting, budget, running=0, **extra):
    return SimpleNamespace(tree_cache=h.cache, waiting_queue=list(waiting),
                           chunked_prefill_size=budget,
                           running_batch=SimpleNamespace(reqs=[object()] * running), **extra)


def pass_(sched) -> list[str]:
    """One scheduling pass through the hook: the rids the prefill decision saw."""
    seen = []
    turn_order_hook.turn_order_around(lambda s: seen.append([r.rid for r in s.waiting_queue]),
                                      sched)
    (out,) = seen
    return out


def test_a_spare_pass_holds_nobody_back_and_serves_every_waiting_request_exactly(fresh):
    h, leader, reader = two_turns()
    assert [h.cache.radix_peek(r, len(r.origin_input_ids)) for r in (leader, reader)] == [
        len(A + T1), len(B + T1)]
    sched = scheduler(h, [leader, reader], budget=2 * COST)
    assert pass_(sched) == ["a2", "b2"]
    assert [r.rid for r in sched.waiting_queue] == ["a2", "b2"]
    assert getattr(leader, SPARE_ATTR) is True and getattr(reader, SPARE_ATTR) is True
    assert h.cache.requests.wants_exact(leader) and h.cache.requests.wants_exact(reader)
    assert turn_order_hook.SPARE == {"passes": 1, "requests": 2}
    assert turn_order_hook.held_count() == 0
    pass_(sched)  # marked already: the pass counts, the requests do not again
    assert turn_order_hook.SPARE == {"passes": 2, "requests": 2}
    h.serve(leader, 2)
    spans, _ = h.serve(reader, 3)
    assert spans is None and not isinstance(reader.last_node, SharedPrefixHandle)
    assert reader.prefix_len == len(B + T1)  # its own exact prefix only, as the radix cache
    c = head(70, 9)
    h.serve(Req("c1", c + T1 + SUFFIX), 4)
    later = Req("c2", c + T1 + T2 + SUFFIX)  # a later pass, no spare: it reads what a2 computed
    spans, _ = h.serve(later, 5)
    assert spans is not None and later.prefix_len > len(c + T1)


@pytest.mark.parametrize("budget,running", [(2 * COST - 1, 0), (2 * COST, SPARE_RUNNING_ROWS + 1)])
def test_without_prefill_to_spare_the_reader_waits_and_then_borrows(fresh, budget, running):
    h, leader, reader = two_turns()
    sched = scheduler(h, [leader, reader], budget=budget, running=running)
    assert pass_(sched) == ["a2"]  # b2 waits for a2's new segment
    assert [r.rid for r in sched.waiting_queue] == ["b2", "a2"]
    assert not hasattr(leader, SPARE_ATTR) and not hasattr(reader, SPARE_ATTR)
    assert not h.cache.requests.wants_exact(reader)
    assert turn_order_hook.SPARE == {"passes": 0, "requests": 0}
    h.serve(leader, 2)
    spans, _ = h.serve(reader, 3)
    assert spans is not None and reader.prefix_len > len(B + T1)  # it borrowed T2


def test_the_running_count_at_the_bound_still_spares(fresh):
    h, leader, reader = two_turns()
    assert pass_(scheduler(h, [leader, reader], 2 * COST, running=SPARE_RUNNING_ROWS)) == [
        "a2", "b2"]
    assert getattr(reader, SPARE_ATTR) is True


def test_without_chunked_prefill_the_budget_is_max_prefill_tokens(fresh):
    h, leader, reader = two_turns()
    sched = scheduler(h, [leader, reader], budget=None, max_prefill_tokens=2 * COST)
    assert pass_(sched) == ["a2", "b2"] and getattr(reader, SPARE_ATTR) is True
    h, leader, reader = two_turns()
    sched = scheduler(h, [leader, reader], budget=None, max_prefill_tokens=2 * COST - 1)
    assert pass_(sched) == ["a2"] and not hasattr(reader, SPARE_ATTR)


def test_a_scheduler_without_a_budget_never_spares_uncached_prompts(fresh):
    """The fake schedulers of the other turn-order tests name no budget: no pass spares."""
    h, leader, reader = two_turns()
    sched = SimpleNamespace(tree_cache=h.cache, waiting_queue=[leader, reader])
    assert pass_(sched) == ["a2"] and not hasattr(reader, SPARE_ATTR)


def test_sharing_off_marks_nothing(fresh):
    h, leader, reader = two_turns(share=False)
    assert pass_(scheduler(h, [leader, reader], budget=10_000)) == ["a2", "b2"]
    assert not hasattr(leader, SPARE_ATTR) and turn_order_hook.SPARE["passes"] == 0


def test_a_fault_in_the_spare_check_leaves_the_turn_order_as_it_was(fresh, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(turn_order_hook, "is_spare", broken)
    h, leader, reader = two_turns()
    faults = h.cache.faults
    assert pass_(scheduler(h, [leader, reader], budget=10_000)) == ["a2"]
    assert h.cache.faults == faults + 1 and not hasattr(reader, SPARE_ATTR)


@pytest.mark.parametrize("spare", [True, False])
def test_outputs_stay_on_the_radix_path_only_when_a_spare_pass_served_the_turn(fresh, spare):
    """Served in a spare pass, an exact turn keeps its outputs on its radix path, as the radix
    cache does, so its next turn (on an idle server, exact too) finds them; under load an exact
    turn keeps its prompt only: its outputs re-enter through the shared transcript."""
    h, leader, _ = two_turns()
    if spare:
        setattr(leader, SPARE_ATTR, True)
    outputs = list(range(300, 340))
    h.serve(leader, 2, outputs=outputs)
    nxt = Req("a3", A + T1 + T2 + SUFFIX + outputs + [7, 8])
    found = h.cache.radix_peek(nxt, len(nxt.origin_input_ids))
    prompt = len(leader.origin_input_ids)
    assert found == (prompt + len(outputs) if spare else prompt)
