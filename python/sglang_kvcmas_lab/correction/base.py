"""The interface every cache-sharing method implements, and its registry.

A method receives what a reader agent holds (its own exact prefix: head + earlier own turns),
the shared segments it must read that other agents own (each with the owner's base cache, never
modified), and its suffix; it returns the reader's whole cache, the first token's logits, its view
of each shared segment, and the delta leaves it persists. Everything inside ``build`` is the
method's time to first token: callers time the call as a whole.

Layout (reader positions)::

    | prefix (held, exact) | read 0 | read 1 | ... | suffix |
    0                      P                         P+sum(T_i)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from sglang_kvcmas_lab.delta.leaf import DeltaLeaf
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = [
    "BuildResult",
    "CacheBuilder",
    "ReadRequest",
    "SharedRead",
    "create_builder",
    "register",
    "registered",
]


@dataclass(frozen=True)
class SharedRead:
    """A segment owned by another agent, as this reader needs it.

    ids: [T] int64. base: the owner's cache of it (pre-RoPE K/V; positions = the owner's).
    positions: [T] int64, where this reader reads it.
    slot: the template slot it fills (e.g. "question", "r1a2"); KVCOMM keys anchors by it.
    """

    segment_id: int
    owner: str
    ids: torch.Tensor
    base: KVCache
    positions: torch.Tensor
    slot: str = ""

    def __post_init__(self):
        if not (len(self.base) == self.ids.numel() == self.positions.numel()):
            raise ValueError("ids, base and positions must cover the same tokens")

    def rebased(self) -> KVCache:
        """The base read at this reader's positions (a RoPE re-positioning; no copy)."""
        return self.base.with_positions(self.positions)


@dataclass(frozen=True)
class ReadRequest:
    """One reader turn.

    prefix: [P tokens] what the reader holds for itself (exact for it); prefix_ids: [P].
    reads: the shared segments after the prefix, owned by others, in order.
    suffix_ids: [S] new tokens (e.g. the assistant opener); the first token follows them.
    reference: the reader's exact cache of each read (dense recompute). ONLY the oracle may look.
    """

    agent: str
    prefix: KVCache
    prefix_ids: torch.Tensor
    reads: tuple[SharedRead, ...]
    suffix_ids: torch.Tensor
    reference: tuple[KVCache, ...] | None = None

    @property
    def num_read_tokens(self) -> int:
        return sum(r.ids.numel() for r in self.reads)

    def suffix_positions(self) -> torch.Tensor:
        start = len(self.prefix) + self.num_read_tokens
        return torch.arange(start, start + self.suffix_ids.numel())

    def all_ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, *(r.ids for r in self.reads), self.suffix_ids])


class BuildResult(NamedTuple):
    """cache: the reader's whole cache (prefix + views + suffix) at reader positions.
    last_logits: [vocab] logits of the last suffix token. views: the reader's cache of each read.
    leaves: what the method persists per read (``leaf.apply(read.base)`` == view's K/V), or ().
    recomputed_tokens: shared tokens recomputed beyond layer 1 (layer-1 passes are in info).
    info: method-specific numbers for the record."""

    cache: KVCache
    last_logits: torch.Tensor
    views: tuple[KVCache, ...]
    leaves: tuple[DeltaLeaf, ...]
    recomputed_tokens: int
    info: dict[str, Any]


@dataclass
class CacheBuilder(ABC):
    """A cache-sharing method. ``persistent``: whether it keeps shared bases between turns (no
    sharing keeps nothing). Stateful methods keep their online state on the instance."""

    name: str = ""
    persistent: bool = field(default=True, init=False)
    needs_reference: bool = field(default=False, init=False)

    @abstractmethod
    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        """Construct the reader's cache and first-token logits. Everything here is TTFT."""

    def state_nbytes(self) -> int:
        """Bytes of online correction state held between turns (beyond leaves)."""
        return 0

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "class": type(self).__name__}


_REGISTRY: dict[str, Callable[..., CacheBuilder]] = {}


def register(name: str) -> Callable:
    """Class decorator: ``create_builder(name, **kw)`` constructs it."""

    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_builder(name: str, **kwargs) -> CacheBuilder:
    if name not in _REGISTRY:
        raise KeyError(f"unknown method {name!r}; known: {sorted(_REGISTRY)}")
    builder = _REGISTRY[name](**kwargs)
    if not builder.name:
        builder.name = name
    return builder


def suffix_on(model: RefLlama, past: KVCache, req: ReadRequest) -> tuple[KVCache, torch.Tensor]:
    """Prefill the suffix on ``past`` (prefix + views). Returns (whole cache, last logits)."""
    out = model.forward(req.suffix_ids, positions=req.suffix_positions(), past=past)
    return KVCache.concat([past, out.kv]), out.logits[-1]


def split_views(cache: KVCache, req: ReadRequest) -> tuple[KVCache, ...]:
    """The per-read slices of a cache laid out as prefix | reads | suffix."""
    views, start = [], len(req.prefix)
    for r in req.reads:
        views.append(cache.slice(start, start + r.ids.numel()))
        start += r.ids.numel()
    return tuple(views)
