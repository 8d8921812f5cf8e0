"""KVCMAS online correction state: a transfer operator per reader agent, learned as the run goes.

Features of a shared token are its exact layer-1 deviation (K and V, every KV head), which the
reader gets for every token from one cheap layer-0 pass. They are projected onto a fixed basis
``proj`` (chosen from the first block the agent reads) so sufficient statistics add up across
turns. Per layer >= 2 the operator maps features to that layer's deviation:

    dev_l[t] ~= z[t] @ W_l,   z[t] = [feat[t] @ proj, 1],   W_l = (A + lam I)^-1 B_l

with A = sum z z^T and B_l = sum z dev_l^T over every exactly recomputed token seen so far (no
reference prefill: only tokens the reader had to recompute anyway). Everything is explicit so the
serving side can inspect it, count its bytes and update it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvcmas_lab.delta.leaf import tensors_nbytes

__all__ = ["TransferState", "layer1_features", "fit_projection"]


def layer1_features(dev1_k: torch.Tensor, dev1_v: torch.Tensor) -> torch.Tensor:
    """dev1_k, dev1_v: [T, H_kv, d] -> [T, 2 * H_kv * d] (same dtype)."""
    return torch.cat([dev1_k.flatten(1), dev1_v.flatten(1)], dim=1)


def fit_projection(feat: torch.Tensor, dim: int) -> torch.Tensor:
    """Top-``dim`` right singular vectors of ``feat: [T, F]`` -> [F, dim] (computed in fp32+)."""
    x = feat if feat.dtype == torch.float64 else feat.float()
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    return vh[:dim].T.to(feat.dtype).contiguous()


@dataclass
class TransferState:
    """One reader's online transfer operator.

    proj: [F, q] feature projection (None until the first block). a: [q+1, q+1] Gram of
    observed features; b: per layer [q+1, 2 * H_kv * d] cross moments (None for layers < 2).
    num_tokens: exact tokens absorbed so far.
    """

    proj: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: dict[int, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0

    def features(self, feat: torch.Tensor) -> torch.Tensor:
        """feat: [T, F] -> z: [T, q+1] (projection + bias column)."""
        z = feat @ self.proj
        return torch.cat([z, torch.ones_like(z[:, :1])], dim=1)

    def ensure_projection(self, feat: torch.Tensor, dim: int) -> None:
        if self.proj is None:
            self.proj = fit_projection(feat, dim)

    def solve(self, layer: int, z_sel: torch.Tensor, y_sel: torch.Tensor, lam: float,
              use_history: bool) -> torch.Tensor:
        """Ridge map for ``layer`` from this block's exact tokens (+ history): [q+1, Y]."""
        a = z_sel.T @ z_sel
        b = z_sel.T @ y_sel
        if use_history and self.a is not None and layer in self.b:
            a = a + self.a
            b = b + self.b[layer]
        reg = lam * (a.diagonal().mean().clamp_min(1e-12))
        eye = torch.eye(a.shape[0], dtype=a.dtype)
        return torch.linalg.solve(a + reg * eye, b)

    def absorb(self, layer: int, z_sel: torch.Tensor, y_sel: torch.Tensor) -> None:
        """Add this block's exact tokens at ``layer`` to the sufficient statistics."""
        b = z_sel.T @ y_sel
        self.b[layer] = b if layer not in self.b else self.b[layer] + b

    def absorb_gram(self, z_sel: torch.Tensor) -> None:
        g = z_sel.T @ z_sel
        self.a = g if self.a is None else self.a + g
        self.num_tokens += int(z_sel.shape[0])

    def nbytes(self) -> int:
        return tensors_nbytes([self.proj, self.a, *self.b.values()])
