"""Random batches for the delta-attention tests: a paged pool, readers, shared spans, deltas."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang_kvcmas.attention.delta_batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors


@dataclass(frozen=True)
class ReqSpec:
    """seq_len, num_queries, spans as (start, length, shift), and the delta rank of each span."""

    seq_len: int
    num_queries: int
    spans: tuple[tuple[int, int, int], ...] = ()
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Case:
    q: torch.Tensor  # [total_queries, H, d]
    k_buffer: torch.Tensor  # [pool_size, H_kv, d]
    v_buffer: torch.Tensor  # [pool_size, H_kv, d]
    requests: tuple[DeltaRequest, ...]
    factors: list[list[SpanFactors]]


def paged_slots(seq_len: int, page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of a sequence laid out on randomly chosen pages, as a paged allocator would."""
    pages = torch.randperm(num_pages, generator=gen)[: -(-seq_len // page_size)]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return slots[:seq_len].to(torch.int64)


def make_case(
    specs: list[ReqSpec],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    delta_scale: float = 0.3,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-s.seq_len // page_size) for s in specs) + 4
    pool = need * page_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    k_buffer, v_buffer = randn(pool, num_kv_heads, head_dim), randn(pool, num_kv_heads, head_dim)
    requests, factors = [], []
    for spec in specs:
        slots = paged_slots(spec.seq_len, page_size, pool // page_size, gen)
        spans = tuple(SharedSpan(*s) for s in spec.spans)
        requests.append(DeltaRequest(slots, spec.num_queries, spans))
        facs = []
        for span, rank in zip(spans, spec.ranks or (4,) * len(spans)):
            if rank == 0:
                facs.append(SpanFactors())
                continue

            def delta() -> LowRankDelta:
                return LowRankDelta(
                    randn(span.length, num_kv_heads, rank),
                    randn(num_kv_heads, head_dim, rank, scale=delta_scale / rank**0.5),
                )

            facs.append(SpanFactors(k=delta(), v=delta()))
        factors.append(facs)
    total_q = sum(s.num_queries for s in specs)
    q = randn(total_q, num_kv_heads * group, head_dim)
    to = lambda t: t.to(device)  # noqa: E731
    return Case(
        to(q),
        to(k_buffer),
        to(v_buffer),
        tuple(requests),
        [
            [
                SpanFactors(
                    *(None if d is None else LowRankDelta(to(d.u), to(d.c)) for d in (f.k, f.v))
                )
                for f in facs
            ]
            for facs in factors
        ],
    )
