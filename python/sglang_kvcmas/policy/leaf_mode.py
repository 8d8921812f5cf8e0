"""What a reader keeps of the borrowed tokens it recomputes: its leaf mode.

A reader recomputes some borrowed tokens in its own context (``policy/recompute.py``). Those
exact tokens can be kept these ways:

- ``exact``: as exact leaves (``tree/pool_overrides.py``: full-size KV in the pool, read exactly
  on the agent's later turns);
- ``factored`` (the default, at rank 4): as the agent's factored leaves
  (``attention/deviation_factors.py``, ``tree/factored_leaves.py``): the same tokens as ``exact``
  keeps, but only their deviation from the owner's KV, cut to rank ``rank`` per layer and KV
  head (host memory: up to ``d / rank`` times smaller than their exact leaves, less a basis per
  fit); the request's decode and the agent's later turns read them as the owner's KV
  re-positioned plus that deviation; the recomputed slots are freed right after the prefill
  (with the request where a launched batch may still read them). The default because it is
  the one mode that met every target of a 16-agent panel in the frontier benchmark
  (``benchmark/serving/frontier.py``; figures in ``docs/results.md``).

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kvcmas.config import ServingConfig

LEAF_MODES = ("exact", "factored")


@dataclass(frozen=True)
class LeafConfig:
    """A reader's leaf mode and the rank of its factored leaves.

    Attributes:
        mode: one of :data:`LEAF_MODES`.
        rank: rank of the factored leaves kept (``factored``).
    """

    mode: str = "factored"
    rank: int = 4

    def __post_init__(self) -> None:
        if self.mode not in LEAF_MODES or self.rank < 1:
            raise ValueError(f"bad leaf config {self}")

    @classmethod
    def from_serving(cls, config: ServingConfig, **overrides: Any) -> LeafConfig:
        """The deployment's leaf knobs, with a request's overrides (knob names)."""
        values = {"leaf_mode": config.leaf_mode, "leaf_rank": config.leaf_rank, **overrides}
        return cls(values["leaf_mode"], values["leaf_rank"])

    @property
    def factor_rank(self) -> int:
        """Rank of the factored leaves to keep (0: none)."""
        return self.rank if self.mode == "factored" else 0
