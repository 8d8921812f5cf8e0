"""Centroid store + DroidSpeak-style recompute of one block of layers per reader
(``rebase_mean_block``).

The centroid store (``rebase_mean``) keeps the centroid pass's hidden states entering layer
``start``; a reader recomputes layers [start, start + width) over the whole transcript with its
own adapter from those hidden states and reads the store elsewhere. With ``start = 0`` the block
is exact (embeddings carry no adapter); deeper blocks start from the centroid's stream, so they
cannot undo the drift below them. The lab profiles ``start`` like ``droidspeak``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvcmas_lab.correction.precache_base import register_lora_method
from sglang_kvcmas_lab.correction.precache_methods import LowRankShared
from sglang_kvcmas_lab.correction.precache_pass import store_pass
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["CentroidBlock"]


@dataclass
class CentroidBlock(LowRankShared):
    start: int = 0
    width: int = 6
    hidden: list[list[torch.Tensor]] = field(default_factory=list, repr=False)  # [seg][layer]

    def _reset(self) -> None:
        super()._reset()
        self.hidden = []

    def _pass(self, ids, pos, writer):
        args = (ids, pos, self._view_of(writer), writer)
        out = store_pass(self.lora, ids, pos, args[2], writer=writer, return_hidden=True)
        # Every layer's input is kept so that the lab can profile ``start``; only the one
        # entering ``start`` is counted in bytes_held (what a deployment keeps).
        self.hidden.append(out.hidden)
        return args, out.store

    def _patched(self, reader: int) -> KVCache:
        lora, ref = self.lora, self.lora.ref
        view = self._view_of(reader)
        pos = view.positions
        h = torch.cat([seg[self.start] for seg in self.hidden])
        ks, vs = list(view.k), list(view.v)
        for layer in range(self.start, self.start + self.width):
            _, q, k, v = lora.qkv(layer, h, reader)
            ks[layer], vs[layer] = k, v
            if layer + 1 < self.start + self.width:
                h = lora.finish_layer(layer, h, ref.attend(q, pos, k, v, pos), reader)
        return KVCache(ks, vs, pos)

    @torch.inference_mode()
    def view(self, reader: int) -> KVCache:
        return self._patched(reader)

    def _first_token(self, reader, suffix_ids):
        pos = self.positions(self.num_tokens, self.num_tokens + suffix_ids.numel())
        work, lora = list(self.pending), self.lora

        @torch.inference_mode()
        def run():
            self._redo(lora, work)
            return lora.forward(suffix_ids, pos, self._patched(reader), agent=reader).logits[-1]

        return run

    def bytes_held(self, num_agents: int) -> int:
        per_token = self.lora.spec.kv_bytes_per_token(self.lora.ref.dtype)
        block = num_agents * self.num_tokens * per_token * self.width // self.lora.spec.num_layers
        hid = sum(seg[self.start].numel() * seg[self.start].element_size() for seg in self.hidden)
        return self.store.nbytes() + block + hid

    def describe(self):
        return {**super().describe(), "start": self.start, "width": self.width}


@register_lora_method("rebase_mean_block")
def _make(**kw):
    return CentroidBlock(name=kw.pop("name", "rebase_mean_block"),
                         **{"input_pass": "mean", "messages": "rebuild_mean",
                            "schedule": "after_turn", **kw})
