"""PReCache and LRAgent sharing for LoRA agents: one base cache + every agent's low-rank cache.

All four keep a ``LowRankKVCache`` of the transcript and differ in whose hidden states x each
segment's base K0 = x W and low-rank a = x [A_1 .. A_N] come from:

| method | input text | an agent's message |
|---|---|---|
| ``first_agent`` (LRAgent BaseShared) | first reader's pass, adapter on | the writer's pass |
| ``prelr_shared`` (PReCache PreLRShared) | neutral pass, adapters off | the writer's pass |
| ``rebase_after_turn`` (ReBaseShared) | neutral pass | neutral rebuild before the next read |
| ``rebase_alongside`` (ReBaseShared) | neutral pass | neutral rebuild while the writer decodes |
| ``rebase_mean`` (ours) | mean-adapter pass | mean-adapter rebuild before the next read |

The writer's pass stores base and all agents' low-rank caches as a by-product of its own decode
(one stacked matmul per layer); the neutral rebuild re-encodes the message with adapters off over
the neutral base, so no adapter leaks into another agent's view. ``rebase_alongside`` has the same
cache as ``rebase_after_turn``; its rebuild runs batched with the writer's decode steps (off the
next reader's critical path) and the lab reports that work as ``background_s``.

Reads: ``keys`` ("lowrank" | "base") and ``read`` ("split": P V0 + s (P a) B, or "materialize").

``fixup_rho > 0`` adds a selective fix-up on the reader's critical path: the
reader's view is exact at layer 0 (embeddings carry no adapter), its layers 0-1 run for every
shared token with the reader's adapter, the ``fixup_rho`` fraction of tokens with the largest
layer-1 value deviation is recomputed through all layers and the rest keep the store's view
(``correction.selective.selective_prefill``, shared with the KVCMAS lab's CacheBlend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sglang_kvcmas_lab.correction.lora_baselines import FIRST_READER
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT
from sglang_kvcmas_lab.correction.precache_base import (
    LoraSharingMethod,
    Segment,
    register_lora_method,
)
from sglang_kvcmas_lab.correction.precache_pass import store_pass
from sglang_kvcmas_lab.correction.precache_read import split_read_forward
from sglang_kvcmas_lab.correction.precache_store import KEY_MODES, LowRankKVCache
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["LowRankShared"]


@dataclass
class LowRankShared(LoraSharingMethod):
    input_pass: str = "neutral"  # "neutral" | "first" | "mean"
    messages: str = "writer"  # "writer" | "rebuild" (neutral) | "rebuild_mean"
    schedule: str = "after_turn"  # "after_turn" | "alongside" (rebuild only)
    keys: str = "lowrank"
    read: str = "split"  # "split" | "materialize"
    fixup_rho: float = 0.0
    store: LowRankKVCache | None = field(default=None, repr=False)
    pending: list[tuple] = field(default_factory=list, repr=False)
    background: list[tuple] = field(default_factory=list, repr=False)
    split_rows: ClassVar[bool] = True  # batched decode may read the store split (throughput)

    def __post_init__(self):
        if (self.input_pass not in ("neutral", "first", "mean")
                or self.messages not in ("writer", "rebuild", "rebuild_mean")
                or self.schedule not in ("after_turn", "alongside") or self.keys not in KEY_MODES
                or self.read not in ("split", "materialize")):
            raise ValueError(f"bad configuration {self}")

    def _reset(self) -> None:
        self.store, self.pending, self.background = None, [], []

    def _view_of(self, writer: int | None) -> KVCache | None:
        if self.store is None:
            return None
        return self.store.view(self.lora.adapters, writer, keys=self.keys)

    def _pass(self, ids, pos, writer):
        """(the store pass's arguments, its output store) for ``writer`` over the current store."""
        args = (ids, pos, self._view_of(writer), writer)
        return args, store_pass(self.lora, ids, pos, args[2], writer=writer).store

    def _append(self, seg: Segment, start: int) -> None:
        pos = self.positions(start, start + seg.ids.numel())
        self.pending, self.background = [], []
        if seg.writer is None:
            writer = {"neutral": None, "first": FIRST_READER, "mean": MEAN_AGENT}[self.input_pass]
            args, new = self._pass(seg.ids, pos, writer)
            self.pending = [args]
        elif self.messages == "writer":
            _, new = self._pass(seg.ids, pos, seg.writer)
        else:
            args, new = self._pass(seg.ids, pos,
                                   MEAN_AGENT if self.messages == "rebuild_mean" else None)
            (self.pending if self.schedule == "after_turn" else self.background).append(args)
        self.store = new if self.store is None else LowRankKVCache.concat([self.store, new])

    @staticmethod
    def _redo(lora, work: list[tuple]) -> None:
        for ids, pos, past, writer in work:
            store_pass(lora, ids, pos, past, writer=writer)

    def background_work(self):
        """Closure redoing the off-critical-path rebuild of the newest segment (or None)."""
        if not self.background:
            return None
        work = list(self.background)
        return lambda: self._redo(self.lora, work)

    def _fixup(self, reader: int, suffix_ids: torch.Tensor):
        from sglang_kvcmas_lab.correction.cacheblend import top_value_deviation
        from sglang_kvcmas_lab.correction.lora_forward import AgentModel
        from sglang_kvcmas_lab.correction.selective import selective_prefill

        lora, n = self.lora, self.num_tokens
        starts, off = [], 0
        for seg in self.segments:
            starts.append(off)
            off += seg.ids.numel()
        return selective_prefill(
            AgentModel(lora, reader), KVCache.empty(lora.spec, lora.ref.dtype), self.all_ids(),
            self._view_of(reader), torch.tensor(starts), suffix_ids,
            self.positions(n, n + suffix_ids.numel()),
            lambda ctx: top_value_deviation(ctx, self.fixup_rho))

    def view(self, reader: int) -> KVCache:
        if self.fixup_rho > 0:
            return self._fixup(reader, torch.empty(0, dtype=torch.long)).block_view
        return self._view_of(reader)

    def _first_token(self, reader, suffix_ids):
        pos = self.positions(self.num_tokens, self.num_tokens + suffix_ids.numel())
        work, lora, store = list(self.pending), self.lora, self.store

        @torch.inference_mode()
        def run():
            self._redo(lora, work)
            if self.fixup_rho > 0:
                return self._fixup(reader, suffix_ids).last_logits
            if self.read == "split":
                return split_read_forward(lora, store, reader, suffix_ids, pos,
                                          keys=self.keys).logits[-1]
            view = store.view(lora.adapters, reader, keys=self.keys)
            return lora.forward(suffix_ids, pos, view, agent=reader).logits[-1]

        return run

    def bytes_held(self, num_agents: int) -> int:
        return self.store.nbytes()

    def describe(self):
        return {**super().describe(), "input_pass": self.input_pass, "messages": self.messages,
                "schedule": self.schedule, "keys": self.keys, "read": self.read,
                "fixup_rho": self.fixup_rho}


def _variant(name: str, **fixed):
    @register_lora_method(name)
    def make(**kw):
        return LowRankShared(name=kw.pop("name", name), **{**fixed, **kw})

    return make


_variant("first_agent", input_pass="first", messages="writer")
_variant("prelr_shared", input_pass="neutral", messages="writer")
_variant("rebase_after_turn", input_pass="neutral", messages="rebuild", schedule="after_turn")
_variant("rebase_alongside", input_pass="neutral", messages="rebuild", schedule="alongside")
_variant("rebase_fixup", input_pass="neutral", messages="rebuild", schedule="after_turn",
         fixup_rho=0.15)
# Centroid base (ours): the shared base is rebuilt under the mean of all agents' adapters, which
# the stacked low-rank products give for free; each agent still adds its own s a B on top.
_variant("rebase_mean", input_pass="mean", messages="rebuild_mean", schedule="after_turn")
_variant("rebase_mean_fixup", input_pass="mean", messages="rebuild_mean", schedule="after_turn",
         fixup_rho=0.15)
_variant("rebase_mean_alongside", input_pass="mean", messages="rebuild_mean", schedule="alongside")
