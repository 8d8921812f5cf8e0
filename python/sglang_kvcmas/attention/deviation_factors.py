"""A reader's recomputed tokens kept as low-rank factors of their deviation: factored leaves.

A reader recomputes some borrowed tokens in its own context (``policy/recompute.py``). Exact
leaves keep their full K/V (``tree/pool_overrides.py``: one pool slot each). Factored leaves keep
only what differs from the owner's KV it already shares, compressed: per layer and KV head, the
deviation of the recomputed tokens from the owner's re-positioned K/V (the pairs the extend
already holds, ``span_reads.gather_pairs``), cut to rank ``r`` by a truncated SVD::

    D = y − x ≈ C·Bᵀ        D: [p, d] per layer and KV head;  C: [p, r];  B: [d, r]

Keys before RoPE: each token's key deviation is rotated back from its position (``R(−p)·D``)
before the cut and forward again when read, so one basis serves tokens at every position (the
values have no RoPE; cut before RoPE rather than in the reader's frame because it recovers more
KL, ``docs/results.md``). A later turn reads such a token as the owner's slot, re-positioned,
plus its row of ``C·Bᵀ`` (rotated to its position): exact up to the truncation, with no fitted
map that has to generalize to tokens it never saw.

Bytes: a token costs ``2·L·H_kv·r`` floats (K and V coefficients) instead of ``2·L·H_kv·d``, plus
one basis ``2·L·H_kv·d·r`` per fit shared by all the tokens of that fit, so ``p`` tokens cost
``r·(p + d) / (p·d)`` of their exact leaves.

The fit is :class:`LeafFactorFit` (during the reader's extend); the stored factors are
:class:`TokenFactors` under a :class:`FactorBasis`; a row reads them through :class:`LeafReads`,
one layer at a time as :class:`TokenDeltas`; :class:`RowLeaves` is the backend's view of a row
(``spans.RowSpans.leaves``); :func:`reference_leaf_attention` is the naive reference.

Pure torch; no SGLang import.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, as_shift_rope


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def factor_deviation(dev: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the rank-``rank`` truncated SVD of a deviation, from the eigenvectors of its
    smaller Gram matrix (``min(p, d)`` square, float64): faster on CPU than the SVD
    (:func:`factor_deviation_reference`) for the tokens a reader recomputes, and the same
    approximation up to rounding.

    Args:
        dev: [p, H_kv, d] deviation of ``p`` tokens.
        rank: r >= 1; directions past ``min(p, d)`` are zero.
    Returns:
        (coef [p, H_kv, r], basis [H_kv, d, r]) float32 with ``dev[:, h] ≈ coef[:, h] @
        basis[h].T``, the best rank-r approximation in Frobenius norm (basis columns
        orthonormal, singular values in ``coef``).
    """
    p, h, d = dev.shape
    coef = torch.zeros(p, h, rank, dtype=torch.float32)
    basis = torch.zeros(h, d, rank, dtype=torch.float32)
    if p == 0:
        return coef, basis
    x = dev.to(torch.float64).transpose(0, 1)  # [H_kv, p, d]
    r = min(rank, p, d)
    if p >= d:  # right singular vectors: eigenvectors of x^T x, largest last
        vecs = torch.linalg.eigh(x.transpose(1, 2) @ x)[1][..., -r:].flip(-1)  # [H_kv, d, r]
        c = x @ vecs
    else:  # left singular vectors from x x^T, then v = x^T u / s
        vals, vecs = torch.linalg.eigh(x @ x.transpose(1, 2))
        u = vecs[..., -r:].flip(-1)  # [H_kv, p, r]
        sv = vals[..., -r:].flip(-1).clamp_min(0).sqrt()  # [H_kv, r]
        c = u * sv[:, None, :]
        scale = torch.where(sv > 0, 1 / sv.clamp_min(torch.finfo(sv.dtype).tiny),
                            torch.zeros_like(sv))
        vecs = (x.transpose(1, 2) @ u) * scale[:, None, :]
    coef[:, :, :r] = c.transpose(0, 1).float()
    basis[:, :, :r] = vecs.float()
    return coef, basis


