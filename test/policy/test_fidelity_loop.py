"""The fidelity monitor's scores and closed loop (``policy/fidelity.py``): top-1 agreement, first
divergence and the coarse KL of one sampled turn; levels that rise on low agreement and step
back down on healthy turns, per namespace and per agent; the recompute each level asks for."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sglang_kvcmas.policy.fidelity import (
    EXACT_LEVEL,
    HEALTHY_SAMPLES,
    LEVELS,
    MIN_SAMPLES,
    FidelityLoop,
    RecomputeLevel,
    Tally,
    TurnScore,
    coarse_kl,
    score_turn,
)
from sglang_kvcmas.policy.recompute import RecomputeConfig

LN = math.log

BAD = TurnScore(positions=10, agreed=8, diverged_at=3, kl=0.2)  # agreement 0.8
GOOD = TurnScore(positions=10, agreed=10, diverged_at=None, kl=0.0)


def feed(loop: FidelityLoop, key, score: TurnScore, n: int, agent=None) -> list:
    steps = []
    for _ in range(n):
        steps += loop.add(key, agent, score)
    return steps


# ----- one turn's score -----

def test_top1_agreement_and_first_divergence():
    """The reader's most likely token is its largest log-probability, wherever it is in the
    mapping; the first position whose top-1 differs is where greedy decoding leaves exact."""
    reader = [{3: LN(0.1), 1: LN(0.7), 2: LN(0.2)},  # top-1 is 1, not the first key
              {4: LN(0.6), 5: LN(0.4)},
              {6: LN(0.5), 7: LN(0.3)},
              {8: LN(0.9)}]
    score = score_turn(reader, [1, 5, 6, 9], reader, greedy=True)
    assert (score.positions, score.agreed, score.diverged_at) == (4, 2, 1)
    assert score.agreement == 0.5
    same = score_turn(reader, [1, 4, 6, 8], reader, greedy=True)
    assert (same.agreed, same.diverged_at, same.agreement) == (4, None, 1.0)
    assert score_turn([], [], [], greedy=True) == TurnScore(0, 0, None, None)
    assert TurnScore(0, 0, None, None).agreement == 1.0


def test_kl_is_zero_for_identical_distributions_and_positive_when_they_differ():
    reader = [{1: LN(0.7), 2: LN(0.2)}, {3: LN(0.5), 4: LN(0.25)}]
    assert score_turn(reader, [1, 3], reader, greedy=True).kl == pytest.approx(0.0, abs=1e-12)
    moved = [{1: LN(0.5), 2: LN(0.4)}, {3: LN(0.5), 4: LN(0.25)}]
    kl = score_turn(reader, [1, 3], moved, greedy=True).kl
    first = coarse_kl(reader[0], moved[0])
    assert kl > 0 and first > 0 and kl == pytest.approx(first / 2)  # mean over positions


def test_kl_is_none_for_a_sampled_turn():
    """SGLang returns a sampled turn's log-probabilities after temperature: no KL for it, while
    agreement is still scored."""
    reader = [{1: LN(0.7), 2: LN(0.2)}]
    moved = [{1: LN(0.1), 2: LN(0.8)}]
    score = score_turn(reader, [2], moved, greedy=False)
    assert score.kl is None and (score.agreed, score.diverged_at) == (0, 0)


def test_coarse_kl_is_a_lower_bound_of_the_true_kl_and_exact_on_the_whole_vocabulary():
    """Random distributions over 50 tokens: the reader's top 5 plus one bucket never exceeds
    KL(p || q) over the vocabulary, equals the KL of the two bucketed distributions, and is the
    true KL when the reader keeps every token."""
    rng = np.random.default_rng(0)
    vocab, top = 50, 5
    for trial in range(200):
        alpha = 0.3 if trial % 2 else 3.0  # peaked and flat distributions
        p, q = rng.dirichlet([alpha] * vocab), rng.dirichlet([alpha] * vocab)
        true = float(np.sum(p * (np.log(p) - np.log(q))))
        keep = np.argsort(-p)[:top]
        reader = {int(t): float(np.log(p[t])) for t in keep}
        exact = {int(t): float(np.log(q[t])) for t in keep}
        coarse = coarse_kl(reader, exact)
        assert 0.0 <= coarse <= true + 1e-9
        pb = np.append(p[keep], 1 - p[keep].sum())
        qb = np.append(q[keep], 1 - q[keep].sum())
        assert coarse == pytest.approx(float(np.sum(pb * (np.log(pb) - np.log(qb)))), rel=1e-9)
        full = coarse_kl({t: float(np.log(p[t])) for t in range(vocab)},
                         {t: float(np.log(q[t])) for t in range(vocab)})
        assert full == pytest.approx(true, rel=1e-9, abs=1e-12)


def test_mismatched_lengths_and_missing_exact_logprobs_are_refused():
    reader = [{1: LN(0.7)}, {2: LN(0.6)}]
    with pytest.raises(ValueError, match="positions differ"):
        score_turn(reader, [1], reader, greedy=True)
    with pytest.raises(ValueError, match="positions differ"):
        score_turn(reader, [1, 2], reader[:1], greedy=True)
    with pytest.raises(ValueError, match="no exact log-probability for token 3"):
        score_turn([{1: LN(0.7), 3: LN(0.2)}], [1], [{1: LN(0.7)}], greedy=True)
    with pytest.raises(ValueError, match="token 3"):
        coarse_kl({3: LN(0.2)}, {})


def test_tally_adds_up_scores():
    tally = Tally()
    assert tally.to_json() == {"turns": 0, "diverged": 0, "top1_agreement": None, "kl": None}
    tally.add(TurnScore(10, 8, 2, 0.3))
    tally.add(TurnScore(6, 6, None, None))  # a sampled turn: no KL
    tally.add(TurnScore(4, 4, None, 0.1))
    assert tally.to_json() == {"turns": 3, "diverged": 1, "top1_agreement": 18 / 20,
                               "kl": pytest.approx(0.2)}


# ----- what a level recomputes -----

def test_a_level_recomputes_at_least_its_tokens_and_level_zero_changes_nothing():
    config = RecomputeConfig()
    assert LEVELS[0].applied_to(config) is config
    for level in LEVELS[1:EXACT_LEVEL]:
        got = level.applied_to(config)
        assert got.boundary_tokens == max(config.boundary_tokens, level.boundary_tokens)
        assert got.mass_fraction == max(config.mass_fraction, level.mass_fraction)
        assert got.tail_tokens == max(config.tail_tokens, level.tail_tokens)
        assert got.max_fraction == max(config.max_fraction, got.mass_fraction)
        assert got.segment_share is None  # each reader's own mass share, however many read
        assert (got.min_borrowed, got.readers) == (config.min_borrowed, config.readers)
    assert LEVELS[1].applied_to(config) == RecomputeConfig(
        boundary_tokens=32, mass_fraction=0.25, tail_tokens=32, max_fraction=0.5,
        segment_share=None)
    larger = RecomputeConfig(boundary_tokens=100, mass_fraction=0.6, max_fraction=0.8,
                             tail_tokens=200, readers=3)
    assert LEVELS[1].applied_to(larger) == RecomputeConfig(
        boundary_tokens=100, mass_fraction=0.6, max_fraction=0.8, tail_tokens=200, readers=3,
        segment_share=None)  # the deployment's knobs win where larger
    wide = RecomputeLevel(mass_fraction=0.75).applied_to(config)
    assert (wide.mass_fraction, wide.max_fraction) == (0.75, 0.75)  # the cap follows
    assert LEVELS[EXACT_LEVEL].exact and not any(level.exact for level in LEVELS[:EXACT_LEVEL])


# ----- the loop -----

def test_a_fault_stream_raises_the_level_one_step_per_min_samples_up_to_exact():
    loop = FidelityLoop()
    levels = []
    for _ in range(MIN_SAMPLES * (EXACT_LEVEL + 3)):
        loop.add("ns", None, BAD)
        levels.append(loop.level("ns"))
    expected = [min(i // MIN_SAMPLES, EXACT_LEVEL) for i in range(1, len(levels) + 1)]
    assert levels == expected  # rises on exactly the MIN_SAMPLES-th bad sample, never past exact
    assert [(s.before, s.after, s.direction) for s in loop.steps] == [
        (i, i + 1, "up") for i in range(EXACT_LEVEL)]
    assert all(s.samples == MIN_SAMPLES and s.agreement == pytest.approx(0.8)
               for s in loop.steps)


def test_exact_turns_served_step_the_level_down():
    """At the exact level nothing is sampled: the turns served count as healthy."""
    loop = FidelityLoop()
    feed(loop, "ns", BAD, MIN_SAMPLES * EXACT_LEVEL)
    assert loop.level("ns") == EXACT_LEVEL
    assert loop.served("ns", None, EXACT_LEVEL - 1) == []  # not an exact turn: not counted
    for _ in range(HEALTHY_SAMPLES - 1):
        assert loop.served("ns", None, EXACT_LEVEL) == []
    (step,) = loop.served("ns", None, EXACT_LEVEL)
    assert (step.key, step.before, step.after, step.direction) == ("ns", EXACT_LEVEL,
                                                                   EXACT_LEVEL - 1, "down")
    assert step.agreement == 1.0 and loop.level("ns") == EXACT_LEVEL - 1
    assert loop.served("ns", None, EXACT_LEVEL) == []  # below exact: served turns count nothing


def test_a_healthy_stream_at_a_raised_level_steps_down_after_healthy_samples():
    loop = FidelityLoop()
    feed(loop, "ns", BAD, 2 * MIN_SAMPLES)
    assert loop.level("ns") == 2
    assert feed(loop, "ns", GOOD, HEALTHY_SAMPLES - 1) == [] and loop.level("ns") == 2
    (step,) = loop.add("ns", None, GOOD)
    assert (step.before, step.after, step.samples, step.agreement) == (2, 1, HEALTHY_SAMPLES, 1.0)
    feed(loop, "ns", GOOD, HEALTHY_SAMPLES)
    assert loop.level("ns") == 0
    assert feed(loop, "ns", GOOD, 3 * HEALTHY_SAMPLES) == [] and loop.level("ns") == 0  # floor
    assert [s.direction for s in loop.steps] == ["up", "up", "down", "down"]


def test_a_raised_window_below_target_rises_again_rather_than_stepping_down():
    """A window just short of the target over healthy_samples turns is not healthy: it rises."""
    loop = FidelityLoop()
    feed(loop, "ns", BAD, MIN_SAMPLES)
    nearly = TurnScore(positions=100, agreed=98, diverged_at=50, kl=None)  # 0.98 < 0.99
    (step,) = feed(loop, "ns", nearly, MIN_SAMPLES)
    assert (step.before, step.after) == (1, 2)


def test_an_agent_with_its_own_bad_turns_rises_alone_and_a_namespace_raises_every_agent():
    """``level(ns, agent)`` is the higher of the namespace's and the agent's. Every sample is
    in the namespace's window too: agent a's few bad turns among b's many good ones leave the
    namespace at its target, so a rises alone; once the namespace rises, every agent does."""
    loop = FidelityLoop()
    feed(loop, "ns", GOOD, 200, agent="b")
    feed(loop, "ns", BAD, MIN_SAMPLES - 1, agent="a")
    assert loop.level("ns", "a") == 0
    (step,) = loop.add("ns", "a", BAD)  # the namespace: (2000 + 64) / 2080 agreed, healthy
    assert step.key == ("ns", "a") and (step.before, step.after) == (0, 1)
    assert (loop.level("ns", "a"), loop.level("ns", "b"), loop.level("ns")) == (1, 0, 0)
    assert loop.level("other", "a") == 0  # the agent's level is within its namespace
    steps = feed(loop, "ns", BAD, MIN_SAMPLES, agent="c")  # the namespace's window goes bad
    assert {s.key for s in steps} == {"ns", ("ns", "c")}
    assert (loop.level("ns"), loop.level("ns", "b"), loop.level("ns", "new")) == (1, 1, 1)
    assert (loop.level("ns", "a"), loop.level("ns", "c")) == (1, 1)  # the max, not the sum
    feed(loop, "ns", BAD, MIN_SAMPLES, agent="a")  # in a's window and the namespace's alike
    assert (loop.level("ns", "a"), loop.level("ns"), loop.level("ns", "b")) == (2, 2, 2)


def test_served_at_exact_steps_down_the_windows_that_are_exact():
    loop = FidelityLoop()
    feed(loop, "ns", GOOD, 500, agent="b")
    feed(loop, "ns", BAD, MIN_SAMPLES * EXACT_LEVEL, agent="a")
    assert (loop.level("ns"), loop.level("ns", "a")) == (0, EXACT_LEVEL)
    steps = []
    for _ in range(HEALTHY_SAMPLES):
        steps += loop.served("ns", "a", loop.level("ns", "a"))
    assert [(s.key, s.before, s.after) for s in steps] == [
        (("ns", "a"), EXACT_LEVEL, EXACT_LEVEL - 1)]
    assert loop.level("ns") == 0


def test_max_keys_forgets_the_least_recently_used_key():
    loop = FidelityLoop(max_keys=2)
    feed(loop, "x", BAD, MIN_SAMPLES)
    feed(loop, "y", BAD, MIN_SAMPLES)
    loop.add("x", None, GOOD)  # x used last
    assert (loop.level("x"), loop.level("y")) == (1, 1)
    loop.add("z", None, GOOD)
    assert (loop.level("x"), loop.level("y"), loop.level("z")) == (1, 0, 0)  # y forgotten
    assert loop.snapshot()["raised"] == {"'x'": 1}
    big = FidelityLoop(max_keys=3)
    for agent in range(10):  # each sample holds the namespace and one agent
        big.add("ns", agent, GOOD)
    assert len(big._windows) == 3


def test_snapshot_is_json_and_lists_raised_keys_and_steps():
    loop = FidelityLoop()
    assert loop.snapshot() == {"raised": {}, "steps": []}
    feed(loop, ("salt", None, None), BAD, MIN_SAMPLES, agent="abc")
    snap = json.loads(json.dumps(loop.snapshot()))
    assert snap["raised"] == {"('salt', None, None)": 1, "(('salt', None, None), 'abc')": 1}
    assert snap["steps"] == [
        {"key": "('salt', None, None)", "from": 0, "to": 1, "agreement": 0.8,
         "samples": MIN_SAMPLES},
        {"key": "(('salt', None, None), 'abc')", "from": 0, "to": 1, "agreement": 0.8,
         "samples": MIN_SAMPLES}]
    for _ in range(40):
        loop.steps.append(loop.steps[0])
    assert len(loop.snapshot()["steps"]) == 16  # the last steps only


def test_a_window_counts_only_turns_served_at_its_level():
    """A sample served at another level than a window's (the window moved since, or the turn
    was served at the namespace's higher level) does not count in it."""
    loop = FidelityLoop()
    bad = TurnScore(16, 12, 0, 0.1)
    for _ in range(MIN_SAMPLES):
        loop.add("ns", None, bad, level=0)
    assert loop.level("ns") == 1
    for _ in range(MIN_SAMPLES):
        loop.add("ns", None, bad, level=0)  # stale: served before the step
    assert loop.level("ns") == 1
    for _ in range(MIN_SAMPLES):  # served at 1 for the namespace: the agent's window is at 0
        loop.add("ns", "a", bad, level=1)
    assert loop.level("ns") == 2 and loop.level("other", "a") == 0
