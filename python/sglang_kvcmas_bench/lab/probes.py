"""Probes of a reader's deviation in the lab's reference model: the layers where the server
measures owner head mass, that mass itself, and the full-vocabulary KL between two reads."""

from __future__ import annotations

import torch

FORCED = 16
"""Teacher-forced tokens of the reader's exact greedy answer a KL is taken over."""


def probe_layers(num_layers: int) -> list[int]:
    """The layers where the server records head mass (2, 6, 10, ...)."""
    from sglang_kvcmas.attention.spans import is_probe_layer

    return [i for i in range(num_layers) if is_probe_layer(i)]


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean full-vocabulary KL(ref || got) over positions; logits [T, V]."""
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def head_mass(model, ids: list[int], head_end: int, length: int, head_from: int,
              layers: list[int] | None = None) -> torch.Tensor:
    """[length] attention mass of the owner's transcript tokens on its head rows ``[head_from,
    head_end)``, mean over ``layers`` (default: every layer; the serving probe's signal) and
    query heads."""
    from sglang_kvcmas_lab.models.reference_llama import rotate

    spec = model.spec
    layers = list(range(spec.num_layers)) if layers is None else layers
    out = model.forward(torch.tensor(ids), return_hidden=True)
    pos = torch.arange(len(ids))
    rows = pos[head_end:head_end + length]
    group = spec.num_heads // spec.num_kv_heads
    total = torch.zeros(length)
    for layer in layers:
        q, k, _ = model.qkv(layer, out.hidden[layer])
        qr = rotate(q, pos, spec.rope_theta)[head_end:head_end + length].transpose(0, 1)
        kr = rotate(k, pos, spec.rope_theta).transpose(0, 1).repeat_interleave(group, 0)
        p = (qr @ kr.transpose(1, 2) / spec.head_dim ** 0.5).masked_fill(
            pos[None, None, :] > rows[None, :, None], float("-inf")).softmax(-1)
        total += p[..., head_from:head_end].sum(-1).mean(0)
    return total / len(layers)
