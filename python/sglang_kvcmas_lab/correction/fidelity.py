"""Fidelity metrics shared by every lab: a method's output against full recompute.

All metrics compare a method's next-token distributions (teacher-forced over the same
continuation) or its greedy output against the reference (no sharing: dense prefill of the same
agent, model and dtype). KL is KL(reference || method), computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TeacherForced",
    "first_divergence",
    "kv_relative_error",
    "teacher_forced",
]


@dataclass(frozen=True)
class TeacherForced:
    """Agreement of a method's next-token distributions with the reference's.

    top1: fraction of positions where the argmax agrees.
    mean_kl: mean over positions of KL(reference || method), in nats.
    max_kl: worst position.
    num_positions: positions compared.
    """

    top1: float
    mean_kl: float
    max_kl: float
    num_positions: int


def teacher_forced(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> TeacherForced:
    """ref_logits, test_logits: [num_positions, vocab] over the same teacher-forced tokens."""
    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"shape mismatch: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
    ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
    test_lp = torch.log_softmax(test_logits.double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1).clamp_min(0.0)
    top1 = (ref_logits.argmax(-1) == test_logits.argmax(-1)).double().mean()
    return TeacherForced(float(top1), float(kl.mean()), float(kl.max()), int(kl.numel()))


def first_divergence(ref_ids: list[int], test_ids: list[int]) -> int:
    """Index of the first differing token; ``min(len)`` when one is a prefix of the other."""
    for i, (a, b) in enumerate(zip(ref_ids, test_ids)):
        if a != b:
            return i
    return min(len(ref_ids), len(test_ids))


def kv_relative_error(
    ref: list[torch.Tensor], test: list[torch.Tensor]
) -> list[float]:
    """Per-layer relative Frobenius error ||test - ref|| / ||ref||.

    ref, test: num_layers x [num_tokens, num_kv_heads, head_dim] (same tokens, same layout).
    A layer whose reference is all zeros reports the absolute error instead.
    """
    out = []
    for r, t in zip(ref, test, strict=True):
        num = torch.linalg.vector_norm((t - r).double())
        den = torch.linalg.vector_norm(r.double())
        out.append(float(num / den) if den > 0 else float(num))
    return out
