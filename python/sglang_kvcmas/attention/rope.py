"""Rotary position embedding (neox style, SGLang's layout) as used by the delta read path.

A head vector ``x: [head_dim]`` is split into halves ``x_lo = x[:d/2]``, ``x_hi = x[d/2:]``; the
rotation by position ``p`` with frequencies ``inv_freq: [d/2]`` is

    R(p)·x = [x_lo·cos(p·θ) − x_hi·sin(p·θ),  x_hi·cos(p·θ) + x_lo·sin(p·θ)].

# NOTE: rotations compose, R(a)·R(b) = R(a + b), and R(0) is the identity. The read path relies on
# this to re-position keys that the pool stores already rotated at the owner's positions.

Angles are computed in float32 as ``p · inv_freq`` exactly as SGLang builds its ``cos_sin_cache``
(float32 positions times float32 frequencies), but directly from the position so that negative
shifts work. Only full-width rotary (``rotary_dim == head_dim``), neox style, is supported;
frequency rescalings that only change ``inv_freq`` (Llama-3 style) work by passing that
``inv_freq``.
"""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Default RoPE frequencies, as SGLang's ``RotaryEmbedding._compute_inv_freq``.

    Returns:
        inv_freq: [head_dim // 2] float32
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    return 1.0 / (base**exponent)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions · inv_freq``.

    Args:
        positions: [n] integer (may be negative)
        inv_freq: [head_dim // 2] float32
    Returns:
        (cos, sin): each [n, head_dim // 2] float32
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate every head of every token by its position: ``R(positions[t])·x[t, h]``.

    Args:
        x: [n, num_heads, head_dim] any float dtype (computed in float32)
        positions: [n] or [1] integer (one position broadcasts over all tokens), may be negative
            (R(−p) is the inverse of R(p))
        inv_freq: [head_dim // 2] float32
    Returns:
        [n, num_heads, head_dim] float32
    """
    cos, sin = rope_cos_sin(positions.to(x.device), inv_freq.to(x.device))
    return rotate_halves(x.to(torch.float32), cos[:, None, :], sin[:, None, :])


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation itself, ``[x_lo·cos − x_hi·sin, x_hi·cos + x_lo·sin]``: the one place the
    formula is written (every RoPE read in the server and the lab calls it).

    Args:
        x: [..., head_dim] any float dtype
        cos, sin: broadcastable to [..., head_dim // 2], the dtype the result is computed in
    Returns:
        [..., head_dim] in the promoted dtype of ``x`` and ``cos``
    """
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)