def factor_deviation_reference(dev: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`factor_deviation` by ``torch.linalg.svd`` (the tests' reference)."""
    p, h, d = dev.shape
    coef = torch.zeros(p, h, rank, dtype=torch.float32)
    basis = torch.zeros(h, d, rank, dtype=torch.float32)
    if p == 0:
        return coef, basis
    u, s, vh = torch.linalg.svd(dev.to(torch.float64).transpose(0, 1), full_matrices=False)
    r = min(rank, s.shape[-1])
    coef[:, :, :r] = (u[..., :r] * s[:, None, :r]).transpose(0, 1).float()
    basis[:, :, :r] = vh[:, :r, :].transpose(1, 2).float()
    return coef, basis


@dataclass(frozen=True, eq=False)
class FactorBasis:
    """The right factors ``k``, ``v``: [L, H_kv, d, r] float32 one fit made, shared by its
    ``tokens`` (a part of them carries that share of the bytes)."""

    k: torch.Tensor
    v: torch.Tensor
    tokens: int

    def nbytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v)


@dataclass(frozen=True, eq=False)
class TokenFactors:
    """Coefficients ``k``, ``v``: [L, m, H_kv, r] float32 of ``m`` tokens under one
    :class:`FactorBasis`, every layer."""

    k: torch.Tensor
    v: torch.Tensor
    basis: FactorBasis

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.ndim != 4 or \
                self.k.shape[0] != self.basis.k.shape[0] or \
                self.k.shape[-1] != self.basis.k.shape[-1]:
            raise ValueError(f"coefficients {tuple(self.k.shape)} / {tuple(self.v.shape)} do not "
                             f"match basis {tuple(self.basis.k.shape)}")

    def __len__(self) -> int:
        return int(self.k.shape[1])

    @property
    def rank(self) -> int:
        return int(self.k.shape[-1])

    def select(self, idx: torch.Tensor) -> TokenFactors:
        """The tokens ``idx`` ([j] int64 or bool), same basis."""
        return TokenFactors(self.k[:, idx].contiguous(), self.v[:, idx].contiguous(), self.basis)

    def nbytes(self) -> int:
        """Coefficient bytes plus these tokens' share of the basis (its bytes over the fit's
        tokens): the parts of one fit add up to what it holds, however the tree splits them."""
        share = -(-self.basis.nbytes() * len(self) // max(1, self.basis.tokens))
        return _nbytes(self.k) + _nbytes(self.v) + share

    def deviations(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([m, H_kv, d], [m, H_kv, d]) float32: the tokens' K (before RoPE) and V deviations
        at ``layer``."""
        b = self.basis
        return (torch.einsum("mhr,hdr->mhd", self.k[layer], b.k[layer]),
                torch.einsum("mhr,hdr->mhd", self.v[layer], b.v[layer]))


@dataclass(eq=False)
class LeafFactorFit:
    """Factors a reader's kept recomputed tokens layer by layer during its extend.

    At each layer the attention backend gathers the pairs (``span_reads.gather_pairs``) and calls
    :meth:`fit_layer`; the request reads its own exact tokens meanwhile, and at its checkpoint
    the tree keeps :meth:`result` as the agent's factored leaves.

    Attributes:
        owner_slots: [p] int64 pool slots of the owner's KV of the tokens.
        owner_shifts: [p] int64 their shifts (reader position − owner position).
        exact_rows: [p] int64 row indices of the reader's exact KV of the same tokens.
        offsets: [p] int64 their shared offsets (where the tree keeps them).
        positions: [p] int64 their positions in the reader's sequence (the key deviations are
            factored before RoPE: rotated back from there).
        layers: layer id → (K coef, K basis, V coef, V basis), filled during the extend.
    """

    owner_slots: torch.Tensor
    owner_shifts: torch.Tensor
    exact_rows: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor
    rank: int
    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def pairs(self) -> int:
        return int(self.owner_slots.numel())

    @property
    def fits(self) -> bool:
        return self.pairs > 0 and self.rank > 0

    def fit_layer(self, layer_id: int, x_k: torch.Tensor, y_k: torch.Tensor,
                  x_v: torch.Tensor, y_v: torch.Tensor, rope: ShiftRope | torch.Tensor) -> None:
        """Factor one layer's deviations. x_*, y_*: [p, H_kv, d] base and exact (keys in the
        reader's frame, after RoPE at ``positions``)."""
        dev_k = apply_rope(y_k.float() - x_k.float(), -self.positions, rope)
        self.layers[layer_id] = (*factor_deviation(dev_k, self.rank),
                                 *factor_deviation(y_v.float() - x_v.float(), self.rank))

    def result(self) -> TokenFactors | None:
        """Every layer's factors stacked, or None unless layers ``0 .. L-1`` were all fitted."""
        if not self.layers or sorted(self.layers) != list(range(len(self.layers))):
            return None
        ck, bk, cv, bv = (torch.stack([self.layers[i][j] for i in range(len(self.layers))])
                          for j in range(4))
        return TokenFactors(ck, cv, FactorBasis(bk, bv, self.pairs))


@dataclass(frozen=True, eq=False)
class TokenDeltas:
    """One layer's deviations of a row's factored tokens, in row coordinates.

    Attributes:
        rows: [m] int64 row indices.
        positions: [m] int64 their positions in the reader's sequence.
        k: [m, H_kv, d] float32 key deviations before RoPE (rotated to ``positions`` when
            added).
        v: [m, H_kv, d] float32 value deviations.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def apply(self, k: torch.Tensor, v: torch.Tensor, rope: ShiftRope | torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [n, H_kv, d] a gathered row (a copy, re-positioned); rows ``>= n`` are skipped.
        Returns new tensors in the inputs' dtypes."""
        keep = self.rows < k.shape[0]
        rows = self.rows[keep].to(k.device)
        if not rows.numel():
            return k, v
        dk = apply_rope(self.k, self.positions, rope)[keep].to(k.device)
        k, v = k.clone(), v.clone()
        k[rows] = (k[rows].to(torch.float32) + dk).to(k.dtype)
        v[rows] = (v[rows].to(torch.float32) + self.v[keep].to(v.device)).to(v.dtype)
        return k, v


class MaterializedBytes:
    """Bytes of factored deviations held materialized by live rows (:meth:`LeafReads.layer`),
    now and at their peak, in this process: host memory beside the KV pool and the stored
    factors, which ``/server_info`` reports (``materialized_leaf_bytes``)."""

    now = 0
    peak = 0

    @classmethod
    def add(cls, n: int) -> None:
        cls.now += n
        cls.peak = max(cls.peak, cls.now)

    @classmethod
    def restart(cls) -> None:
        """Count the peak from what is held now (a cache reset)."""
        cls.peak = cls.now

    @classmethod
    def release(cls, held: list[int]) -> None:
        cls.now -= held[0]
        held[0] = 0


class LeafReads:
    """A row's tokens read through its agent's factored leaves.

    ``parts``: per stored part, (row indices [j] int64, their positions [j] int64, their
    :class:`TokenFactors`).
    """

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, TokenFactors]]):
        self.parts = [(rows, pos, f) for rows, pos, f in parts if rows.numel()]
        empty = torch.empty(0, dtype=torch.int64)
        self.rows = torch.cat([p[0] for p in self.parts]) if self.parts else empty
        self.positions = torch.cat([p[1] for p in self.parts]) if self.parts else empty
        self._layers: dict[int, TokenDeltas | None] = {}
        self._owner_frame: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._held = [0]  # bytes materialized, released when the row is dropped
        weakref.finalize(self, MaterializedBytes.release, self._held)

    def __len__(self) -> int:
        return int(self.rows.numel())

    @property
    def in_row_order(self) -> bool:
        """Whether every token sits at its position (the delta kernels read it then)."""
        return bool(torch.equal(self.rows, self.positions))

    def layer(self, layer_id: int) -> TokenDeltas | None:
        """The layer's deltas, or None where every factor is zero (the row then reads as it
        would without them, bit for bit).

        Materialized once per layer and kept while the row is read, since a decode step reads
        every layer again: while its request runs, a row holds its factored tokens' deviations
        at full size, float32 (:meth:`materialized_nbytes`); the tree keeps only the factors."""
        if layer_id in self._layers:
            return self._layers[layer_id]
        out = None
        if any(bool(f.k[layer_id].any() or f.v[layer_id].any()) for _, _, f in self.parts):
            ks, vs = zip(*(f.deviations(layer_id) for _, _, f in self.parts))
            out = TokenDeltas(self.rows, self.positions, torch.cat(ks), torch.cat(vs))
            n = _nbytes(out.k) + _nbytes(out.v)
            self._held[0] += n
            MaterializedBytes.add(n)
        self._layers[layer_id] = out
        return out

    def in_owner_frame(self, layer_id: int, shift: torch.Tensor, rope: ShiftRope | torch.Tensor,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's deviations as a decode step adds them to its gathered keys and values:
        (key deviations rotated to ``positions − shift``, where the gathered owner's key sits,
        [m, H_kv, d]; value deviations [m, H_kv, d]), float32 on ``device``, or None as
        :meth:`layer`.

        ``shift``: [m] int64 each factored token's shift in the reading row. Kept per layer with
        the shifts they were rotated for (a row's shifts hold while it decodes), so a decode step
        pays no rotation; counted in :meth:`materialized_nbytes`.
        """
        shift = shift.cpu()  # compared on the host: no device copy on a step that hits
        kept = self._owner_frame.get(layer_id)
        if kept is not None and kept[1].device == device and torch.equal(kept[0], shift):
            return kept[1], kept[2]
        td = self.layer(layer_id)
        if td is None:
            return None
        dk = apply_rope(td.k, td.positions - shift.to(td.positions.device), rope).to(device)
        dv = td.v.to(device)
        if kept is None:
            n = _nbytes(dk) + (_nbytes(dv) if dv.device != td.v.device else 0)
            self._held[0] += n
            MaterializedBytes.add(n)
        self._owner_frame[layer_id] = (shift, dk, dv)
        return dk, dv

    def release(self) -> None:
        """Drop the expanded deviations now (the request is done; a batch plan of its last step
        may still hold this object): a later read expands them again."""
        self._layers.clear()
        self._owner_frame.clear()
        MaterializedBytes.release(self._held)

    def materialized_nbytes(self) -> int:
        """Bytes of the deviations :meth:`layer` and :meth:`in_owner_frame` hold now."""
        return self._held[0]


@dataclass(frozen=True)
class RowLeaves:
    """What one row reads and keeps through its agent's factored leaves.

    Attributes:
        reads: the row's tokens read through the agent's factored leaves, or None.
        factor: the factoring of the tokens this row's extend recomputes and keeps as factored
            leaves, or None (it changes nothing this request reads).
    """

    reads: LeafReads | None = None
    factor: LeafFactorFit | None = None

    def layer(self, layer_id: int) -> TokenDeltas | None:
        """The deviations the row adds at this layer, or None (none read; :meth:`LeafReads.layer`)."""
        return self.reads.layer(layer_id) if self.reads is not None and len(self.reads) else None

    @property
    def kernel_reads(self) -> bool:
        """Whether the delta kernels can read the row: its factored tokens (if any) at their
        positions (``kernel_reads.place_leaves``)."""
        return self.reads is None or self.reads.in_row_order


def reference_leaf_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
    k_pos: torch.Tensor, key_shift: torch.Tensor, rope: ShiftRope | torch.Tensor, scale: float,
    tokens: TokenDeltas | None,
) -> torch.Tensor:
    """Attention over a row whose every borrowed key is re-positioned and whose factored tokens
    carry their deviation, one key at a time: the naive reference the backend's extend and
    decode are tested against.

    Args:
        q: [n_q, H, d] queries (RoPE applied at ``q_pos``).
        k: [n, H_kv, d] keys as the pool stores them (rotated at their owners' positions).
        v: [n, H_kv, d] values.
        q_pos, k_pos: [n_q], [n] true positions (a query sees keys at positions <= its own).
        key_shift: [n] int64 shift of each key (0: own).
        tokens: the layer's deviations of the row's factored tokens, added to their rows (the
            key's rotated to its position), or None (re-positioned only).
    Returns:
        [n_q, H, d] float32.
    """
    rope = as_shift_rope(rope)
    keys, vals = [], []
    for j in range(k.shape[0]):
        kj, vj = k[j : j + 1].to(torch.float32), v[j : j + 1].to(torch.float32)
        if int(key_shift[j]):
            kj = apply_rope(kj, key_shift[j : j + 1], rope)
        if tokens is not None:
            at = torch.nonzero(tokens.rows == j).flatten()[:1]
            if at.numel():  # a factored leaf's token: its deviation, the key's at its position
                kj = kj + apply_rope(tokens.k[at], tokens.positions[at], rope)
                vj = vj + tokens.v[at]
        keys.append(kj)
        vals.append(vj)
    kk, vv = torch.cat(keys), torch.cat(vals)  # [n, H_kv, d]
    g = q.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), kk) * scale
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)
