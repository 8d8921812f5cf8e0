"""Which borrowed shared-context tokens a reader recomputes exactly (sparse correction).

A reader agent reads another agent's KV for the shared transcript re-positioned to its own
positions, except a few tokens it recomputes in its own context, in the same forward pass as its
new tokens. Two signals pick them, neither needing a reference prefill or a probe:

- **boundary**: the first tokens of each borrowed span deviate most (they attended most to the
  other agent's head); for a reader with an adapter, of each message too (``split_spans`` at
  ``message_starts``: the role adapters open their messages differently, and a turn's new
  messages, prefilled in one pass, are one span; ``benchmark/lab/lora_selector_study.py``);
- **owner head mass**: a shared token's attention output is λ·o_head + (1 − λ)·o_rest, so
  changing the head moves it in proportion to λ, its attention mass on the head. The owner's own
  pass records λ (``attention.spans.HeadMassProbe``); the tokens with the largest λ are
  recomputed (``benchmark/lab/owner_mass_study.py``).

Opt-in, **tail**: the last borrowed tokens before the reader's suffix (``tail_offsets``).

Pure functions over plain values; the tree cache (``integration/shared_tree_cache.py``) applies
them through :func:`select_recompute_arrays`. The lab's counterpart, which selects against a
reference prefill, is ``sglang_kvcmas_lab.correction.selection``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from sglang_kvcmas.config import ServingConfig

_DEFAULTS = ServingConfig()
_KNOB_OF = {"boundary_tokens": "recompute_boundary", "mass_fraction": "recompute_mass_fraction",
            "tail_tokens": "recompute_tail"}
"""``RecomputeConfig`` field -> the ``ServingConfig`` knob it comes from."""

MAX_FRACTION = 0.5
"""Most of a reader's borrowed tokens it recomputes under the boundary and tail rules, so a
transcript of many short spans never degenerates into a full prefill."""
MIN_BORROWED = 128
"""Fewest foreign tokens worth borrowing: fewer are computed exactly (they save little and risk
a flipped greedy token)."""
SEGMENT_SHARE = 0.2
"""Most of their borrowed tokens the readers of one new segment recompute by mass together."""


@dataclass(frozen=True)
class BorrowedSpan:
    """A run of borrowed shared-context tokens with one owner and one position shift.

    Attributes:
        begin: shared-context offset of the span's first token.
        end: shared-context offset one past its last token.
        foreign: whether the KV was computed in another context (another agent, or the same
            agent at other positions); only foreign spans deviate.
        shift: reader position − owner position of every token of the span.
        owner: agent id of the owner.
    """

    begin: int
    end: int
    foreign: bool
    shift: int = 0
    owner: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.begin < self.end:
            raise ValueError(f"bad borrowed span [{self.begin}, {self.end})")


@dataclass(frozen=True)
class BorrowedToken:
    """One borrowed token as selection sees it.

    Attributes:
        offset: shared-context offset.
        foreign: read from another context (deviates unless recomputed).
        from_leaf: read from the reader agent's own exact leaf (exact, but ranked by mass like a
            foreign token: :func:`mass_offsets`).
        mass: the owner's head mass of the token (0 where none was recorded).
    """

    offset: int
    foreign: bool
    from_leaf: bool = False
    mass: float = 0.0


@dataclass(frozen=True)
class RecomputeConfig:
    """Knobs of the boundary policy.

    Attributes:
        boundary_tokens: tokens recomputed at the start of every foreign span (0: none).
        mass_fraction: share of the borrowed foreign tokens recomputed in addition, largest owner
            head mass first (0: none).
        max_fraction: cap on the recomputed share of the borrowed tokens (:data:`MAX_FRACTION`).
        min_borrowed: fewest foreign tokens worth borrowing (``borrow_pays``).
        tail_tokens: the last foreign tokens before the reader's own suffix, recomputed (0:
            none); a reader's first answer tokens attend most to them.
        segment_share: :data:`SEGMENT_SHARE`, split among ``readers``
            (:attr:`reader_mass_fraction`; None: ``mass_fraction`` whatever the readers).
        readers: how many readers waited together for the segment this reader borrows (the
            turn-order hook counts them; 1: it waited alone or not at all).
    """

    boundary_tokens: int = _DEFAULTS.recompute_boundary
    mass_fraction: float = _DEFAULTS.recompute_mass_fraction
    max_fraction: float = MAX_FRACTION
    min_borrowed: int = MIN_BORROWED
    tail_tokens: int = _DEFAULTS.recompute_tail
    segment_share: float | None = SEGMENT_SHARE
    readers: int = 1

    def __post_init__(self) -> None:
        share = 0.0 if self.segment_share is None else self.segment_share
        if self.readers < 1 or min(self.boundary_tokens, self.min_borrowed, self.tail_tokens) < 0 \
                or not all(0.0 <= f <= 1.0 for f in (share, self.max_fraction, self.mass_fraction)):
            raise ValueError(f"bad recompute config {self}")

    @classmethod
    def from_serving(cls, config: ServingConfig, **overrides: float) -> RecomputeConfig:
        """The deployment's recompute knobs, with a request's overrides (knob names); the cap on
        the recomputed share is :data:`MAX_FRACTION`, or the mass share asked when larger (a
        request asking for every token by mass gets every token)."""
        values = {**{k: getattr(config, k) for k in _KNOB_OF.values()}, **overrides}
        fields = {field: values[k] for field, k in _KNOB_OF.items()}
        return cls(**fields, max_fraction=max(MAX_FRACTION, fields["mass_fraction"]))

    def with_readers(self, readers: int) -> RecomputeConfig:
        """This config for a reader that waited with ``readers - 1`` others."""
        return self if readers == self.readers else replace(self, readers=max(1, readers))

    def mass_tokens(self, num_borrowed: int) -> int:
        """How many of ``num_borrowed`` tokens the mass ranking takes (exact ones included)."""
        return round(self.reader_mass_fraction * num_borrowed)

    @property
    def reader_mass_fraction(self) -> float:
        """This reader's share by mass: ``mass_fraction``, or, among two or more readers, its
        part of ``segment_share`` when that is less."""
        if self.segment_share is None or self.readers == 1:
            return self.mass_fraction
        return min(self.mass_fraction, self.segment_share / self.readers)


def borrow_pays(foreign_tokens: int, config: RecomputeConfig) -> bool:
    """Whether a reader should borrow ``foreign_tokens`` of other contexts' KV at all: borrowing
    saves prefill in proportion to the tokens borrowed, but any borrowed span risks a flipped
    greedy token (:data:`MIN_BORROWED`)."""
    return foreign_tokens >= config.min_borrowed


def boundary_offsets(spans: Sequence[BorrowedSpan], config: RecomputeConfig) -> tuple[int, ...]:
    """Shared-context offsets to recompute: the first ``boundary_tokens`` of each foreign span,
    earliest spans first, at most ``max_fraction`` of all borrowed tokens (sorted, distinct)."""
    k = config.boundary_tokens
    if k == 0:
        return ()
    budget = int(config.max_fraction * sum(s.end - s.begin for s in spans))
    out: list[int] = []
    for span in sorted(spans, key=lambda s: s.begin):
        if not span.foreign:
            continue
        take = min(k, span.end - span.begin, budget - len(out))
        if take <= 0:
            break
        out.extend(range(span.begin, span.begin + take))
    return tuple(out)


def message_starts(tokens: Sequence[int] | np.ndarray, close: Sequence[int]) -> np.ndarray:
    """Offsets in ``tokens`` where a message begins: just after each ``close`` (the chat
    template's message close, e.g. ChatML's ``<|im_end|>`` ``\n``).

    Args:
        tokens: [T] token ids (a shared transcript, offset 0 its first token).
        close: the ids that end a message (not empty).
    Returns:
        [m] int64, increasing, each in ``(0, T]``.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    n = len(close)
    if n == 0:
        raise ValueError("message close must not be empty")
    if ids.shape[0] < n:
        return np.zeros(0, dtype=np.int64)
    hit = np.ones(ids.shape[0] - n + 1, dtype=bool)
    for j, tok in enumerate(close):
        hit &= ids[j : ids.shape[0] - n + 1 + j] == tok
    return np.flatnonzero(hit) + n


