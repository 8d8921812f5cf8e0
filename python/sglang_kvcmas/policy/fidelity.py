"""How far a reader's answer moved from exact serving, and what readers recompute in response.

The fidelity monitor (``integration/fidelity_monitor.py``) samples reader turns: it keeps the
reader's own top-``N`` log-probabilities for its first ``FORCED_TOKENS`` generated tokens, then
prefills the reader's prompt followed by those tokens exactly (nothing shared) and reads the
exact distributions at the same positions (teacher forcing). This module scores one such pair
(:func:`score_turn`: top-1 agreement, first divergence, KL) and runs the closed loop over the
scores (:class:`FidelityLoop`). Pure Python over plain values.

The KL is KL(reader ‖ exact) on the reader's top-``N`` tokens plus one bucket for the rest of the
vocabulary: coarsening the vocabulary never raises a KL, so this is a lower bound, tight when the
top ``N`` hold most of the mass. Only a greedy turn has one: SGLang returns sampled turns'
log-probabilities after temperature, not the model's own distribution.

The loop keeps, per cache namespace and per agent, a window of recent scores and a **level**:
what readers recompute beyond the deployment's own knobs (:data:`LEVELS`; the last is exact
serving). Agreement below the target over at least ``MIN_SAMPLES`` turns raises the level one
step; a level held for ``HEALTHY_SAMPLES`` turns with agreement at or above the target steps
back down one (an exact level has no readers to sample: its turns count as healthy). Each
step starts a fresh window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_kvcmas.policy.recompute import RecomputeConfig

FORCED_TOKENS = 16
"""Generated tokens of a sampled turn teacher-forced through the exact prefill."""
TOP_LOGPROBS = 20
"""Top log-probabilities kept per position on the reader's side (the KL's support)."""
AGREEMENT_TARGET = 0.99
"""Top-1 agreement with exact serving below which the loop raises what readers recompute."""
MIN_SAMPLES = 8
"""Fewest sampled turns at a level before the loop may raise it."""
HEALTHY_SAMPLES = 32
"""Turns at a raised level, agreeing at the target, before the loop steps it down."""


@dataclass(frozen=True)
class RecomputeLevel:
    """What readers recompute at one level of the loop, at least (knobs as
    :class:`RecomputeConfig`'s, whose values win where larger), or ``exact``: serve the request
    exactly (read no other agent's KV)."""

    boundary_tokens: int = 0
    mass_fraction: float = 0.0
    tail_tokens: int = 0
    exact: bool = False

    def applied_to(self, config: RecomputeConfig) -> RecomputeConfig:
        """``config`` recomputing at least this level's tokens; a raised mass share is each
        reader's own, whatever the readers of its segment (no segment share)."""
        if self == RecomputeLevel():
            return config
        mass = max(config.mass_fraction, self.mass_fraction)
        return replace(config, boundary_tokens=max(config.boundary_tokens, self.boundary_tokens),
                       mass_fraction=mass, tail_tokens=max(config.tail_tokens, self.tail_tokens),
                       max_fraction=max(config.max_fraction, mass), segment_share=None)


LEVELS: tuple[RecomputeLevel, ...] = (
    RecomputeLevel(),
    RecomputeLevel(boundary_tokens=32, mass_fraction=0.25, tail_tokens=32),
    RecomputeLevel(boundary_tokens=64, mass_fraction=0.5, tail_tokens=128),
    RecomputeLevel(exact=True),
)
"""The loop's steps: level 0 is the deployment's knobs as set, the last is exact serving."""
EXACT_LEVEL = len(LEVELS) - 1


@dataclass(frozen=True)
class TurnScore:
    """One sampled turn against exact serving.

    Attributes:
        positions: forced positions compared (``k``).
        agreed: positions whose top-1 tokens agree.
        diverged_at: first position whose top-1 tokens differ (greedy decoding from the exact
            cache would have taken another token there), or None.
        kl: mean coarse KL per position (module docstring), or None (a sampled turn).
    """

    positions: int
    agreed: int
    diverged_at: int | None
    kl: float | None

    @property
    def agreement(self) -> float:
        return self.agreed / self.positions if self.positions else 1.0


@dataclass
class Tally:
    """Scores added up (a workflow's, or the whole server's)."""

    turns: int = 0
    positions: int = 0
    agreed: int = 0
    diverged: int = 0
    kl_sum: float = 0.0
    kl_turns: int = 0

    def add(self, score: TurnScore) -> None:
        self.turns += 1
        self.positions += score.positions
        self.agreed += score.agreed
        self.diverged += score.diverged_at is not None
        if score.kl is not None:
            self.kl_sum += score.kl
            self.kl_turns += 1

    @property
    def agreement(self) -> float:
        """Top-1 agreement over every position added (1.0 before any)."""
        return self.agreed / self.positions if self.positions else 1.0

    def to_json(self) -> dict[str, Any]:
        """``turns`` sampled, their ``top1_agreement`` over all positions, ``diverged`` turns
        (greedy decoding would have left exact serving's tokens) and mean ``kl`` (None
        without a greedy turn)."""
        return {"turns": self.turns, "diverged": self.diverged,
                "top1_agreement": self.agreed / self.positions if self.positions else None,
                "kl": self.kl_sum / self.kl_turns if self.kl_turns else None}


def score_turn(reader_top: Sequence[Mapping[int, float]], exact_top1: Sequence[int],
               exact_on_reader: Sequence[Mapping[int, float]], greedy: bool) -> TurnScore:
    """Score one sampled turn (the KL only when it decoded ``greedy``).

    Args:
        reader_top: [k] per position, token id -> the reader's log-probability, its top tokens
            (in any order: the largest is taken).
        exact_top1: [k] per position, the exact prefill's most likely token id.
        exact_on_reader: [k] per position, token id -> the exact log-probability of (at least)
            the reader's top tokens at that position.
    """
    k = len(reader_top)
    if len(exact_top1) != k or len(exact_on_reader) != k:
        raise ValueError(f"positions differ: reader {k}, exact {len(exact_top1)} / "
                         f"{len(exact_on_reader)}")
    agreed, diverged_at, kls = 0, None, []
    for j in range(k):
        reader = reader_top[j]
        if max(reader, key=reader.__getitem__) == exact_top1[j]:
            agreed += 1
        elif diverged_at is None:
            diverged_at = j
        if greedy:
            kls.append(coarse_kl(reader, exact_on_reader[j]))
    return TurnScore(k, agreed, diverged_at, sum(kls) / k if greedy and k else None)


def coarse_kl(reader: Mapping[int, float], exact: Mapping[int, float]) -> float:
    """KL(reader ‖ exact) over the reader's tokens plus one bucket for every other token (both:
    token id -> log-probability; ``exact`` holds every id of ``reader``)."""
    missing = [t for t in reader if t not in exact]
    if missing:
        raise ValueError(f"no exact log-probability for token {missing[0]}")
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for t, lp in reader.items():
        p, lq = math.exp(lp), exact[t]
        kl += p * (lp - lq)
        p_in += p
        q_in += math.exp(lq)
    p_out, q_out = max(0.0, 1.0 - p_in), max(1e-12, 1.0 - q_in)
    if p_out > 1e-12:
        kl += p_out * math.log(p_out / q_out)
    return max(0.0, kl)


@dataclass(frozen=True)
class Step:
    """One move of the loop, for the log and the counters.

    Attributes:
        key: the namespace, or ``(namespace, agent)``.
        before, after: levels.
        agreement: the window's top-1 agreement that moved it (1.0 for an exact level's turns).
        samples: turns in the window.
    """

    key: Hashable
    before: int
    after: int
    agreement: float
    samples: int

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"


@dataclass
class _Window:
    """One key's level, and the samples and exact turns served at it since it was reached."""

    level: int = 0
    scores: Tally = field(default_factory=Tally)
    exact_turns: int = 0


@dataclass
class FidelityLoop:
    """Levels per cache namespace and per agent, moved by sampled turns (module docstring);
    ``max_keys``: most keys held (least recently used forgotten first, at level 0 again)."""

    target: float = AGREEMENT_TARGET
    min_samples: int = MIN_SAMPLES
    healthy_samples: int = HEALTHY_SAMPLES
    max_keys: int = 4096
    _windows: dict[Hashable, _Window] = field(default_factory=dict)
    steps: deque[Step] = field(default_factory=lambda: deque(maxlen=256))

    def level(self, namespace: Hashable, agent: Hashable | None = None) -> int:
        """The level a request of ``agent`` in ``namespace`` is served at: the higher of the
        namespace's and, once it has had ``min_samples`` of its own, the agent's."""
        level = self._level(namespace)
        if agent is not None:
            level = max(level, self._level((namespace, agent)))
        return level

    def _level(self, key: Hashable) -> int:
        window = self._windows.get(key)
        return window.level if window is not None else 0

    def served(self, namespace: Hashable, agent: Hashable | None, level: int) -> list[Step]:
        """A turn was served at ``level``; an exact level's turns count toward stepping down."""
        if level != EXACT_LEVEL:
            return []
        out = []
        for key in self._keys(namespace, agent):
            window = self._window(key)
            if window.level == EXACT_LEVEL:
                window.exact_turns += 1
                if window.exact_turns >= self.healthy_samples:
                    out.append(self._move(key, window, -1))
        return out

    def add(self, namespace: Hashable, agent: Hashable | None, score: TurnScore,
            level: int | None = None) -> list[Step]:
        """Add a sampled reader turn's score to its namespace's and agent's windows; returns
        the steps it caused. ``level``: the level the turn was served at; a window at another
        level (it moved since, or the turn was served at the other key's higher level) does
        not count it (None: every window counts it)."""
        out = []
        for key in self._keys(namespace, agent):
            window = self._window(key)
            if level is not None and window.level != level:
                continue
            scores = window.scores
            scores.add(score)
            if scores.turns >= self.min_samples and scores.agreement < self.target \
                    and window.level < EXACT_LEVEL:
                out.append(self._move(key, window, +1))
            elif window.level > 0 and scores.turns >= self.healthy_samples \
                    and scores.agreement >= self.target:
                out.append(self._move(key, window, -1))
        return out

    def _keys(self, namespace: Hashable, agent: Hashable | None) -> list[Hashable]:
        return [namespace] if agent is None else [namespace, (namespace, agent)]

    def _window(self, key: Hashable) -> _Window:
        window = self._windows.pop(key, None) or _Window()
        self._windows[key] = window  # most recently used last
        while len(self._windows) > self.max_keys:
            self._windows.pop(next(iter(self._windows)))
        return window

    def _move(self, key: Hashable, window: _Window, by: int) -> Step:
        step = Step(key, window.level, window.level + by,
                    1.0 if window.level == EXACT_LEVEL else window.scores.agreement,
                    window.scores.turns)
        self._windows[key] = _Window(level=step.after)
        self.steps.append(step)
        return step

    def snapshot(self) -> dict:
        """Levels above 0 by key (as text) and the last steps, for ``/server_info``."""
        return {
            "raised": {repr(k): w.level for k, w in self._windows.items() if w.level > 0},
            "steps": [{"key": repr(s.key), "from": s.before, "to": s.after,
                       "agreement": round(s.agreement, 4), "samples": s.samples}
                      for s in list(self.steps)[-16:]],
        }
