"""Baselines for LoRA agents: no sharing, SGLang's adapter namespaces, naive full sharing, and
DroidSpeak-style recompute of one block of layers.

- ``no_sharing``: every turn prefills the whole transcript with the reader's adapter (reference).
- ``sglang``: adapters namespace the cache (SGLang / vLLM semantics): a reader reuses only what
  its own adapter computed, i.e. the transcript up to the end of its own last message; exact.
- ``sglang_alongside``: ``sglang`` with every agent catching up on each new segment alongside the
  writer's decode (background compute): exact, fast, but one full cache per agent.
- ``naive``: one cache for everyone, each segment computed by its writer (adapter on; input
  text by the first reader, agent 0) over the shared cache; read by everyone as is.
- ``droidspeak``: ``naive`` plus, per reader, layers [start, start + width) recomputed over the
  whole transcript with the reader's adapter from the stored hidden states entering ``start``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvcmas_lab.correction.precache_base import (
    LoraSharingMethod,
    Segment,
    register_lora_method,
)
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["DroidSpeak", "NaiveShared", "NoSharing", "SGLangAlongside", "SGLangNamespaces"]

FIRST_READER = 0  # input text is computed by the workflow's first agent (the planner)


@register_lora_method("no_sharing")
@dataclass
class NoSharing(LoraSharingMethod):
    def __post_init__(self):
        self.exact = True

    def _reset(self) -> None:
        pass

    def _append(self, seg: Segment, start: int) -> None:
        pass

    def view(self, reader: int) -> KVCache:
        return self.lora.forward(self.all_ids(), agent=reader).kv

    def _first_token(self, reader, suffix_ids):
        ids = torch.cat([self.all_ids(), suffix_ids])
        return lambda: self.lora.forward(ids, agent=reader).logits[-1]

    def bytes_held(self, num_agents: int) -> int:
        return num_agents * self.num_tokens * self.lora.spec.kv_bytes_per_token(self.lora.ref.dtype)


@register_lora_method("sglang")
@dataclass
class SGLangNamespaces(LoraSharingMethod):
    caches: dict[int, KVCache] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.exact = True

    def _reset(self) -> None:
        self.caches = {}

    def _append(self, seg: Segment, start: int) -> None:
        if seg.writer is None:
            return
        # The writer prefilled and decoded this with its own adapter: its namespace now holds
        # the transcript up to here (computed incrementally over what it held before).
        held = self.caches.get(seg.writer)
        n = len(held) if held is not None else 0
        ids = self.all_ids()[n:]
        out = self.lora.forward(ids, self.positions(n, self.num_tokens), held, agent=seg.writer)
        self.caches[seg.writer] = out.kv if held is None else KVCache.concat([held, out.kv])

    def _catch_up(self, reader: int, suffix_ids: torch.Tensor):
        held = self.caches.get(reader)
        n = len(held) if held is not None else 0
        ids = torch.cat([self.all_ids()[n:], suffix_ids])
        return self.lora.forward(ids, self.positions(n, n + ids.numel()), held, agent=reader), held

    def view(self, reader: int) -> KVCache:
        out, held = self._catch_up(reader, torch.empty(0, dtype=torch.long))
        return out.kv if held is None else KVCache.concat([held, out.kv])

    def _first_token(self, reader, suffix_ids):
        return lambda: self._catch_up(reader, suffix_ids)[0].logits[-1]

    def bytes_held(self, num_agents: int) -> int:
        # While each agent takes its turn it holds the whole transcript in its own namespace.
        return num_agents * self.num_tokens * self.lora.spec.kv_bytes_per_token(self.lora.ref.dtype)


@register_lora_method("sglang_alongside")
@dataclass
class SGLangAlongside(SGLangNamespaces):
    """``sglang`` with every agent's catch-up prefill of a new segment run as soon as it is
    written (alongside the writer's decode; ``background_work``): exact, TTFT = the suffix only
    (plus its own pass over new input text), one full cache per agent. The comparator for any
    sharing method that spends background compute to buy fidelity."""

    _work: list[int] = field(default_factory=list, repr=False)  # agents catching up alongside

    def _append(self, seg: Segment, start: int) -> None:
        # Every agent's cache now covers the transcript; what it cost whom is timed below.
        pos = self.positions(start, self.num_tokens)
        for agent in range(self.lora.adapters.num_agents):
            held = self.caches.get(agent)
            out = self.lora.forward(seg.ids, pos, held, agent=agent)
            self.caches[agent] = out.kv if held is None else KVCache.concat([held, out.kv])
        # Messages: the non-writers' passes run alongside (the writer's is its decode). Input
        # text: each reader's own pass is on its critical path (first_token).
        self._work = [] if seg.writer is None else [
            a for a in range(self.lora.adapters.num_agents) if a != seg.writer]

    def background_work(self):
        work, lora, seg = list(self._work), self.lora, self.segments[-1]
        n, start = self.num_tokens, self.num_tokens - seg.ids.numel()
        caches = dict(self.caches)

        def run():
            for agent in work:
                past = caches[agent].slice(0, start) if start else None
                lora.forward(seg.ids, self.positions(start, n), past, agent=agent)

        return run

    def _first_token(self, reader, suffix_ids):
        cache, seg, n = self.caches[reader], self.segments[-1], self.num_tokens
        start = n - seg.ids.numel() if seg.writer is None else n
        ids = torch.cat([self.all_ids()[start:], suffix_ids])
        pos = self.positions(start, n + suffix_ids.numel())

        def run():
            past = cache.slice(0, start) if start else None
            return self.lora.forward(ids, pos, past, agent=reader).logits[-1]

        return run

    def view(self, reader: int) -> KVCache:
        return self.caches[reader]


@register_lora_method("naive")
@dataclass
class NaiveShared(LoraSharingMethod):
    cache: KVCache | None = field(default=None, repr=False)
    hidden: list[torch.Tensor] | None = field(default=None, repr=False)
    keep_hidden: bool = field(default=False, repr=False)
    pending: list[tuple] = field(default_factory=list, repr=False)  # (ids, pos, writer, past)

    def _reset(self) -> None:
        self.cache, self.hidden, self.pending = None, None, []

    def _append(self, seg: Segment, start: int) -> None:
        writer = FIRST_READER if seg.writer is None else seg.writer
        pos = self.positions(start, start + seg.ids.numel())
        out = self.lora.forward(seg.ids, pos, self.cache, agent=writer,
                                return_hidden=self.keep_hidden)
        past = self.cache
        self.cache = out.kv if self.cache is None else KVCache.concat([self.cache, out.kv])
        if self.keep_hidden:
            self.hidden = out.hidden if self.hidden is None else [
                torch.cat([a, b]) for a, b in zip(self.hidden, out.hidden)]
        # Input text is encoded before anyone reads it (charged to readers at this point).
        self.pending = [(seg.ids, pos, writer, past)] if seg.writer is None else []

    def _run_pending(self) -> None:
        for ids, pos, writer, past in self.pending:
            self.lora.forward(ids, pos, past, agent=writer)

    def view(self, reader: int) -> KVCache:
        return self.cache

    def _first_token(self, reader, suffix_ids):
        pos = self.positions(self.num_tokens, self.num_tokens + suffix_ids.numel())

        def run():
            self._run_pending()
            return self.lora.forward(suffix_ids, pos, self.cache, agent=reader).logits[-1]

        return run

    def bytes_held(self, num_agents: int) -> int:
        return self.cache.nbytes()


@register_lora_method("droidspeak")
@dataclass
class DroidSpeak(NaiveShared):
    """Recompute layers [start, start + width) per reader (the block is profiled by the lab)."""

    start: int = 0
    width: int = 6

    def __post_init__(self):
        self.keep_hidden = True

    def _block(self, reader: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Reader's K/V of the block over the whole transcript, from the stored hidden states."""
        lora, ref = self.lora, self.lora.ref
        pos = self.cache.positions
        h = self.hidden[self.start]
        ks, vs = [], []
        for layer in range(self.start, self.start + self.width):
            _, q, k, v = lora.qkv(layer, h, reader)
            ks.append(k)
            vs.append(v)
            if layer + 1 < self.start + self.width:  # the last layer's output is not needed
                h = lora.finish_layer(layer, h, ref.attend(q, pos, k, v, pos), reader)
        return ks, vs

    def _patched(self, reader: int) -> KVCache:
        ks, vs = self._block(reader)
        k, v = list(self.cache.k), list(self.cache.v)
        k[self.start : self.start + self.width] = ks
        v[self.start : self.start + self.width] = vs
        return KVCache(k, v, self.cache.positions)

    @torch.inference_mode()
    def view(self, reader: int) -> KVCache:
        return self._patched(reader)

    def _first_token(self, reader, suffix_ids):
        pos = self.positions(self.num_tokens, self.num_tokens + suffix_ids.numel())

        @torch.inference_mode()
        def run():
            self._run_pending()
            return self.lora.forward(suffix_ids, pos, self._patched(reader),
                                     agent=reader).logits[-1]

        return run

    def bytes_held(self, num_agents: int) -> int:
        per_token = self.lora.spec.kv_bytes_per_token(self.lora.ref.dtype)
        block = num_agents * self.num_tokens * per_token * self.width // self.lora.spec.num_layers
        hidden = self.hidden[self.start].numel() * self.hidden[self.start].element_size()
        return self.cache.nbytes() + block + hidden

    def describe(self):
        return {**super().describe(), "start": self.start, "width": self.width}