def split_spans(spans: Sequence[BorrowedSpan], cuts: Sequence[int] | np.ndarray
                ) -> list[BorrowedSpan]:
    """``spans`` (sorted, disjoint) with each one cut at every offset of ``cuts`` (any order)
    strictly inside it, so that :func:`boundary_offsets` takes the first tokens of every message
    rather than only of every span (a turn's new messages, prefilled in one pass, are one span).
    """
    points = np.unique(np.asarray(cuts, dtype=np.int64))
    out: list[BorrowedSpan] = []
    for span in spans:
        lo, hi = np.searchsorted(points, [span.begin + 1, span.end])
        edges = [span.begin, *points[lo:hi].tolist(), span.end]
        out.extend(replace(span, begin=a, end=b) for a, b in pairwise(edges))
    return out


def tail_offsets(spans: Sequence[BorrowedSpan], config: RecomputeConfig) -> tuple[int, ...]:
    """Shared-context offsets to recompute: the last ``tail_tokens`` foreign borrowed tokens
    (latest first, across spans), at most ``max_fraction`` of all borrowed tokens (sorted,
    distinct)."""
    budget = min(config.tail_tokens, int(config.max_fraction * sum(s.end - s.begin for s in spans)))
    out: list[int] = []
    for span in sorted(spans, key=lambda s: -s.end):
        if len(out) >= budget:
            break
        if span.foreign:
            out.extend(range(span.end - 1, max(span.begin, span.end - (budget - len(out))) - 1, -1))
    return tuple(sorted(out))


