"""Batch description for attention that reads shared-segment KV through per-agent deltas.

One request is one reader agent's sequence. Its KV tokens live in SGLang's paged pool
(``k_buffer``/``v_buffer: [pool_size, num_kv_heads, head_dim]``) at the slots ``kv_indices``, in the
reader's position order: the token at request-local index ``j`` sits at reader position ``j``.
The last ``num_queries`` tokens are the new tokens being computed (extend; decode has one); their
queries attend causally to every earlier token and to themselves.

Some earlier ranges are *shared spans*: KV computed by another agent (the owner), stored once,
and read by this reader through a position shift and a low-rank delta::

    request-local index  0 ........ s ............. s+L ........ n-q ....... n
                         | own head | shared span  | own tokens |  queries  |
                         | exact    | base + delta | exact      |  exact    |
                                      owner position of index j = j − shift

Layout (spans, positions) is decided once per batch; delta factors differ per layer, so they are
passed separately (:class:`SpanFactors`, one per span, per layer call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas.attention.spans import SharedSpan

__all__ = ["DeltaRequest", "LowRankDelta", "SharedSpan", "SpanFactors"]


@dataclass(frozen=True)
class LowRankDelta:
    """A per-KV-head low-rank deviation: ``deviation[t, h] = u[t, h] @ c[h].T``.

    Attributes:
        u: [span_length, num_kv_heads, rank] per-token coefficients.
        c: [num_kv_heads, head_dim, rank] per-head basis, shared by the span's tokens.
    """

    u: torch.Tensor
    c: torch.Tensor

    def __post_init__(self) -> None:
        if self.u.dim() != 3 or self.c.dim() != 3:
            raise ValueError(
                f"u must be 3-D and c 3-D, got {tuple(self.u.shape)}, {tuple(self.c.shape)}"
            )
        if self.u.shape[1] != self.c.shape[0] or self.u.shape[2] != self.c.shape[2]:
            raise ValueError(f"u {tuple(self.u.shape)} does not match c {tuple(self.c.shape)}")

    @property
    def rank(self) -> int:
        return self.u.shape[2]

    def dense(self) -> torch.Tensor:
        """The deviation itself: [span_length, num_kv_heads, head_dim] float32."""
        return torch.einsum("thr,hdr->thd", self.u.float(), self.c.float())


@dataclass(frozen=True)
class SpanFactors:
    """One layer's delta for one (span, reader).

    Attributes:
        k: deviation of the reader's **pre-RoPE** keys from the owner's, or None.
        v: deviation of the reader's values from the owner's, or None.

    With both None the span is read re-positioned but uncorrected ("naive reuse").
    The LoRA form of PReCache (``V = V0 + s·a·B``) is ``LowRankDelta(u=a, c=s·Bᵀ)``.
    """

    k: LowRankDelta | None = None
    v: LowRankDelta | None = None


@dataclass(frozen=True)
class DeltaRequest:
    """One reader's sequence in the batch.

    Attributes:
        kv_indices: [seq_len] int64 pool slots in reader position order (queries' own KV included).
        num_queries: new tokens at the end of the sequence (extend length; 1 for decode).
        spans: shared spans, sorted, disjoint, inside ``[0, seq_len − num_queries)``.
    """

    kv_indices: torch.Tensor
    num_queries: int
    spans: tuple[SharedSpan, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_indices.dim() != 1:
            raise ValueError("kv_indices must be 1-D")
        if not 1 <= self.num_queries <= self.seq_len:
            raise ValueError(f"num_queries={self.num_queries} outside [1, {self.seq_len}]")
        prev_end = 0
        for span in self.spans:
            if span.start < prev_end:
                raise ValueError(f"spans must be sorted and disjoint: {self.spans}")
            prev_end = span.end
        if prev_end > self.prefix_len:
            raise ValueError(f"span ends at {prev_end}, past the cached prefix {self.prefix_len}")

    @property
    def seq_len(self) -> int:
        return int(self.kv_indices.shape[0])

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.num_queries


def check_factors(
    requests: tuple[DeltaRequest, ...] | list[DeltaRequest], factors: list[list[SpanFactors]] | None
) -> None:
    """Raise unless ``factors[i][j]`` exists for every span j of request i, with matching length."""
    if factors is None:
        return
    if len(factors) != len(requests):
        raise ValueError(f"{len(factors)} factor lists for {len(requests)} requests")
    for req, facs in zip(requests, factors):
        if len(facs) != len(req.spans):
            raise ValueError(f"{len(facs)} factors for {len(req.spans)} spans")
        for span, f in zip(req.spans, facs):
            for d in (f.k, f.v):
                if d is not None and d.u.shape[0] != span.length:
                    raise ValueError(f"delta has {d.u.shape[0]} rows for a span of {span.length}")
