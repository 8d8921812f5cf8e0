"""A reader's borrowed prefix: the match handle and the walks over its shared path.

When a request's own exact radix match ends inside the shared transcript, the tree cache matches
the rest in the shared tree and hands SGLang a :class:`SharedPrefixHandle` as ``req.last_node``.
The functions here walk the handle's shared path, once per question:

- :func:`borrowed_spans`: runs of one owner and one shift (what selection needs);
- :func:`borrowed_tokens`: every borrowed token with its pool slot, shift and owner head mass,
  read from the reader agent's own exact leaf where one holds it;
- :func:`row_spans`: the reader's row in row coordinates for the attention backend.

Bookkeeping over plain values and CPU tensors; no SGLang import (the radix node is opaque).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from sglang_kvcmas.attention.spans import RecomputedTokens, RowSpans, SharedSpan
from sglang_kvcmas.policy.recompute import BorrowedSpan, BorrowedToken
from sglang_kvcmas.tree.agent_split import AgentSplit
from sglang_kvcmas.tree.shared_tree import SharedNode, SharedTree


@dataclass(eq=False)
class SharedPrefixHandle:
    """``req.last_node`` of a request whose prefix continues into borrowed shared KV.

    Attributes:
        radix_node: last node of the request's own exact radix match (opaque here).
        radix_len: tokens of that match (>= the head length).
        shared_node: deepest shared-tree node of the borrowed part.
        shared_begin: shared offset where borrowing starts (= radix_len − head_len).
        shared_end: shared offset where it ends (path length of ``shared_node``).
        split: the request's head / shared / suffix split.
        namespace: ``(extra_key, cache_salt)``.
        recompute: shared offsets in ``[shared_begin, shared_end)`` the request recomputes in its
            own context instead of borrowing (left out of its prefix; see ``RecomputedTokens``).
        use_leaves: read the agent's exact leaves and keep what it recomputes as new ones (off
            for a request that sets its own recompute knobs: it measures the owner's KV alone).
        keep: the recomputed offsets kept as leaves (None: all; the others are freed with the
            request, ``RecomputeConfig.leaf_mass_fraction``).
    """

    radix_node: Any
    radix_len: int
    shared_node: SharedNode
    shared_begin: int
    shared_end: int
    split: AgentSplit
    namespace: Hashable
    recompute: tuple[int, ...] = ()
    use_leaves: bool = True
    keep: tuple[int, ...] | None = None

    @property
    def prefix_len(self) -> int:
        return self.split.head_len + self.shared_end - len(self.recompute)

    @property
    def borrowed_len(self) -> int:
        return self.shared_end - self.shared_begin

    def without_recompute(self) -> SharedPrefixHandle:
        return replace(self, recompute=(), keep=None)


@dataclass(frozen=True)
class SlotToken:
    """One borrowed token as the reader's row holds it.

    Attributes:
        token: offset, foreign, from_leaf and mass (what selection sees).
        slot: pool slot read: the owner's, or the reader agent's own where its leaf holds one.
        shift: key shift to apply (0 for a leaf slot: exact at the reader's position).
    """

    token: BorrowedToken
    slot: int
    shift: int


def borrowed_spans(handle: SharedPrefixHandle) -> list[BorrowedSpan]:
    """The borrowed part of a handle's shared path as runs of one owner and one shift."""
    out: list[BorrowedSpan] = []
    head = handle.split.head_len
    for piece in SharedTree.path(handle.shared_node):
        lo = max(piece.offset, handle.shared_begin)
        hi = piece.offset + len(piece.node)
        if hi <= lo:
            continue
        shift = head + piece.offset - piece.node.owner_start
        owner = piece.node.owner
        if out and out[-1].end == lo and (out[-1].shift, out[-1].owner) == (shift, owner):
            out[-1] = replace(out[-1], end=hi)
        else:
            foreign = owner != handle.split.agent or shift != 0
            out.append(BorrowedSpan(lo, hi, foreign, shift, owner))
    return out


def borrowed_tokens(handle: SharedPrefixHandle) -> list[SlotToken]:
    """Every borrowed token in shared order, recomputed ones left out: the owner's slot read
    re-positioned, or the reader agent's own exact slot where its leaf holds one."""
    head, agent, skip = handle.split.head_len, handle.split.agent, set(handle.recompute)
    out: list[SlotToken] = []
    for piece in SharedTree.path(handle.shared_node):
        node = piece.node
        lo = max(piece.offset, handle.shared_begin)
        hi = piece.offset + len(node)
        if hi <= lo:
            continue
        shift = head + piece.offset - node.owner_start
        foreign = node.owner != agent or shift != 0
        leaf = node.deltas.get(agent) if handle.use_leaves else None
        own = leaf.lookup() if leaf is not None and leaf.reader_start == (
            head + piece.offset) else {}
        slots, mass = node.slots.tolist(), node.mass().tolist()
        for offset in range(lo, hi):
            if offset in skip:
                continue
            i = offset - piece.offset
            if i in own:
                out.append(SlotToken(BorrowedToken(offset, False, True, mass[i]), own[i], 0))
            else:
                out.append(SlotToken(BorrowedToken(offset, foreign, False, mass[i]), slots[i],
                                     shift))
    return out


def row_spans(rid: str, prompt_ids: Sequence[int], handle: SharedPrefixHandle,
              tokens: list[SlotToken]) -> tuple[RowSpans, int]:
    """The row's borrowed spans in row coordinates, from ``tokens = borrowed_tokens(handle)``
    (recomputed tokens left out), with the recomputed tokens at their true positions; and how
    many borrowed tokens are read from another context (re-positioned).

    Row layout (see ``integration/shared_tree_cache.py``): own radix match, borrowed tokens in
    shared order, then the recomputed tokens moved to the front of the extend.
    """
    head = handle.split.head_len
    spans: list[list[int]] = []  # [row start, length, shift]
    positions = list(range(handle.radix_len))
    foreign = 0
    for tok in tokens:
        row = len(positions)
        positions.append(head + tok.token.offset)
        foreign += tok.token.foreign
        if spans and spans[-1][0] + spans[-1][1] == row and spans[-1][2] == tok.shift:
            spans[-1][1] += 1
        else:
            spans.append([row, 1, tok.shift])
    reads = tuple(SharedSpan(s, n, d) for s, n, d in spans if d != 0)
    if not handle.recompute:
        return RowSpans(rid, reads), foreign
    moved = tuple(head + o for o in handle.recompute)
    recomputed = RecomputedTokens(
        len(positions), tuple(int(prompt_ids[p]) for p in moved), moved
    )
    positions.extend(moved)
    return RowSpans(rid, reads, recomputed, torch.tensor(positions)), foreign


def adopt_recomputed(tree: SharedTree, handle: SharedPrefixHandle, slots: torch.Tensor,
                     bytes_per_token: int) -> torch.Tensor:
    """Keep the tokens a reader recomputed (``handle.keep`` of them; all when None) as its exact
    leaves on the shared nodes, so its later turns read them exactly without recomputing.

    Args:
        slots: [len(handle.recompute)] int64 pool slots of the recomputed tokens, in
            ``handle.recompute`` order.
    Returns:
        [j] int64 slots the tree did not adopt (not kept, or a leaf already held the token); the
        caller frees them with the request.
    """
    by_offset = dict(zip(handle.recompute, slots.tolist()))
    kept = (set() if not handle.use_leaves
            else set(handle.recompute if handle.keep is None else handle.keep))
    transient = [by_offset[o] for o in handle.recompute if o not in kept]
    rejected = [torch.tensor(transient, dtype=torch.int64)] if transient else []
    head = handle.split.head_len
    for piece in SharedTree.path(handle.shared_node) if kept else ():
        mine = [o for o in handle.recompute
                if o in kept and piece.offset <= o < piece.offset + len(piece.node)]
        if mine:
            rejected.append(tree.add_overrides(
                piece.node, handle.split.agent, torch.tensor(mine) - piece.offset,
                torch.tensor([by_offset[o] for o in mine]), head + piece.offset, bytes_per_token,
            ))
    return torch.cat(rejected) if rejected else torch.empty(0, dtype=torch.int64)
