"""Centroid store + per-agent low-rank leaves of each agent's own pass (``rebase_mean_delta``).

The centroid store (``rebase_mean``: base K0/V0 under the agents' mean adapter plus every agent's
``a = x A``) leaves agent i's view wrong by the drift of i's hidden states from the centroid's,
which no k/v low-rank cache built from the centroid's x can fix. That remaining deviation is
itself low rank per segment, layer and KV head (``benchmark/lab/precache_drift_study.py``
measures how much each rank recovers). So each agent runs its own pass over every new
segment, over its own (compressed) view of the earlier ones, and keeps only a rank-``rank``
truncated SVD of ``own K/V - centroid view`` per layer >= 1 and KV head (a ``DeltaLeaf``):

    view_i = store.view(i) + leaf_i          (layer 0 has no leaf: embeddings carry no adapter)

Schedule (the lab's timing rule, ``precache_base``): a message's writer gets its own K/V from its
decode; the other agents' passes, the centroid rebuild and every SVD run alongside the writer's
decode (``background_work``, reported as ``background_s``: N - 1 agent passes plus one rebuild per
message, against one rebuild for ``rebase_mean_alongside``). For input text a reader waits only
for its own pass over the new input (its exact K/V of it, which it reads as is); its leaf and
the centroid pass are background. So this is a memory-for-compute trade: near no sharing's
fidelity at ~1/2 of its bytes and sharing's TTFT, paying N passes of compute per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sglang_kvcmas_lab.correction.precache_base import Segment, register_lora_method
from sglang_kvcmas_lab.correction.precache_methods import LowRankShared
from sglang_kvcmas_lab.delta.leaf import DeltaLeaf, svd_factors
from sglang_kvcmas_lab.models.reference_llama import KVCache

__all__ = ["CentroidDelta", "delta_leaf"]


def delta_leaf(agent: int, segment_id: int, own: KVCache, view: KVCache, rank: int,
               keys: bool = True, old: DeltaLeaf | None = None) -> DeltaLeaf:
    """Rank-``rank`` factors per layer >= 1 and KV head of ``own - view`` (both [T tokens];
    ``keys=False`` leaves keys uncorrected). With ``old`` (a leaf over the tokens before these),
    one leaf over old + new tokens: the SVD of [old's reconstruction ; the new deviation]."""
    n = own.num_layers

    def fac(dev, prev):
        if prev is not None:
            dev = torch.cat([prev.dense(), dev])
        return svd_factors(dev, rank)

    ks = [None] + [fac(own.k[layer] - view.k[layer], old.k[layer] if old else None)
                   if keys else None for layer in range(1, n)]
    vs = [None] + [fac(own.v[layer] - view.v[layer], old.v[layer] if old else None)
                   for layer in range(1, n)]
    return DeltaLeaf(str(agent), segment_id, tuple(ks), tuple(vs), (None,) * n)


@dataclass
class CentroidDelta(LowRankShared):
    rank: int = 4
    delta_keys: bool = True
    # Leaves span chunks of >= ``chunk`` tokens: a new segment is refit into the newest leaf
    # while that leaf is shorter (0: one leaf per segment; ``merged``: one leaf per agent).
    chunk: int = 0
    merged: bool = False
    leaves: list[list[DeltaLeaf]] = field(default_factory=list, repr=False)  # [chunk][agent]
    bounds: list[tuple[int, int]] = field(default_factory=list, repr=False)
    own_newest: dict[int, KVCache] = field(default_factory=dict, repr=False)
    split_rows: ClassVar[bool] = False  # its leaves are read materialized

    def _reset(self) -> None:
        super()._reset()
        self.leaves, self.bounds, self.own_newest = [], [], {}

    def agent_view(self, agent: int, upto: int | None = None) -> KVCache | None:
        """Agent's view of the first ``upto`` tokens (all): centroid store view + its leaves."""
        if not self.leaves or upto == 0:
            return None
        parts = [self.leaves[s][agent].apply(self.store.slice(a, b).view(
                 self.lora.adapters, agent, keys=self.keys))
                 for s, (a, b) in enumerate(self.bounds) if upto is None or a < upto]
        view = KVCache.concat(parts)
        return view if upto is None else view.slice(0, upto)

    def _own_pass(self, agent: int, ids: torch.Tensor, pos: torch.Tensor) -> KVCache:
        past = self.agent_view(agent, int(pos[0]))
        return self.lora.forward(ids, pos, past, agent=agent).kv

    def _append(self, seg: Segment, start: int) -> None:
        n = seg.ids.numel()
        pos = self.positions(start, start + n)
        joins = bool(self.leaves) and (self.merged or
                                       self.bounds[-1][1] - self.bounds[-1][0] < self.chunk)
        prev = self.leaves[-1] if joins else None
        owns = [self._own_pass(i, seg.ids, pos) for i in range(self.lora.adapters.num_agents)]
        super()._append(seg, start)  # centroid store pass (pending / background as rebase_mean)
        new = self.store.slice(start, start + n)
        views = [new.view(self.lora.adapters, i, keys=self.keys) for i in range(len(owns))]
        if joins:
            sid = len(self.leaves) - 1
            self.leaves[-1] = [delta_leaf(i, sid, own, views[i], self.rank, self.delta_keys,
                                          old=prev[i]) for i, own in enumerate(owns)]
            self.bounds[-1] = (self.bounds[-1][0], start + n)
        else:
            sid = len(self.leaves)
            self.leaves.append([delta_leaf(i, sid, own, views[i], self.rank, self.delta_keys)
                                for i, own in enumerate(owns)])
            self.bounds.append((start, start + n))
        # Input text: a reader waits for its own pass only and reads that pass's exact K/V.
        self.own_newest = {i: own for i, own in enumerate(owns)} if seg.writer is None else {}
        # What runs alongside (the writer's own pass is its decode; input: everything but the
        # reader's own pass, which is charged in first_token).
        others = [i for i in range(len(owns)) if i != seg.writer]
        work = (self.pending or []) + self.background
        self.pending, self.background = [], []
        self._alongside = (work, others if seg.writer is not None else list(range(len(owns))),
                           prev, seg.ids, pos)

    def background_work(self):
        work, agents, prev, ids, pos = self._alongside
        lora, start = self.lora, int(pos[0])

        def run():
            self._redo(lora, work)
            new = self.store.slice(start, start + ids.numel())
            for i in agents:
                own = lora.forward(ids, pos, self.agent_view(i, start), agent=i).kv
                delta_leaf(i, 0, own, new.view(lora.adapters, i, keys=self.keys), self.rank,
                           self.delta_keys, old=None if prev is None else prev[i])

        return run

    def view(self, reader: int) -> KVCache:
        if reader not in self.own_newest:
            return self.agent_view(reader)
        start = self.num_tokens - self.segments[-1].ids.numel()
        past, own = self.agent_view(reader, start), self.own_newest[reader]
        return own if past is None else KVCache.concat([past, own])

    def _first_token(self, reader, suffix_ids):
        n = self.num_tokens
        pos = self.positions(n, n + suffix_ids.numel())
        lora, is_input, seg = self.lora, reader in self.own_newest, self.segments[-1]
        start = n - seg.ids.numel()

        @torch.inference_mode()
        def run():
            if is_input:  # the reader's own pass over the new input, on its earlier view
                past = self.agent_view(reader, start)
                own = lora.forward(seg.ids, self.positions(start, n), past, agent=reader).kv
                view = own if past is None else KVCache.concat([past, own])
            else:
                view = self.agent_view(reader)
            return lora.forward(suffix_ids, pos, view, agent=reader).logits[-1]

        return run

    def bytes_held(self, num_agents: int) -> int:
        return self.store.nbytes() + sum(leaf.nbytes() for seg in self.leaves for leaf in seg)

    def describe(self):
        return {**super().describe(), "rank": self.rank, "delta_keys": self.delta_keys,
                "chunk": self.chunk, "merged": self.merged}


@register_lora_method("rebase_mean_delta")
def _make(**kw):
    return CentroidDelta(name=kw.pop("name", "rebase_mean_delta"),
                         **{"input_pass": "mean", "messages": "rebuild_mean",
                            "schedule": "alongside", **kw})
