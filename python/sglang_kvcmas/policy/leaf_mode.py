"""What a reader keeps of the borrowed tokens it recomputes (``policy/recompute.py``): its leaf
mode.

- ``exact``: as exact leaves (``tree/pool_overrides.py``: full-size KV in the pool, read exactly
  on the agent's later turns);
- ``factored`` (the default): the same tokens, but only their deviation from the owner's KV, cut
  to rank ``rank`` per layer and KV head, in host memory (``attention/deviation_factors.py``,
  ``tree/factored_leaves.py``); the request's decode and the agent's later turns read the owner's
  KV re-positioned plus that deviation, and the recomputed slots are freed right after the
  prefill (with the request where a launched batch may still read them). The default because it
  is the one mode that met every target of the frontier benchmark
  (``benchmark/serving/frontier.py``, ``docs/results.md``).

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
