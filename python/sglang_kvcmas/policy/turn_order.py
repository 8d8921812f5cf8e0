"""Agent-turn ordering: which waiting requests should wait for another agent's shared segment.

When several agents' requests over the same *new* shared transcript arrive together, prefilling
them in one batch computes that transcript once per agent. The ``leader`` policy lets one request
(the leader) compute it exactly; the others wait until the leader has published it in the shared
tree, then reuse it. Pure functions over plain values: the scheduler hook
(``integration/turn_order_hook.py``) builds the inputs and applies the decision. Nobody waiting
(SGLang's own order) is what ``kvcmas_exact`` requests and a server without sharing get, and
what every request gets in a pass with prefill to spare (:func:`is_spare`), served exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping, Sequence
from dataclasses import dataclass

from sglang_kvcmas.tokens import as_token_array, common_prefix

MIN_GAIN = 32
"""Fewest extra shared tokens a wait must buy (the hook also asks for at least the tokens a
reader needs to borrow at all, ``policy.recompute.MIN_BORROWED``)."""
MAX_WAIT_S = 60.0
"""A safety bound: a request held back this long in total is never held back again."""
SPARE_RUNNING_ROWS = 4
"""Most running requests with which a scheduling pass can still count as spare
(:func:`is_spare`): a decode batch this small leaves the machine mostly idle."""


@dataclass(frozen=True, eq=False)
class TurnCandidate:
    """A waiting request as the policy sees it.

    Attributes:
        rid: request id.
        namespace: sharing namespace ``(extra_key, cache_salt)``; never shared across.
        agent: agent id.
        shared: the request's shared-context token ids (a sequence or an int64 array).
        available: how many of ``shared`` the shared tree already holds (a reader reuses these).
        waited_s: seconds since the request was first held back (0 if never).
        own: how many of ``shared`` the request's agent holds exactly in its own context (its
            radix path); the candidate with the most leads (``plan_turns``).
    """

    rid: str
    namespace: Hashable
    agent: str
    shared: Sequence[int]
    available: int
    waited_s: float
    own: int = 0


@dataclass(frozen=True, eq=False)
class TurnLeader:
    """A request that is computing (or will compute first) shared tokens: in flight or admitted."""

    rid: str
    namespace: Hashable
    shared: Sequence[int]


@dataclass(frozen=True)
class TurnConfig:
    """Policy constants (:data:`MIN_GAIN`, :data:`MAX_WAIT_S`), as fields so that tests can vary
    them."""

    min_gain: int = MIN_GAIN
    max_wait_s: float = MAX_WAIT_S

    def __post_init__(self) -> None:
        if self.min_gain < 1 or self.max_wait_s < 0:
            raise ValueError(f"bad turn-order config {self}")


@dataclass(frozen=True)
class TurnPlan:
    """The decision for one scheduling pass: ``deferred`` rids stay in the queue this pass;
    ``leader_of`` names, for each deferred rid, the request it waits for."""

    deferred: frozenset[str]
    leader_of: dict[str, str]


def is_spare(exact_tokens: Sequence[int], running_rows: int, budget: int) -> bool:
    """Whether a scheduling pass has prefill to spare: every waiting request computed exactly
    (``exact_tokens``: each one's prompt less its own cached prefix) fits in one prefill batch's
    ``budget`` of tokens, and at most :data:`SPARE_RUNNING_ROWS` requests are running. Then
    nobody waits and every waiting request is served exactly, as under radix: sharing saves
    prefill only where the machine lacks it."""
    return bool(exact_tokens) and running_rows <= SPARE_RUNNING_ROWS and \
        sum(exact_tokens) <= budget


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences (one vector compare)."""
    return common_prefix(as_token_array(a), as_token_array(b))


def plan_turns(
    waiting: Sequence[TurnCandidate],
    in_flight: Sequence[TurnLeader],
    config: TurnConfig,
    memo: MutableMapping[tuple[int, int], tuple[int, Sequence[int], Sequence[int]]] | None = None,
) -> TurnPlan:
    """Decide who waits.

    A candidate waits when an in-flight request, or a candidate taken before it that does not
    wait, shares at least ``config.min_gain`` more of its shared context than the tree already
    holds for it — and it has not waited ``config.max_wait_s`` yet. Candidates that do not wait
    become leaders for the ones after them. Candidates are taken by how much of their shared
    context their agent holds exactly (``own``, most first), then in queue order: the agent that
    led a workflow's previous step holds all of the transcript exactly, so it leads again and
    its turns read nothing approximate, where a new leader would compute the new segment over
    the part it had borrowed, and every later reader would inherit that approximation.

    ``memo``, read and filled: ``(id(leader.shared), id(candidate.shared)) -> (common prefix
    length, leader.shared, candidate.shared)`` (the entry holds both, so their ids stay theirs).
    A request's shared tokens never change, so a caller that passes the same sequence objects
    across passes compares each pair once; it drops entries of requests that left.
    """
    leaders = list(in_flight)
    deferred: dict[str, str] = {}
    for cand in sorted(waiting, key=lambda c: -c.own):  # stable: queue order among equals
        best, best_rid = 0, None
        if cand.waited_s < config.max_wait_s:
            for lead in leaders:
                if lead.namespace != cand.namespace or lead.rid == cand.rid:
                    continue
                pair = (id(lead.shared), id(cand.shared))
                hit = memo.get(pair) if memo is not None else None
                if hit is None:
                    hit = (common_prefix_len(lead.shared, cand.shared), lead.shared, cand.shared)
                    if memo is not None:
                        memo[pair] = hit
                gain = hit[0] - cand.available
                if gain > best:
                    best, best_rid = gain, lead.rid
        if best_rid is not None and best >= config.min_gain:
            deferred[cand.rid] = best_rid
        else:
            leaders.append(TurnLeader(cand.rid, cand.namespace, cand.shared))
    return TurnPlan(frozenset(deferred), deferred)
