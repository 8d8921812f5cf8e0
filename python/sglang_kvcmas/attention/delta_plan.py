"""Host-side planning for the delta-attention kernels: KV tiles and packed delta factors.

``plan_delta_batch`` runs once per batch (layout only, no layer data); ``pack_delta_factors`` runs
once per layer. Both are plain torch and run on CPU; the kernels read their output.

# NOTE: a KV tile never crosses a span boundary, so inside a tile every token shares one shift δ and
# one basis C. The kernel then reconstructs a tile's deviation as one small matmul
# ``U_tile [BLOCK_N, r] @ Cᵀ [r, d]`` and rotates the base by one cos/sin row for the whole tile.
# The price is a partly filled tile at each span boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from sglang_kvcmas.attention.delta_batch import DeltaRequest, SpanFactors, check_factors

NO_SPAN = -1


@dataclass(frozen=True)
class DeltaPlan:
    """Index metadata for one batch, shared by every layer.

    Attributes:
        block_n: KV tile size the kernels must use.
        qo_indptr: [batch + 1] int32, request i's queries are rows ``qo_indptr[i]:qo_indptr[i+1]``.
        kv_indptr: [batch + 1] int32, offsets into ``kv_indices``.
        kv_indices: [total_kv] int32, pool slots of all requests concatenated.
        tile_indptr: [batch + 1] int32, request i's tiles are ``tile_indptr[i]:tile_indptr[i+1]``.
        tile_start: [num_tiles] int32, request-local index of a tile's first token.
        tile_len: [num_tiles] int32, 1..block_n.
        tile_span: [num_tiles] int32, global span id (row of the packed ``C``) or -1 (exact KV).
        tile_shift: [num_tiles] int32, δ of the tile's span (0 outside spans).
        tile_urow: [num_tiles] int32, row of the packed ``U`` holding the tile's first token.
        max_queries: largest ``num_queries`` of the batch.
        max_tiles: largest tile count of one request.
        span_rows: per global span, (first packed U row, length).
    """

    block_n: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    tile_indptr: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    tile_span: torch.Tensor
    tile_shift: torch.Tensor
    tile_urow: torch.Tensor
    max_queries: int
    max_tiles: int
    span_rows: tuple[tuple[int, int], ...]

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.shape[0]) - 1


@dataclass(frozen=True)
class PackedFactors:
    """One layer's deltas for a planned batch, zero-padded to rank ``block_r``.

    Attributes:
        k_u: [num_rows, H_kv, block_r] pre-RoPE key coefficients, rows per ``DeltaPlan.span_rows``.
        k_c: [num_spans, H_kv, d, block_r] key bases.
        v_u: [num_rows, H_kv, block_r] value coefficients.
        v_c: [num_spans, H_kv, d, block_r] value bases.
    A span without a K (or V) delta has zero rows there.
    """

    k_u: torch.Tensor
    k_c: torch.Tensor
    v_u: torch.Tensor
    v_c: torch.Tensor

    @property
    def block_r(self) -> int:
        return int(self.k_u.shape[-1])


def _regions(req: DeltaRequest) -> list[tuple[int, int, int]]:
    """(start, end, span index or -1) covering ``[0, seq_len)`` in order."""
    out, pos = [], 0
    for j, span in enumerate(req.spans):
        if span.start > pos:
            out.append((pos, span.start, NO_SPAN))
        out.append((span.start, span.end, j))
        pos = span.end
    if pos < req.seq_len:
        out.append((pos, req.seq_len, NO_SPAN))
    return out


def plan_delta_batch(
    requests: Sequence[DeltaRequest], block_n: int, device: torch.device | str = "cpu"
) -> DeltaPlan:
    """Tile every request's KV so that no tile crosses a span boundary."""
    qo, kv, tiles = [0], [0], [0]
    t_start, t_len, t_span, t_shift, t_urow = [], [], [], [], []
    span_rows: list[tuple[int, int]] = []
    rows = 0
    for req in requests:
        qo.append(qo[-1] + req.num_queries)
        kv.append(kv[-1] + req.seq_len)
        span_ids = []
        for span in req.spans:
            span_ids.append(len(span_rows))
            span_rows.append((rows, span.length))
            rows += span.length
        for start, end, j in _regions(req):
            for s in range(start, end, block_n):
                t_start.append(s)
                t_len.append(min(block_n, end - s))
                if j == NO_SPAN:
                    t_span.append(NO_SPAN), t_shift.append(0), t_urow.append(0)
                else:
                    sid = span_ids[j]
                    t_span.append(sid)
                    t_shift.append(req.spans[j].shift)
                    t_urow.append(span_rows[sid][0] + s - start)
        tiles.append(len(t_start))

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    kv_indices = (
        torch.cat([r.kv_indices.to(torch.int32) for r in requests]).to(device)
        if requests
        else i32([])
    )
    counts = [b - a for a, b in pairwise(tiles)]
    return DeltaPlan(
        block_n=block_n,
        qo_indptr=i32(qo),
        kv_indptr=i32(kv),
        kv_indices=kv_indices,
        tile_indptr=i32(tiles),
        tile_start=i32(t_start),
        tile_len=i32(t_len),
        tile_span=i32(t_span),
        tile_shift=i32(t_shift),
        tile_urow=i32(t_urow),
        max_queries=max((r.num_queries for r in requests), default=0),
        max_tiles=max(counts, default=0),
        span_rows=tuple(span_rows),
    )


def rank_block(max_rank: int) -> int:
    """Padded rank the kernels use: a power of two, at least 16 (``tl.dot``'s minimum K)."""
    r = 16
    while r < max_rank:
        r *= 2
    return r


def pack_delta_factors(
    plan: DeltaPlan,
    factors: Sequence[Sequence[SpanFactors]] | None,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    requests: Sequence[DeltaRequest] | None = None,
) -> PackedFactors:
    """Concatenate one layer's per-span factors into the planned rows, zero-padded in rank."""
    flat = [f for facs in (factors or []) for f in facs]
    if requests is not None:
        check_factors(list(requests), None if factors is None else [list(f) for f in factors])
    if factors is not None and len(flat) != len(plan.span_rows):
        raise ValueError(f"{len(flat)} span factors for {len(plan.span_rows)} planned spans")
    ranks = [d.rank for f in flat for d in (f.k, f.v) if d is not None]
    block_r = rank_block(max(ranks, default=1))
    num_rows = max(sum(n for _, n in plan.span_rows), 1)
    num_spans = max(len(plan.span_rows), 1)
    out = []
    for name in ("k", "v"):
        u = torch.zeros(num_rows, num_kv_heads, block_r, dtype=dtype, device=device)
        c = torch.zeros(num_spans, num_kv_heads, head_dim, block_r, dtype=dtype, device=device)
        for sid, f in enumerate(flat):
            delta = getattr(f, name)
            if delta is None:
                continue
            row0, n = plan.span_rows[sid]
            u[row0 : row0 + n, :, : delta.rank] = delta.u.to(device=device, dtype=dtype)
            c[sid, :, :, : delta.rank] = delta.c.to(device=device, dtype=dtype)
        out += [u, c]
    return PackedFactors(*out)
