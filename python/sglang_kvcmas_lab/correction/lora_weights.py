"""LoRA factors of several agents' adapters over one base model, stacked per layer.

``x @ W + s * (x @ A) @ B`` is a LoRA projection; peft stores ``lora_A.weight: [r, d_in]`` and
``lora_B.weight: [d_out, r]``, we keep ``a: [d_in, r]`` and ``b: [r, d_out]`` so every product
reads left to right. All agents must share rank and scale (one stacked matmul per layer).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["MEAN_AGENT", "AdapterSet", "LoraFactors", "TARGETS", "load_peft_adapter"]

# Pseudo-agent whose delta is the mean of every agent's: s/N * sum_i (x A_i) B_i. A pass run as
# it puts the shared base at the agents' centroid instead of at the bare base weights.
MEAN_AGENT = -1

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraFactors:
    """One target module of one agent. a: [d_in, r]; b: [r, d_out]; delta(x) = scale * x a b."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    def __post_init__(self):
        if self.a.shape[1] != self.b.shape[0]:
            raise ValueError(f"rank mismatch {tuple(self.a.shape)} vs {tuple(self.b.shape)}")

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass
class AdapterSet:
    """Adapters of ``names`` (one per agent) over a model with ``num_layers`` layers.

    factors[layer][target]: one LoraFactors per agent (every agent adapts the same targets).
    """

    names: tuple[str, ...]
    factors: list[dict[str, tuple[LoraFactors, ...]]]
    _stacked: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        ranks = {f.rank for layer in self.factors for fs in layer.values() for f in fs}
        scales = {f.scale for layer in self.factors for fs in layer.values() for f in fs}
        if len(ranks) > 1 or len(scales) > 1:
            raise ValueError(f"agents must share rank and scale, got {ranks}, {scales}")
        for layer in self.factors:
            if any(len(fs) != len(self.names) for fs in layer.values()):
                raise ValueError("every target needs one factor per agent")

    @property
    def num_agents(self) -> int:
        return len(self.names)

    @property
    def rank(self) -> int:
        return next(iter(self.factors[0].values()))[0].rank

    @property
    def scale(self) -> float:
        return next(iter(self.factors[0].values()))[0].scale

    def has(self, layer: int, target: str) -> bool:
        return target in self.factors[layer]

    def get(self, layer: int, target: str, agent: int) -> LoraFactors | None:
        if agent < 0:
            raise ValueError("the mean agent has no factors of its own; use delta / mean_b")
        fs = self.factors[layer].get(target)
        return None if fs is None else fs[agent]

    def delta(self, layer: int, target: str, x: torch.Tensor,
              agent: int | None) -> torch.Tensor | None:
        """scale * x a b for ``agent`` (None when the agent is None or the target is not adapted).
        x: [T, d_in] -> [T, d_out]."""
        if agent == MEAN_AGENT:
            if not self.has(layer, target):
                return None
            return (x @ self.stacked_a(layer, target)) @ self.mean_b(layer, target)
        f = None if agent is None else self.get(layer, target, agent)
        return None if f is None else f.scale * ((x @ f.a) @ f.b)

    def mean_b(self, layer: int, target: str) -> torch.Tensor:
        """[num_agents * r, d_out]: every agent's B stacked, times scale / num_agents, so that
        ``(x @ stacked_a) @ mean_b`` is the mean of the agents' deltas."""
        key = (layer, target + "#mean_b")
        if key not in self._stacked:
            fs = self.factors[layer][target]
            self._stacked[key] = torch.cat([f.b for f in fs]) * (fs[0].scale / len(fs))
        return self._stacked[key]

    def stacked_a(self, layer: int, target: str) -> torch.Tensor:
        """[d_in, num_agents * r]: every agent's A side by side (agent i owns columns i*r..)."""
        key = (layer, target)
        if key not in self._stacked:
            self._stacked[key] = torch.cat([f.a for f in self.factors[layer][target]], dim=1)
        return self._stacked[key]

    def to(self, dtype: torch.dtype) -> AdapterSet:
        return AdapterSet(self.names, [
            {t: tuple(LoraFactors(f.a.to(dtype), f.b.to(dtype), f.scale) for f in fs)
             for t, fs in layer.items()} for layer in self.factors])

    @classmethod
    def from_agents(cls, names: tuple[str, ...],
                    per_agent: list[list[dict[str, LoraFactors]]]) -> AdapterSet:
        """per_agent[i][layer][target] -> one set."""
        num_layers = len(per_agent[0])
        factors = [{t: tuple(agent[layer][t] for agent in per_agent) for t in per_agent[0][layer]}
                   for layer in range(num_layers)]
        return cls(tuple(names), factors)

    @classmethod
    def from_peft_dirs(cls, named_dirs: dict[str, str | Path], num_layers: int,
                       dtype: torch.dtype = torch.float32) -> AdapterSet:
        names = tuple(named_dirs)
        return cls.from_agents(names, [load_peft_adapter(d, num_layers, dtype)
                                       for d in named_dirs.values()])


def load_peft_adapter(folder: str | Path, num_layers: int,
                      dtype: torch.dtype = torch.float32) -> list[dict[str, LoraFactors]]:
    """A peft LoRA folder -> [layer][target] factors (scale = lora_alpha / r)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise NotImplementedError("rsLoRA / DoRA adapters are not supported")
    scale = float(cfg["lora_alpha"]) / float(cfg["r"])
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(folder / "adapter_model.safetensors")).items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"unexpected adapter tensor {key}")
        raw.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.to(dtype)
    out: list[dict[str, LoraFactors]] = [{} for _ in range(num_layers)]
    for (layer, target), ab in raw.items():
        out[layer][target] = LoraFactors(ab["A"].T.contiguous(), ab["B"].T.contiguous(), scale)
    return out
