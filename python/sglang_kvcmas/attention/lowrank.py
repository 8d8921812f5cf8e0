"""A reader agent's low-rank correction of the borrowed KV it reads, and its online estimator.

A reader reads another agent's KV re-positioned: ``x = R(δ)·k_owner`` for keys (the pool stores
keys rotated at the owner's positions; ``R(δ)`` moves them to the reader's), ``v_owner`` for
values. The correction is an affine low-rank map per layer and KV head, in the **reader's
frame** (after the shift), for keys and values alike::

    x_corr = x + (x·A + c)·Bᵀ          A, B: [head_dim, r], c: [r]

Fitted **online** from what serving already has: the borrowed tokens a reader recomputes in its
own context give, at their positions, pairs (exact K/V in the reader's context, the owner's K/V
re-positioned). :func:`fit_factors` is ridge least squares of ``y − x`` on ``[x, 1]`` followed by
a rank-``r`` truncated SVD of the ``[head_dim + 1, head_dim]`` map, shrunk by a two-fold
held-out scale (the lab's ``correction/kvcmas.py`` guard: a fit is trusted only as far as it
predicts recomputed tokens it was not fitted on, so it never makes the read worse on its own
evidence). No reference prefill.

Chaining: a reader's correction carries along its workflow. When it refits (a later turn, a new
segment), its stored correction is the prior: the map is pulled toward the stored one with
weight ``α`` (:func:`chain_weight`: the earlier pairs, discounted by the deployment's
``lowrank_chain``, over this turn's), i.e. it minimizes

    ‖z·W − dev‖² + α·‖S·(W − W_prev)‖² + λ‖W‖²,   W_prev = [A; c]·Bᵀ (the stored map),

``S² = diag(zᵀz)``: the earlier turns' evidence as ``α·n`` pairs with this turn's per-coordinate
scale but no correlations. A turn's ``n`` pairs (tens) span fewer than the ``d + 1`` input
directions, so replaying the prior on this turn's own inputs (``S² = zᵀz``) would add nothing
where this turn's pairs are silent; the diagonal does, at no storage beyond the factors
(``test/serving/test_lowrank.py`` and ``benchmark/lab/lowrank_chain_study.py`` measure it).
``α = 0`` is the per-turn fit, bit for bit.

Why the reader's frame: the read is then nearly free (``attention/corrected_reads.py``). The
score of a query against a corrected key is

    q·(x + (x·A + c)·Bᵀ) = (q + (q·B)·Aᵀ)·x + (q·B)·c,    and   q'·R(δ)·k = (R(−δ)·q')·k,

so decode corrects the query once, then rotates it per shift as before; a value correction is
applied to the attention output, ``Σp(v + (v·A + c)Bᵀ) = y + (y·A + (Σp)·c)·Bᵀ`` with
``y = Σp·v`` over the corrected keys. A map fitted in the owner's frame (before the shift) would
have to be applied before the rotation: the two orders differ because ``R(δ)`` does not commute
with ``A·Bᵀ`` (``test/serving/test_lowrank.py`` shows both).

Why per KV head (not shared across heads): each head's ``head_dim`` coordinates are its own
projection's, so one map over all heads would tie unrelated subspaces; per head costs
``H_kv×`` the bytes, still ``2·L·H_kv·(2·d·r + r)`` floats per agent (SmolLM2-135M, rank 8:
0.74 MB, about 16 tokens of exact KV).

Pure torch; no SGLang import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvcmas.attention.leaf_factors import LeafFactorFit, LeafReads, TokenDeltas

MIN_PAIRS = 16
"""Fewest recomputed (foreign) tokens a fit needs; with fewer, no factors are fitted."""
RIDGE = 0.05
"""Ridge strength, relative to the mean diagonal of the Gram of ``[x, 1]``."""
MAX_CHAIN_WEIGHT = 4.0
"""Most weight a stored correction gets against a turn's own pairs when they chain (``α``): a
long history never freezes the map."""


@dataclass(frozen=True)
class Factors:
    """``x ↦ x + (x·A + c)·Bᵀ`` per KV head.

    Attributes:
        a: [H_kv, d, r] float32.
        b: [H_kv, d, r] float32.
        c: [H_kv, r] float32.
    """

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    def __post_init__(self) -> None:
        h, d, r = self.a.shape
        if tuple(self.b.shape) != (h, d, r) or tuple(self.c.shape) != (h, r):
            raise ValueError(f"bad factor shapes a{tuple(self.a.shape)} b{tuple(self.b.shape)} "
                             f"c{tuple(self.c.shape)}")

    @property
    def rank(self) -> int:
        return int(self.a.shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.c))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, H_kv, d] → [n, H_kv, d] corrected, in ``x.dtype`` (computed in float32)."""
        xf = x.to(torch.float32)
        a, b, c = (t.to(x.device) for t in (self.a, self.b, self.c))
        u = torch.einsum("nhd,hdr->nhr", xf, a) + c
        return (xf + torch.einsum("nhr,hdr->nhd", u, b)).to(x.dtype)

    def query_side(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query that scores uncorrected keys as this map's corrected ones.

        Args:
            q: [H_kv, g, d] float32 queries (g per KV head).
        Returns:
            (q + (q·B)·Aᵀ: [H_kv, g, d], (q·B)·c: [H_kv, g] added to every corrected score).
        """
        a, b, c = (t.to(q.device) for t in (self.a, self.b, self.c))
        qb = q @ b  # [H_kv, g, r]
        return q + qb @ a.transpose(1, 2), (qb * c[:, None, :]).sum(-1)

    def output_side(self, y: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """``y + (y·A + mass·c)·Bᵀ``: the attention output over corrected values.

        Args:
            y: [H_kv, g, d] float32, ``Σ p·v`` over the corrected keys.
            mass: [H_kv, g] float32, ``Σ p`` over them.
        """
        a, b, c = (t.to(y.device) for t in (self.a, self.b, self.c))
        u = y @ a + mass[..., None] * c[:, None, :]
        return y + u @ b.transpose(1, 2)

    def dense(self) -> torch.Tensor:
        """[H_kv, d+1, d] float64 ``W = [A; c]·Bᵀ``: the map ``[x, 1]·W`` adds to ``x``."""
        a_aug = torch.cat([self.a, self.c[:, None, :]], dim=1).to(torch.float64)
        return a_aug @ self.b.to(torch.float64).transpose(1, 2)


@dataclass(frozen=True)
class LayerCorrection:
    """One layer's key and value factors (either may be None: not corrected), and the
    deviations of the row's tokens read through factored leaves (``attention/leaf_factors.py``;
    None: none)."""

    k: Factors | None = None
    v: Factors | None = None
    tokens: TokenDeltas | None = None

    def nbytes(self) -> int:
        return sum(f.nbytes() for f in (self.k, self.v) if f is not None)

    @property
    def active(self) -> bool:
        return self.affine or (self.tokens is not None and bool(self.tokens.rows.numel()))

    @property
    def affine(self) -> bool:
        """Whether the affine factors correct something (rank > 0)."""
        return any(f is not None and f.rank > 0 for f in (self.k, self.v))


@dataclass(frozen=True)
class LowRankCorrection:
    """One reader agent's correction: per layer, factors of its deviation from the owners' KV.

    Attributes:
        layers: layer id → its correction (layers absent: read uncorrected).
        rank: the rank asked for.
        pairs: recomputed tokens the factors were fitted on.
    """

    layers: dict[int, LayerCorrection]
    rank: int
    pairs: int = 0

    def layer(self, layer_id: int) -> LayerCorrection | None:
        """The layer's correction, or None when it corrects nothing (zero factors included)."""
        lc = self.layers.get(layer_id)
        return lc if lc is not None and lc.active else None

    def nbytes(self) -> int:
        return sum(lc.nbytes() for lc in self.layers.values())

    @classmethod
    def zero(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> LowRankCorrection:
        """Rank-0 factors on every layer: reads exactly as no correction."""
        empty = Factors(torch.zeros(num_kv_heads, head_dim, 0), torch.zeros(num_kv_heads,
                        head_dim, 0), torch.zeros(num_kv_heads, 0))
        return cls({i: LayerCorrection(empty, empty) for i in range(num_layers)}, 0)


def chain_weight(prior_pairs: float, pairs: int, chain: float) -> float:
    """``α``: the weight of a stored correction fitted on ``prior_pairs`` (effective) pairs
    against a refit on ``pairs``, its pairs discounted by ``chain`` (0: not chained), at most
    :data:`MAX_CHAIN_WEIGHT`."""
    if chain <= 0 or prior_pairs <= 0 or pairs <= 0:
        return 0.0
    return min(MAX_CHAIN_WEIGHT, chain * prior_pairs / pairs)


def fit_factors(x: torch.Tensor, y: torch.Tensor, rank: int, ridge: float = RIDGE,
                shrink: bool = True, prior: Factors | None = None,
                prior_weight: float = 0.0) -> Factors | None:
    """Affine low-rank map from base to exact, per KV head, by ridge + truncated SVD.

    Args:
        x: [n, H_kv, d] base (the owner's K or V, re-positioned: what the reader reads).
        y: [n, H_kv, d] exact (the reader's own K or V of the same tokens).
        rank: r, at most ``d``.
        ridge: ridge strength relative to the Gram's mean diagonal.
        shrink: scale each head's map by its two-fold held-out fit (in [0, 1]).
        prior: the agent's stored factors to chain from (any rank), or None.
        prior_weight: ``α`` (:func:`chain_weight`); 0 ignores ``prior``.
    Returns:
        Factors with ``y ≈ x + (x·A + c)·Bᵀ``, or None when ``n < MIN_PAIRS``.
    """
    n, h, d = x.shape
    if n < MIN_PAIRS or rank <= 0:
        return None
    xf = x.to(torch.float64).transpose(0, 1)  # [H, n, d]
    dev = (y.to(torch.float64) - x.to(torch.float64)).transpose(0, 1)
    z = torch.cat([xf, torch.ones(h, n, 1, dtype=xf.dtype)], dim=2)  # [H, n, d+1]
    chained = (prior.dense(), prior_weight) if prior is not None and prior_weight > 0 else None
    w = _ridge(z, dev, ridge, chained)  # [H, d+1, d]
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    r = min(rank, s.shape[-1])
    a_aug = u[..., :r] * s[:, None, :r]  # [H, d+1, r]
    b = vh[:, :r, :].transpose(1, 2)  # [H, d, r]
    if shrink:
        b = b * _held_out_scale(z, dev, ridge, r, chained)[:, None, None]
    return Factors(a_aug[:, :d].float().contiguous(), b.float().contiguous(),
                   a_aug[:, d].float().contiguous())


def _ridge(z: torch.Tensor, dev: torch.Tensor, ridge: float,
           chained: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """[H, d+1, d] ridge solution of ``z·W ≈ dev`` per head; with ``chained = (W_prev, α)``,
    pulled toward ``W_prev`` with weight ``α·diag(zᵀz)`` (module docstring)."""
    g = z.transpose(1, 2) @ z
    rhs = z.transpose(1, 2) @ dev
    if chained is not None:
        w_prev, alpha = chained
        prior_gram = alpha * g.diagonal(dim1=1, dim2=2)  # [H, d+1]
        rhs = rhs + prior_gram[..., None] * w_prev
        g = g + torch.diag_embed(prior_gram)
    reg = ridge * g.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)
    eye = torch.eye(g.shape[-1], dtype=g.dtype)
    return torch.linalg.solve(g + reg[:, None, None] * eye, rhs)


def _held_out_scale(z: torch.Tensor, dev: torch.Tensor, ridge: float, r: int,
                    chained: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """[H] scale in [0, 1]: least-squares scale of the rank-r prediction on the other fold."""
    n = z.shape[1]
    num = torch.zeros(z.shape[0], dtype=z.dtype)
    den = torch.zeros_like(num)
    idx = torch.arange(n)
    for fold in (0, 1):
        tr, te = idx[idx % 2 == fold], idx[idx % 2 != fold]
        w = _ridge(z[:, tr], dev[:, tr], ridge, chained)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        w_r = (u[..., :r] * s[:, None, :r]) @ vh[:, :r, :]
        pred = z[:, te] @ w_r
        num += (pred * dev[:, te]).sum((1, 2))
        den += (pred * pred).sum((1, 2))
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num)).clamp(0, 1)


