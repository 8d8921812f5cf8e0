"""A delta leaf: how one agent's view of one shared segment deviates from the owner's base.

Per layer and KV head, the deviation of pre-RoPE keys and of values is held as low-rank factors
plus optional exact token overrides:

    view.k[l][t, h] = base.k[l][t, h] + sum_j u[h', t, j] * c[h, j, :]      (t not overridden)
    view.k[l][t]    = override.k[l][i]                                       (t = override.idx[i])

and likewise for values. Positions are not part of a leaf: the reader re-positions the view
(RoPE is applied when attention reads pre-RoPE keys). Bytes are counted once per distinct tensor,
so a coefficient matrix shared by several layers is paid for once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["DeltaLeaf", "LowRankFactors", "TokenOverride", "svd_factors", "tensors_nbytes"]


def tensors_nbytes(tensors) -> int:
    """Bytes of distinct tensors (deduplicated by storage pointer)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class LowRankFactors:
    """deviation[t, h, :] = sum_j u[h_u, t, j] * c[h, j, :].

    u: [1 or num_kv_heads, num_tokens, rank] (1 = coefficients shared by all heads);
    c: [num_kv_heads, rank, head_dim].
    """

    u: torch.Tensor
    c: torch.Tensor

    def __post_init__(self):
        if self.u.ndim != 3 or self.c.ndim != 3 or self.u.shape[2] != self.c.shape[1]:
            raise ValueError(f"bad factor shapes u{tuple(self.u.shape)} c{tuple(self.c.shape)}")
        if self.u.shape[0] not in (1, self.c.shape[0]):
            raise ValueError("u must have 1 or num_kv_heads heads")

    @property
    def rank(self) -> int:
        return int(self.c.shape[1])

    def dense(self) -> torch.Tensor:
        """[num_tokens, num_kv_heads, head_dim]."""
        return torch.einsum("htr,hrd->thd", self.u.expand(self.c.shape[0], -1, -1), self.c)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.u, self.c)


def svd_factors(dev: torch.Tensor, rank: int) -> LowRankFactors:
    """Best rank-``rank`` factors per head of ``dev: [T, H, d]`` (truncated SVD, fp32 or wider)."""
    x = dev.transpose(0, 1)  # [H, T, d]
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    r = min(rank, s.shape[-1])
    uu = (u[..., :r] * s[:, None, :r]).to(dev.dtype)
    return LowRankFactors(uu.contiguous(), vh[:, :r, :].to(dev.dtype).contiguous())


@dataclass(frozen=True)
class TokenOverride:
    """Exact K/V for some tokens of one layer. idx: [n] int64 (segment-relative);
    k, v: [n, num_kv_heads, head_dim]."""

    idx: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class DeltaLeaf:
    """One agent's deviation from the base over one segment; per-layer entries may be None."""

    agent: str
    segment_id: int
    k: tuple[LowRankFactors | None, ...]
    v: tuple[LowRankFactors | None, ...]
    overrides: tuple[TokenOverride | None, ...]

    def apply(self, base: KVCache) -> KVCache:
        """The agent's view: base + low-rank deviations, then overrides. Positions = base's."""
        ks, vs = [], []
        for layer in range(base.num_layers):
            k, v = base.k[layer], base.v[layer]
            fk, fv, ov = self.k[layer], self.v[layer], self.overrides[layer]
            if fk is not None:
                k = k + fk.dense()
            if fv is not None:
                v = v + fv.dense()
            if ov is not None:
                k = k.index_copy(0, ov.idx, ov.k)
                v = v.index_copy(0, ov.idx, ov.v)
            ks.append(k)
            vs.append(v)
        return KVCache(ks, vs, base.positions)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in (*self.k, *self.v):
            if f is not None:
                out.extend(f.tensors())
        for o in self.overrides:
            if o is not None:
                out.extend((o.idx, o.k, o.v))
        return out

    def nbytes(self) -> int:
        return tensors_nbytes(self.tensors())

    @classmethod
    def empty(cls, agent: str, segment_id: int, num_layers: int) -> DeltaLeaf:
        none = (None,) * num_layers
        return cls(agent, segment_id, none, none, none)
