"""Per-request shared-span metadata, handed from the tree cache to the attention backend.

The tree cache decides, when a request's KV row is allocated, which ranges of the row are read
from another agent's KV and by how much they must be re-positioned; the attention backend needs
exactly that for every layer of every forward of the request. Both run in the scheduler process
(the model runner lives there for tp_size 1), so a process-global table keyed by
``req_pool_idx`` (the row index SGLang passes the backend as ``forward_batch.req_pool_indices``)
is the hand-over. A row is registered after allocation and cleared when the request releases it,
before the row can be handed to another request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_kvcmas.attention.batch import SharedSpan, SpanFactors


@dataclass(frozen=True)
class SpanRead:
    """How one shared span of a request's row is read.

    Attributes:
        span: request-local start (= reader position), length, shift δ = reader − owner position.
        factors: per-layer correction ``layer_id -> SpanFactors`` (pre-RoPE K delta, V delta), or
            None for naive reuse (re-positioned, uncorrected).
    """

    span: SharedSpan
    factors: Callable[[int], SpanFactors] | None = None


@dataclass(frozen=True)
class RowSpans:
    """Every shared span of one request row, sorted and disjoint."""

    rid: str
    reads: tuple[SpanRead, ...]

    @property
    def needs_transform(self) -> bool:
        return any(r.span.shift != 0 or r.factors is not None for r in self.reads)


class SpanRegistry:
    """``req_pool_idx -> RowSpans`` for the rows that read shared spans."""

    def __init__(self) -> None:
        self._rows: dict[int, RowSpans] = {}

    def set(self, req_pool_idx: int, spans: RowSpans) -> None:
        self._rows[int(req_pool_idx)] = spans

    def get(self, req_pool_idx: int) -> RowSpans | None:
        return self._rows.get(int(req_pool_idx))

    def clear(self, req_pool_idx: int | None) -> None:
        if req_pool_idx is not None:
            self._rows.pop(int(req_pool_idx), None)

    def reset(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)


SPANS = SpanRegistry()
"""The registry of this process (one scheduler per process)."""
