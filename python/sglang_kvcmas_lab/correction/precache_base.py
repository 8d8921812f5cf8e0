"""The interface of the LoRA-agent sharing methods (PReCache lab), and their registry.

A workflow appends shared segments to one transcript: input text (``writer=None``: system /
user messages) or an agent's message (``writer=i``: tokens agent i generated with its adapter).
A method keeps whatever it shares across agents; at any point a reader agent asks for its view of
the transcript (for fidelity) and for the work on its critical path to the first token (for
time to first token). The lab appends every segment to every method in the same order.

Timing rule (the same for every method): work a reader must wait for is in ``first_token``:
catch-up prefills, rebuilds of the newest segment, corrections, and the reader's own suffix.
Work done while the segment's writer decodes its message (its own pass) is not, because no
sharing pays it too. Input text must be encoded before anyone reads it: that pass is charged to
every reader at the point where the input is the newest segment (conservative: in a workflow only
the first reader waits for it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_kvcmas_lab.correction.lora_forward import LoraForward
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = [
    "LoraSharingMethod",
    "Segment",
    "create_lora_method",
    "register_lora_method",
    "registered_lora_methods",
]


@dataclass(frozen=True)
class Segment:
    """ids: [T] int64 tokens appended to the transcript; writer: agent index or None (input)."""

    ids: torch.Tensor
    writer: int | None


@dataclass
class LoraSharingMethod(ABC):
    """A way for LoRA agents to hold the shared transcript. Subclasses keep state on self."""

    name: str = ""
    lora: LoraForward | None = field(default=None, repr=False)
    segments: list[Segment] = field(default_factory=list, repr=False)
    exact: bool = field(default=False, init=False)  # never deviates from no sharing

    def reset(self, lora: LoraForward) -> None:
        self.lora = lora
        self.segments = []
        self._reset()

    @property
    def num_tokens(self) -> int:
        return sum(s.ids.numel() for s in self.segments)

    def positions(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end)

    def all_ids(self) -> torch.Tensor:
        return torch.cat([s.ids for s in self.segments])

    def append(self, seg: Segment) -> None:
        """Add a segment to the transcript (the writer's own pass happens here)."""
        start = self.num_tokens
        self.segments.append(seg)
        self._append(seg, start)

    def first_token(self, reader: int, suffix_ids: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A repeatable closure doing all of ``reader``'s critical-path work at this point;
        returns the first token's logits [vocab]. Timing it is the method's TTFT."""
        return self._first_token(reader, suffix_ids)

    # ---- to implement ---------------------------------------------------------------------
    @abstractmethod
    def _reset(self) -> None: ...

    @abstractmethod
    def _append(self, seg: Segment, start: int) -> None:
        """Update shared state for ``seg`` whose tokens start at transcript position ``start``."""

    @abstractmethod
    def view(self, reader: int) -> KVCache:
        """Reader's materialized pre-RoPE cache of the whole transcript (fidelity path)."""

    @abstractmethod
    def _first_token(self, reader: int, suffix_ids: torch.Tensor) -> Callable[[], torch.Tensor]:
        ...

    @abstractmethod
    def bytes_held(self, num_agents: int) -> int:
        """Persistent cache bytes for the transcript with ``num_agents`` agents reading it."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "class": type(self).__name__}


_REGISTRY: dict[str, Callable[..., LoraSharingMethod]] = {}


def register_lora_method(name: str) -> Callable:
    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_lora_methods() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_lora_method(method: str, **kwargs) -> LoraSharingMethod:
    if method not in _REGISTRY:
        raise KeyError(f"unknown method {method!r}; known: {sorted(_REGISTRY)}")
    m = _REGISTRY[method](**kwargs)
    if not m.name:
        m.name = method
    return m
