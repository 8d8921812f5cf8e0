"""KVCMAS: a reader sees the owner's base plus a sparse-exact (+ optional low-rank) correction.

For the shared block a non-owner reads (owner's base K/V, re-positioned; never modified):

1. one layer-0 pass over the block gives every token's exact layer-1 K/V in the reader's
   context (the base's layer 0 is exact: prefix-free) and the suffix's layer-1 queries;
2. sparse exact tokens: the first ``num_first`` tokens of every segment (the boundary where the
   deviation concentrates) + the top ``rho`` by ``score`` are recomputed through every layer,
   with the suffix, in one pass. "attn" (the choice) ranks tokens by the attention the suffix
   pays them in layers >= 2 of a probe pass over the uncorrected cache (``probe.py``, part of
   the TTFT); "impact" = layer-1 suffix attention x layer-1 value deviation (``selection.py``);
3. optional low-rank correction of the other tokens at each layer >= 2, predicted without any
   reference prefill from the exact tokens of the same pass (``estimator``):
     "sparse"   - none (rank 0): the winner of the lab's measurements (docs/results.md);
     "transfer" - rank-(q+1) transfer operator from layer-1 deviation features, fitted per block
                  by ridge on the interior exact tokens, shrunk by a two-fold held-out scale;
     "online"   - the same with the reader's sufficient statistics accumulated over the run
                  (``TransferState``: explicit, byte-counted, updated after every read);
     "interp"   - deviations of exact tokens spread to neighbours (kernel in position, same
                  segment), shrunk by leave-one-out: u = kernel weights [T, n], c_l = exact devs.

Persisted per (segment, reader): layer-1 K/V and the exact tokens as overrides, plus the factors
(u [T, r] shared by every layer and head, c_l [H_kv, r, d] per layer) when an estimator fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvcmas_lab.correction.base import BuildResult, CacheBuilder, ReadRequest, register
from sglang_kvcmas_lab.correction.cacheblend import leaves_from_view, split_block
from sglang_kvcmas_lab.correction.kvcmas_state import TransferState, layer1_features
from sglang_kvcmas_lab.correction.probe import suffix_attention_profile
from sglang_kvcmas_lab.correction.selection import PROBED, SCORES, select_tokens
from sglang_kvcmas_lab.correction.selective import BlockContext, block_of, selective_prefill
from sglang_kvcmas_lab.delta.leaf import LowRankFactors
from sglang_kvcmas_lab.models.reference_llama import RefLlama

__all__ = ["Kvcmas"]

ESTIMATORS = ("sparse", "transfer", "online", "interp")


@register("kvcmas")
@dataclass
class Kvcmas(CacheBuilder):
    """Defaults = the lab's choice (benchmark/lab/kvcmas_lab.py ``CHOICE``)."""

    rho: float = 0.25
    num_first: int = 4
    estimator: str = "sparse"
    feature_dim: int = 16
    lam: float = 0.1
    score: str = "attn"
    num_last: int = 0
    shrink: bool = True
    tau: float = 8.0
    fit_interior: bool = True
    states: dict[str, TransferState] = field(default_factory=dict)

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}")

    def state_nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states.values())

    def describe(self) -> dict:
        return {**super().describe(), "rho": self.rho, "num_first": self.num_first,
                "estimator": self.estimator, "feature_dim": self.feature_dim, "lam": self.lam,
                "score": self.score, "num_last": self.num_last, "shrink": self.shrink,
                "fit_interior": self.fit_interior}

    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        ids, base, starts = block_of(req.reads)
        state = self.states.setdefault(req.agent, TransferState())
        use_fit = self.estimator != "sparse"
        history = self.estimator == "online"
        fits: dict[int, torch.Tensor] = {}

        def correct(ctx: BlockContext, layer: int, k_sel: torch.Tensor, v_sel: torch.Tensor):
            k_b, v_b = ctx.base.k[layer], ctx.base.v[layer]
            if not use_fit or ctx.sel.numel() < 2:
                return k_b, v_b
            sc = ctx.scratch
            if "z" not in sc:
                feat = layer1_features(ctx.dev1_k, ctx.dev1_v)
                state.ensure_projection(feat, self.feature_dim)
                sc["z"] = state.features(feat)
                sc["z_sel"] = sc["z"][ctx.sel]
                # Fit on the selected tokens outside the segment boundaries: boundary tokens
                # deviate an order of magnitude more and are overridden exactly anyway.
                first = torch.zeros(ctx.dev1_v.shape[0], dtype=torch.bool)
                for st in ctx.seg_starts:
                    first[int(st):int(st) + self.num_first] = True
                fit = ~first[ctx.sel] if self.fit_interior else torch.ones_like(ctx.sel, dtype=torch.bool)
                sc["fit"] = fit if int(fit.sum()) >= 4 else torch.ones_like(fit)
                src = ctx.sel[sc["fit"]]
                seg = torch.bucketize(src, ctx.seg_starts, right=True)
                sc["fit_pos"], sc["fit_same"] = src, seg[:, None] == seg[None, :]
            y = torch.cat([(k_sel - k_b[ctx.sel]).flatten(1), (v_sel - v_b[ctx.sel]).flatten(1)], 1)
            if self.estimator == "interp":
                z = self._interp_weights(ctx, sc)  # [T, n_fit]: rows sum to <= 1
                w = y[sc["fit"]]
                if self.shrink:
                    w = w * self._interp_scale(sc, y)
                fits[layer] = w
                sc.setdefault("y", {})[layer] = y
                sc["z"] = z
                pred = z @ w
                half = pred.shape[1] // 2
                return k_b + pred[:, :half].view_as(k_b), v_b + pred[:, half:].view_as(v_b)
            w = state.solve(layer, sc["z_sel"][sc["fit"]], y[sc["fit"]], self.lam, history)
            if self.shrink:
                w = w * self._held_out_scale(state, layer, sc, y, history)
            fits[layer] = w
            sc.setdefault("y", {})[layer] = y
            pred = sc["z"] @ w  # [T, 2 * H * d]
            half = pred.shape[1] // 2
            return k_b + pred[:, :half].view_as(k_b), v_b + pred[:, half:].view_as(v_b)

        probe = None
        if self.score in PROBED:
            probe = {"attn_profile": suffix_attention_profile(
                model, req.prefix, base, req.suffix_ids, req.suffix_positions())}
        out = selective_prefill(model, req.prefix, ids, base, starts, req.suffix_ids,
                                req.suffix_positions(),
                                lambda c: select_tokens(c, self.rho, self.num_first, self.score,
                                                       num_last=self.num_last,
                                                       theta=model.spec.rope_theta),
                                correct if use_fit else None, scratch=probe)
        factors = None
        if fits:
            factors = self._factors(out.ctx, fits, req, model.spec.num_layers)
            if history:
                sc = out.ctx.scratch
                state.absorb_gram(sc["z_sel"])
                for layer, y in sc["y"].items():
                    state.absorb(layer, sc["z_sel"], y)
        leaves = leaves_from_view(req.agent, req.reads, out.block_view, out.sel, factors)
        return BuildResult(out.cache, out.last_logits, split_block(out.block_view, req.reads),
                           leaves, int(out.sel.numel()),
                           {"selected": int(out.sel.numel()), "estimator": self.estimator})

    def _interp_weights(self, ctx: BlockContext, sc) -> torch.Tensor:
        """[T, n_fit] kernel weights exp(-|t - s| / tau) over interior exact tokens s of the same
        segment, normalized per row with a unit prior mass (far tokens fall back to the base)."""
        if "kern" not in sc:
            T = ctx.dev1_v.shape[0]
            src = ctx.sel[sc["fit"]]
            seg = torch.bucketize(torch.arange(T), ctx.seg_starts, right=True)
            same = seg[:, None] == seg[src][None, :]
            k = torch.exp(-(torch.arange(T)[:, None] - src[None, :]).abs() / self.tau) * same
            sc["kern"] = (k / (k.sum(1, keepdim=True) + 1.0)).to(ctx.dev1_v.dtype)
        return sc["kern"]

    def _interp_scale(self, sc, y) -> float:
        """Held-out shrink for interpolation: predict each exact token from the others."""
        src_y = y[sc["fit"]]
        n = src_y.shape[0]
        if n < 4:
            return 0.0
        # leave-one-out over the exact tokens themselves, with the same kernel
        pos = sc["fit_pos"]
        k = torch.exp(-(pos[:, None] - pos[None, :]).abs() / self.tau) * sc["fit_same"]
        k.fill_diagonal_(0.0)
        k = k / (k.sum(1, keepdim=True) + 1.0)
        pred = k.to(src_y.dtype) @ src_y
        den = float((pred * pred).sum())
        return min(1.0, max(0.0, float((pred * src_y).sum()) / den)) if den > 0 else 0.0

    def _held_out_scale(self, state, layer, sc, y, history) -> float:
        """Shrink factor in [0, 1] for the prediction, chosen on held-out exact tokens (two
        folds): the fitted operator is trusted only as far as it predicts tokens it was not
        fitted on, so it cannot make a block worse than no correction on its own evidence."""
        idx = torch.nonzero(sc["fit"]).flatten()
        if idx.numel() < 8:
            return 0.0
        num = den = 0.0
        for fold in (0, 1):
            tr, te = idx[idx % 2 == fold], idx[idx % 2 != fold]
            w = state.solve(layer, sc["z_sel"][tr], y[tr], self.lam, history)
            pred = sc["z_sel"][te] @ w
            num += float((pred * y[te]).sum())
            den += float((pred * pred).sum())
        return min(1.0, max(0.0, num / den)) if den > 0 else 0.0

    @staticmethod
    def _factors(ctx: BlockContext, fits, req: ReadRequest, n_layers: int):
        """Per-read (k_factors, v_factors): u = z rows of the read, c_l = W_l split per head."""
        z = ctx.scratch["z"]
        H, d = ctx.base.k[0].shape[1], ctx.base.k[0].shape[2]
        out, start = [], 0
        for r in req.reads:
            T = r.ids.numel()
            u = z[start:start + T][None].contiguous()  # [1, T, q+1], shared by layers and heads
            fk, fv = [None, None], [None, None]
            for layer in range(2, n_layers):
                w = fits.get(layer)
                if w is None:
                    fk.append(None)
                    fv.append(None)
                    continue
                half = w.shape[1] // 2
                fk.append(LowRankFactors(u, w[:, :half].reshape(-1, H, d).transpose(0, 1)))
                fv.append(LowRankFactors(u, w[:, half:].reshape(-1, H, d).transpose(0, 1)))
            out.append((fk, fv))
            start += T
        return out
