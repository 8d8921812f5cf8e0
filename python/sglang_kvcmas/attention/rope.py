"""Rotary position embedding as used by the delta read path: SGLang's layouts (neox and GPT-J
style, full or partial rotary) and the shift that re-positions a stored key.

A head vector ``x: [head_dim]`` has its first ``rotary_dim`` dims rotated, the rest passed
through. Neox style pairs dim ``i`` with ``i + rotary_dim/2``; GPT-J style pairs ``2i`` with
``2i + 1``. With ``x_lo``, ``x_hi`` the two members of each pair, the rotation by position ``p``
with frequencies ``inv_freq: [rotary_dim/2]`` is

    R(p)·x = [x_lo·cos(p·θ) − x_hi·sin(p·θ),  x_hi·cos(p·θ) + x_lo·sin(p·θ)]   (pairs in place).

# NOTE: rotations compose, R(a)·R(b) = R(a + b), and R(0) is the identity. The read path relies on
# this to re-position keys that the pool stores already rotated at the owner's positions.

Angles are computed in float32 as ``p · inv_freq``, as SGLang builds its ``cos_sin_cache``, but
directly from the position so that negative shifts work. A scaled RoPE only changes
``inv_freq``; YaRN's attention factor is already in every stored key, so a shift rotates by the
unscaled angle. Which of SGLang's rotary embeddings a :class:`ShiftRope` can describe is
``integration/rope_shift.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ShiftRope:
    """The model's rotary embedding, as much of it as a position shift needs.

    Attributes:
        inv_freq: [rotary_dim // 2] float32 frequencies (scaling already folded in).
        head_dim: the head size; dims ``rotary_dim ..`` pass through unrotated.
        neox: neox style (halves) if True, GPT-J style (interleaved pairs) if False.
        attention_factor: the magnitude SGLang multiplies cos and sin by (YaRN's mscale; 1.0
            otherwise). Already in every stored key and query: a shift never applies it.
        variant: what it was built from (``"default"``, ``"llama3"``, ...), for messages.
    """

    inv_freq: torch.Tensor
    head_dim: int
    neox: bool = True
    attention_factor: float = 1.0
    variant: str = "default"

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.dtype != torch.float32:
            raise ValueError(f"inv_freq must be 1-D float32, got {tuple(self.inv_freq.shape)} "
                             f"{self.inv_freq.dtype}")
        if not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be in (0, head_dim "
                             f"{self.head_dim}]")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def full(cls, inv_freq: torch.Tensor) -> ShiftRope:
        """Full-width neox RoPE with these frequencies (``head_dim = 2 · len(inv_freq)``)."""
        inv = inv_freq.to(torch.float32)
        return cls(inv, 2 * inv.numel())

    def same_as(self, other: ShiftRope) -> bool:
        """Equal layout and frequencies (the check that every layer shares one rotary)."""
        return (self.head_dim, self.neox, self.attention_factor) == (
            other.head_dim, other.neox, other.attention_factor
        ) and torch.equal(self.inv_freq.cpu(), other.inv_freq.cpu())


def as_shift_rope(rope: ShiftRope | torch.Tensor) -> ShiftRope:
    """A :class:`ShiftRope` as is; a bare ``inv_freq: [d // 2]`` as full-width neox RoPE."""
    return rope if isinstance(rope, ShiftRope) else ShiftRope.full(rope)


def rope_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Default RoPE frequencies ``[head_dim // 2]`` float32, as SGLang's
    ``RotaryEmbedding._compute_inv_freq``."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    return 1.0 / (base**exponent)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor | ShiftRope
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [n, rotary_dim // 2] float32, of ``positions · inv_freq`` (unscaled: no
    attention factor). positions: [n] integer, may be negative; inv_freq: [rotary_dim // 2]."""
    if isinstance(inv_freq, ShiftRope):
        inv_freq = inv_freq.inv_freq
    inv = inv_freq.to(positions.device, torch.float32)
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor | ShiftRope
) -> torch.Tensor:
    """Rotate every head of every token by its position: ``R(positions[t])·x[t, h]``.

    Args:
        x: [n, num_heads, head_dim] any float dtype (computed in float32)
        positions: [n] or [1] integer (one position broadcasts over all tokens), may be negative
        rope: a :class:`ShiftRope`, or ``inv_freq: [head_dim // 2]`` float32 (full neox)
    Returns:
        [n, num_heads, head_dim] float32
    """
    rope = as_shift_rope(rope)
    cos, sin = rope_cos_sin(positions.to(x.device), rope.inv_freq)
    return rotate(x.to(torch.float32), cos[:, None, :], sin[:, None, :], rope)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: ShiftRope) -> torch.Tensor:
    """The rotation in the model's layout: the first ``rotary_dim`` dims rotated (neox halves or
    GPT-J pairs), the rest unchanged.

    Args:
        x: [..., head_dim] any float dtype
        cos, sin: broadcastable to [..., rotary_dim // 2], the dtype the result is computed in
    Returns:
        [..., head_dim] in the promoted dtype of ``x`` and ``cos``
    """
    if x.shape[-1] != rope.head_dim:
        raise ValueError(f"head_dim {x.shape[-1]} does not match the rope's {rope.head_dim}")
    r = rope.rotary_dim
    x_rot = x if r == x.shape[-1] else x[..., :r]
    if rope.neox:
        out = rotate_halves(x_rot, cos, sin)
    else:
        lo, hi = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1).flatten(-2)
    if r == x.shape[-1]:
        return out
    rest = x[..., r:].to(out.dtype)
    return torch.cat([out, rest.expand(*out.shape[:-1], rest.shape[-1])], dim=-1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The neox rotation itself, ``[x_lo·cos − x_hi·sin, x_hi·cos + x_lo·sin]`` over the whole
    last dim (:func:`rotate` calls it for the neox layout; the lab's full-width paths directly).

    Args:
        x: [..., 2 · half] any float dtype
        cos, sin: broadcastable to [..., half], the dtype the result is computed in
    Returns:
        [..., 2 · half] in the promoted dtype of ``x`` and ``cos``
    """
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)
