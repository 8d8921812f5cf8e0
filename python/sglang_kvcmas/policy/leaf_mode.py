"""What a reader keeps of the borrowed tokens it recomputes: its leaf mode.

A reader recomputes some borrowed tokens in its own context (``policy/recompute.py``). Those
exact tokens can be kept two ways, alone or together:

- ``exact`` (the default): as exact leaves (``tree/pool_overrides.py``: full-size KV in the pool,
  read exactly on the agent's later turns);
- ``lowrank``: as the pairs a low-rank correction of every other borrowed token is fitted on
  (``attention/lowrank.py``: factors per layer and KV head, a few hundred KB per agent), read
  corrected in this request's extend and decode and on the agent's later turns; the recomputed
  slots are freed with the request; a later turn refits starting from the stored correction
  (chained along the workflow, ``chain``);
- ``lowrank+exact``: both.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kvcmas.config import ServingConfig

LEAF_MODES = ("exact", "lowrank", "lowrank+exact")


@dataclass(frozen=True)
class LeafConfig:
    """A reader's leaf mode and the rank of its low-rank factors.

    Attributes:
        mode: one of :data:`LEAF_MODES`.
        rank: rank of the factors fitted (``lowrank`` modes only).
        chain: weight of the agent's stored correction when it refits (0: from scratch;
            ``attention.lowrank.chain_weight``).
    """

    mode: str = "exact"
    rank: int = 8
    chain: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in LEAF_MODES or self.rank < 1 or not 0 <= self.chain <= 1:
            raise ValueError(f"bad leaf config {self}")

    @classmethod
    def from_serving(cls, config: ServingConfig, **overrides: Any) -> LeafConfig:
        """The deployment's leaf knobs, with a request's overrides (knob names)."""
        values = {"leaf_mode": config.leaf_mode, "lowrank_rank": config.lowrank_rank,
                  "lowrank_chain": config.lowrank_chain, **overrides}
        return cls(values["leaf_mode"], values["lowrank_rank"], values["lowrank_chain"])

    @property
    def keeps_exact(self) -> bool:
        """Whether recomputed tokens become exact leaves."""
        return self.mode != "lowrank"

    @property
    def lowrank_rank(self) -> int:
        """Rank of the correction to fit and read (0: none)."""
        return self.rank if self.mode != "exact" else 0