def mass_offsets(
    candidates: Sequence[int],
    mass: Sequence[float],
    exact: Collection[int],
    chosen: Sequence[int],
    num_borrowed: int,
    config: RecomputeConfig,
) -> tuple[int, ...]:
    """Offsets to recompute: ``chosen`` (the boundary) plus, among the other borrowed tokens, the
    ``mass_fraction`` (of all borrowed) with the largest owner head mass that are not already
    exact — within ``max_fraction`` recomputed.

    Ranking includes the tokens the reader already holds exactly (its exact leaves), so over a
    growing transcript the exact set stays the top share by mass and each turn recomputes only
    the top tokens of what is new.

    Args:
        candidates: shared offsets of borrowed tokens that deviate unless exact: foreign ones and
            ones the reader's exact leaves hold.
        mass: the owner's head mass of each candidate (0 where the owner recorded none).
        exact: candidates the reader already holds exactly (never recomputed).
        chosen: offsets already chosen (kept first; never dropped).
        num_borrowed: all borrowed tokens (the base of both fractions).
    """
    if len(candidates) != len(mass):
        raise ValueError(f"{len(candidates)} candidates but {len(mass)} masses")
    out = set(chosen)
    room = int(config.max_fraction * num_borrowed) - len(out)
    top = config.mass_tokens(num_borrowed)
    ranked = [i for i in sorted(range(len(candidates)), key=lambda i: -mass[i])
              if candidates[i] not in out]  # the boundary comes on top of the mass share
    for i in ranked[:top]:
        if room <= 0 or mass[i] <= 0.0:
            break  # over budget, or no signal left: the rest stays borrowed
        if candidates[i] not in exact:
            out.add(candidates[i])
            room -= 1
    return tuple(sorted(out))


def select_recompute(
    spans: Sequence[BorrowedSpan], tokens: Sequence[BorrowedToken], config: RecomputeConfig,
) -> tuple[int, ...]:
    """Every offset a reader recomputes under ``config`` (sorted, distinct): boundary first, then
    tail, within the ``max_fraction`` budget, then the top of the mass ranking
    (:func:`mass_offsets`). ``tokens``: every borrowed token in shared order. The reference that
    :func:`select_recompute_arrays` is tested against."""
    exact = {t.offset for t in tokens if not t.foreign}
    deviating = [t for t in tokens if t.foreign or t.from_leaf]
    budget = int(config.max_fraction * len(tokens))
    picked = dict.fromkeys([*boundary_offsets(spans, config), *tail_offsets(spans, config)])
    offsets = tuple(sorted([o for o in picked if o not in exact][:budget]))
    return mass_offsets([t.offset for t in deviating], [t.mass for t in deviating], exact,
                        offsets, len(tokens), config)


def select_recompute_arrays(
    spans: Sequence[BorrowedSpan], offsets: np.ndarray, foreign: np.ndarray,
    from_leaf: np.ndarray, mass: np.ndarray, config: RecomputeConfig,
) -> tuple[int, ...]:
    """:func:`select_recompute` over the borrowed tokens as arrays (the same offsets).

    Args:
        offsets: [B] int64 shared offsets of every borrowed token, consecutive.
        foreign: [B] bool; from_leaf: [B] bool; mass: [B] float owner head mass.
    """
    n = int(offsets.shape[0])
    if n == 0:
        return ()
    base = int(offsets[0])
    budget = int(config.max_fraction * n)
    picked = dict.fromkeys([*boundary_offsets(spans, config), *tail_offsets(spans, config)])
    chosen = sorted([o for o in picked if foreign[o - base]][:budget])
    room = budget - len(chosen)
    top = config.mass_tokens(n)
    if room <= 0 or top <= 0:
        return tuple(chosen)
    candidates = np.flatnonzero(foreign | from_leaf)
    if chosen:
        candidates = candidates[~np.isin(candidates, np.asarray(chosen, dtype=np.int64) - base)]
    ranked = top_by_mass(candidates, mass, top)
    stop = np.flatnonzero(mass[ranked] <= 0.0)
    if stop.size:
        ranked = ranked[: stop[0]]
    added = ranked[foreign[ranked]][:room] + base
    return tuple(sorted([*chosen, *added.tolist()]))


def top_by_mass(candidates: np.ndarray, mass: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` candidates with the largest mass, largest first, ties in candidate order (what
    a stable sort by descending mass would put first), without sorting all of them.

    Args:
        candidates: [c] int64 indices into ``mass``, increasing.
        mass: [B] float.
    Returns:
        [min(k, c)] int64.
    """
    m = mass[candidates]
    if k >= candidates.shape[0]:
        return candidates[np.argsort(-m, kind="stable")]
    kth = np.partition(m, m.shape[0] - k)[m.shape[0] - k]  # the k-th largest value
    above = np.flatnonzero(m > kth)
    ties = np.flatnonzero(m == kth)[: k - above.shape[0]]
    pick = np.concatenate([above, ties])
    pick.sort()  # candidate order, so the stable sort below keeps ties in it
    return candidates[pick[np.argsort(-m[pick], kind="stable")]]
