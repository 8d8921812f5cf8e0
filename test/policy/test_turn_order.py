"""Agent-turn ordering policy: who waits for whose shared segment."""

from __future__ import annotations

import pytest

from sglang_kvcmas.policy.turn_order import TurnCandidate, TurnConfig, TurnLeader, plan_turns

T = tuple(range(100))


def cand(rid, shared=T, available=0, waited=0.0, ns="n", agent=None, own=0):
    return TurnCandidate(rid, ns, agent or rid, shared, available, waited, own)


def test_one_leader_others_wait():
    plan = plan_turns([cand("a"), cand("b"), cand("c")], [], TurnConfig())
    assert plan.deferred == {"b", "c"} and plan.leader_of == {"b": "a", "c": "a"}


def test_the_agent_holding_most_of_the_transcript_exactly_leads():
    """The previous step's leader holds the transcript exactly: it leads again, wherever it is
    in the queue; ties keep queue order."""
    plan = plan_turns([cand("b", own=40), cand("c", own=40), cand("a", own=70)], [],
                      TurnConfig())
    assert plan.leader_of == {"b": "a", "c": "a"}
    plan = plan_turns([cand("b", own=40), cand("c", own=40)], [], TurnConfig())
    assert plan.leader_of == {"c": "b"}


def test_in_flight_owner_leads():
    plan = plan_turns([cand("a")], [TurnLeader("x", "n", T)], TurnConfig())
    assert plan.leader_of == {"a": "x"}


def test_no_wait_when_gain_small_or_already_available():
    cfg = TurnConfig(min_gain=32)
    assert not plan_turns([cand("a"), cand("b", available=90)], [], cfg).deferred
    other = tuple(range(10)) + tuple(range(1000, 1100))
    assert not plan_turns([cand("a"), cand("b", shared=other)], [], cfg).deferred


def test_never_across_namespaces_and_bounded_wait():
    assert not plan_turns([cand("a", ns="t1"), cand("b", ns="t2")], [], TurnConfig()).deferred
    late = plan_turns([cand("a"), cand("b", waited=99.0)], [], TurnConfig(max_wait_s=20))
    assert not late.deferred


def test_config_validation():
    with pytest.raises(ValueError):
        TurnConfig(min_gain=0)