@dataclass(eq=False)
class CorrectionFit:
    """Fits a reader's factors layer by layer during its extend, from its recomputed tokens.

    At each layer the attention backend gathers the pairs (the reader's exact K/V of the
    recomputed tokens, just written to the pool; the owner's K/V of the same tokens,
    re-positioned) and calls :meth:`fit_layer`; later layers, decode and (through the tree) the
    agent's later turns read the result.

    Attributes:
        owner_slots: [p] int64 pool slots of the owner's KV of the recomputed foreign tokens.
        owner_shifts: [p] int64 their shifts (reader position − owner position).
        exact_rows: [p] int64 row indices of the reader's exact KV of the same tokens.
        rank: the rank fitted.
        prior: the agent's stored correction to chain from (its earlier turns), or None.
        chain: the discount of the prior's pairs (0: fit from scratch; see :func:`chain_weight`).
        layers: layer id → fitted correction (filled during the extend).
    """

    owner_slots: torch.Tensor
    owner_shifts: torch.Tensor
    exact_rows: torch.Tensor
    rank: int
    prior: LowRankCorrection | None = None
    chain: float = 0.0
    layers: dict[int, LayerCorrection] = field(default_factory=dict)

    @property
    def pairs(self) -> int:
        return int(self.owner_slots.numel())

    @property
    def fits(self) -> bool:
        """Whether it has enough pairs to fit (known before the forward: for accounting)."""
        return self.pairs >= MIN_PAIRS and self.rank > 0

    @property
    def prior_weight(self) -> float:
        """``α`` of the prior against this fit's pairs (0: not chained)."""
        if self.prior is None:
            return 0.0
        return chain_weight(self.prior.pairs, self.pairs, self.chain)

    def fit_layer(self, layer_id: int, x_k: torch.Tensor, y_k: torch.Tensor,
                  x_v: torch.Tensor, y_v: torch.Tensor) -> LayerCorrection:
        """Fit and keep one layer's factors (chained from the prior's layer, if any).
        x_*, y_*: [p, H_kv, d] base and exact."""
        alpha = self.prior_weight
        prior = self.prior.layers.get(layer_id) if alpha > 0 else None
        pk, pv = (prior.k, prior.v) if prior is not None else (None, None)
        lc = LayerCorrection(fit_factors(x_k, y_k, self.rank, prior=pk, prior_weight=alpha),
                             fit_factors(x_v, y_v, self.rank, prior=pv, prior_weight=alpha))
        self.layers[layer_id] = lc
        return lc

    def result(self) -> LowRankCorrection | None:
        """The fitted correction, or None when nothing was fitted; its ``pairs`` count the
        prior's as weighted (the evidence the next turn chains from)."""
        if not self.layers:
            return None
        return LowRankCorrection(dict(self.layers), self.rank,
                                 round(self.pairs * (1 + self.prior_weight)))


