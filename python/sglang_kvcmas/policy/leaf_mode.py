"""What a reader keeps of the borrowed tokens it recomputes: its leaf mode.

A reader recomputes some borrowed tokens in its own context (``policy/recompute.py``). Those
exact tokens can be kept these ways:

- ``exact``: as exact leaves (``tree/pool_overrides.py``: full-size KV in the pool, read exactly
  on the agent's later turns);
- ``lowrank``: as the pairs a low-rank correction of every other borrowed token is fitted on
  (``attention/lowrank.py``: factors per layer and KV head, a few hundred KB per agent), read
  corrected in this request's extend and decode and on the agent's later turns; the recomputed
  slots are freed with the request (every turn recomputes and refits on all of them);
- ``lowrank+exact``: both; a later turn recomputes only the new picks, and its refit starts
  from the stored correction (chained along the workflow, ``chain``);
- ``factored`` (the default, at rank 4): as the agent's factored leaves
  (``attention/leaf_factors.py``, ``tree/factor_leaves.py``): the same tokens as ``exact``
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

LEAF_MODES = ("exact", "lowrank", "lowrank+exact", "factored")


@dataclass(frozen=True)
class LeafConfig:
    """A reader's leaf mode and the rank of its low-rank factors.

    Attributes:
        mode: one of :data:`LEAF_MODES`.
        rank: rank of the factors fitted (``lowrank`` modes) or kept (``factored``).
        chain: weight of the agent's stored correction when it refits (0: from scratch;
            ``attention.lowrank.chain_weight``); applied under ``lowrank+exact`` only
            (:attr:`lowrank_chain`).
    """

    mode: str = "factored"
    rank: int = 4
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
        return self.mode in ("exact", "lowrank+exact")

    @property
    def keeps_leaves(self) -> bool:
        """Whether recomputed tokens become leaves of either kind (exact or factored)."""
        return self.mode != "lowrank"

    @property
    def lowrank_rank(self) -> int:
        """Rank of the affine correction to fit and read (0: none)."""
        return self.rank if self.mode in ("lowrank", "lowrank+exact") else 0

    @property
    def factor_rank(self) -> int:
        """Rank of the factored leaves to keep (0: none)."""
        return self.rank if self.mode == "factored" else 0

    @property
    def lowrank_chain(self) -> float:
        """The chain weight a refit uses: ``chain`` under ``lowrank+exact``, where a turn
        recomputes only the picks its exact leaves do not hold (the new segment's), so the
        stored correction carries the earlier turns' evidence; 0 under ``lowrank``, where every
        turn recomputes and refits on every pick again and the stored correction would count
        the same pairs twice (measured: ``benchmark/serving/results/frontier_chain.txt``)."""
        return self.chain if self.mode == "lowrank+exact" else 0.0
