"""Which borrowed shared-context tokens a reader recomputes exactly (sparse correction).

A reader agent reads another agent's KV for the shared transcript re-positioned to its own
positions. The deviation of that KV from what the reader would have computed is largest on the
first tokens of each borrowed span: they attended most to the context that differs (the other
agent's head, RESEARCH.md §7: deep-layer V deviation 0.29 on tokens 1–4 vs 0.06 after 256). The
serving path recomputes those tokens in the reader's own context, in the same forward pass as the
reader's new tokens (the lab's sparse exact-token correction, ``correction/kvcmas.py``), and reads
the rest of the span re-positioned.

Pure function over plain values; the tree cache (``integration/shared_tree_cache.py``) applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BorrowedSpan:
    """A run of borrowed shared-context tokens with one owner and one position shift.

    Attributes:
        begin: shared-context offset of the span's first token.
        end: shared-context offset one past its last token.
        foreign: whether the KV was computed in another context (another agent, or the same
            agent at other positions); only foreign spans deviate.
    """

    begin: int
    end: int
    foreign: bool

    def __post_init__(self) -> None:
        if not 0 <= self.begin < self.end:
            raise ValueError(f"bad borrowed span [{self.begin}, {self.end})")


@dataclass(frozen=True)
class RecomputeConfig:
    """Knobs of the boundary policy.

    Attributes:
        boundary_tokens: tokens recomputed at the start of every foreign span (0: naive reuse).
        max_fraction: cap on the recomputed share of the borrowed tokens, so a transcript of
            many short spans never degenerates into a full prefill.
    """

    boundary_tokens: int = 16
    max_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.boundary_tokens < 0 or not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"bad recompute config {self}")


def boundary_offsets(spans: Sequence[BorrowedSpan], config: RecomputeConfig) -> tuple[int, ...]:
    """Shared-context offsets to recompute: the first ``boundary_tokens`` of each foreign span,
    earliest spans first, at most ``max_fraction`` of all borrowed tokens.

    Returns:
        sorted, distinct offsets, each inside one of ``spans``.
    """
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