@dataclass(frozen=True)
class RowCorrection:
    """How one row's borrowed keys are corrected.

    Attributes:
        mask: [m] bool row indices ``0 .. m-1`` read corrected (borrowed from another context:
            not own, not the agent's exact leaves, not recomputed); rows ``>= m`` are not.
        stored: the agent's correction from the tree (earlier turns), or None.
        fit: the fit this row's extend makes from its recomputed tokens, or None; a layer it
            fitted wins over ``stored``.
        leaves: the row's tokens read through the agent's factored leaves
            (``attention/leaf_factors.py``), or None.
        factor: the factoring of the tokens this row's extend recomputes and keeps as factored
            leaves, or None (it changes nothing this request reads).
    """

    mask: torch.Tensor
    stored: LowRankCorrection | None = None
    fit: CorrectionFit | None = None
    leaves: LeafReads | None = None
    factor: LeafFactorFit | None = None

    def layer(self, layer_id: int) -> LayerCorrection | None:
        """This layer's correction (None: read as uncorrected; rank-0 factors included)."""
        if self.fit is not None and layer_id in self.fit.layers:
            lc = self.fit.layers[layer_id]
        else:
            lc = self.stored.layer(layer_id) if self.stored is not None else None
        tokens = self.leaves.layer(layer_id) if self.leaves is not None and len(
            self.leaves) else None
        if tokens is not None:
            lc = LayerCorrection(lc.k if lc is not None else None,
                                 lc.v if lc is not None else None, tokens)
        return lc if lc is not None and lc.active else None

    def affine_at(self, layer_id: int) -> bool:
        """Whether the row's affine correction changes something at this layer."""
        if self.fit is not None and layer_id in self.fit.layers:
            lc = self.fit.layers[layer_id]
        else:
            lc = self.stored.layer(layer_id) if self.stored is not None else None
        return lc is not None and lc.affine

    def kernel_reads(self, layer_id: int) -> bool:
        """Whether the delta kernels can read the row at this layer: no affine factors here,
        and its factored tokens (if any) at their positions (``kernel_reads.place_leaves``)."""
        return not self.affine_at(layer_id) and (self.leaves is None
                                                 or self.leaves.in_row_order)

    @property
    def corrects(self) -> bool:
        """Whether every foreign borrowed token (``mask``) will be read through the affine
        correction (for accounting; factored leaves are counted by the tree's walk)."""
        return bool(self.mask.any()) and (
            (self.fit is not None and self.fit.fits)
            or (self.stored is not None and any(lc.affine for lc in self.stored.layers.values())))

    def mask_upto(self, n: int) -> torch.Tensor:
        """[n] bool ``mask`` cut or padded with False."""
        m = self.mask.numel()
        if n <= m:
            return self.mask[:n]
        return torch.cat([self.mask, torch.zeros(n - m, dtype=torch.bool)])

