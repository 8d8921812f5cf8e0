"""An affine low-rank correction of borrowed KV and its estimator from recomputed tokens.

Once served as leaf modes ``lowrank`` and ``lowrank+exact``; it read worse than naive
re-positioning in the server, so only the lab's studies fit it now
(``benchmark/lab/lowrank_estimator_study.py``, ``benchmark/lab/lowrank_chain_study.py``,
``benchmark/lab/precache_drift_study.py``).

A reader reads another agent's KV re-positioned: ``x = R(δ)·k_owner`` for keys (the pool stores
keys rotated at the owner's positions; ``R(δ)`` moves them to the reader's), ``v_owner`` for
values. The correction is an affine low-rank map per layer and KV head, in the **reader's
frame** (after the shift), for keys and values alike::

    x_corr = x + (x·A + c)·Bᵀ          A, B: [head_dim, r], c: [r]

Fitted from pairs (exact K/V in the reader's context, the owner's K/V re-positioned) of the
borrowed tokens a reader recomputes. :func:`fit_factors` is ridge least squares of ``y − x`` on
``[x, 1]`` followed by a rank-``r`` truncated SVD of the ``[head_dim + 1, head_dim]`` map, shrunk
by a two-fold held-out scale (the lab's ``correction/kvcmas.py`` guard: a fit is trusted only as
far as it predicts recomputed tokens it was not fitted on, so it never makes the read worse on
its own evidence).

Chaining: a reader's correction carries along its workflow. When it refits (a later turn, a new
segment), its earlier correction is the prior: the map is pulled toward it with weight ``α``
(:func:`chain_weight`: the earlier pairs, discounted by ``chain``, over this turn's), i.e. it
minimizes

    ‖z·W − dev‖² + α·‖S·(W − W_prev)‖² + λ‖W‖²,   W_prev = [A; c]·Bᵀ (the prior map),

``S² = diag(zᵀz)``: the earlier turns' evidence as ``α·n`` pairs with this turn's per-coordinate
scale but no correlations. A turn's ``n`` pairs (tens) span fewer than the ``d + 1`` input
directions, so replaying the prior on this turn's own inputs (``S² = zᵀz``) would add nothing
where this turn's pairs are silent; the diagonal does, at no storage beyond the factors
(``test/lab/correction/test_affine_lowrank.py`` and ``benchmark/lab/lowrank_chain_study.py``
measure it). ``α = 0`` is the per-turn fit, bit for bit.

Why the reader's frame: a map fitted in the owner's frame (before the shift) would have to be
applied before the rotation, and ``R(δ)`` does not commute with ``A·Bᵀ``
(``test/lab/correction/test_affine_lowrank.py`` shows both).

Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PAIRS = 16
"""Fewest recomputed (foreign) tokens a fit needs; with fewer, no factors are fitted."""
RIDGE = 0.05
"""Ridge strength, relative to the mean diagonal of the Gram of ``[x, 1]``."""
MAX_CHAIN_WEIGHT = 4.0
"""Most weight a prior correction gets against a turn's own pairs when they chain (``α``): a
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

    def dense(self) -> torch.Tensor:
        """[H_kv, d+1, d] float64 ``W = [A; c]·Bᵀ``: the map ``[x, 1]·W`` adds to ``x``."""
        a_aug = torch.cat([self.a, self.c[:, None, :]], dim=1).to(torch.float64)
        return a_aug @ self.b.to(torch.float64).transpose(1, 2)


def chain_weight(prior_pairs: float, pairs: int, chain: float) -> float:
    """``α``: the weight of a prior correction fitted on ``prior_pairs`` (effective) pairs
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
        prior: the factors to chain from (any rank), or None.
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
