"""A reader's borrowed prefix: the match handle and the walks over its shared path.

When a request's own exact radix match ends inside the shared transcript, the tree cache matches
the rest in the shared tree and hands SGLang a :class:`SharedPrefixHandle` as ``req.last_node``.
The handle's shared path is walked once, at match time, into a :class:`BorrowedPath`: every
borrowed token's pool slot, shift, owner head mass and whether the reader agent's own leaves hold
it, as arrays (one slice per tree node, no per-token Python work). Selection
(``policy/recompute.py``, over :func:`borrowed_spans`), the row's prefix slots, its spans for the
attention backend (:func:`row_spans`, :func:`factored_reread`) and its accounting all read those
arrays; :func:`borrowed_tokens`, one object per token, is the reference tests compare them to.

Bookkeeping over plain values and CPU tensors; no SGLang import (the radix node is opaque).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from sglang_kvcmas.attention.deviation_factors import LeafFactorFit, LeafReads, RowLeaves
from sglang_kvcmas.attention.spans import KeyShifts, RecomputedTokens, RowSpans
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
        path: the borrowed tokens as arrays, walked once at match time (:meth:`walked`); valid
            while the request holds its locks (locked nodes and their leaves never change
            slots; a split keeps them).
        factor_rank: rank of the factored leaves the request keeps of the tokens it
            recomputes (0: none; leaf mode ``factored``, ``policy/leaf_mode.py``).
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
    path: BorrowedPath | None = field(default=None, repr=False)
    factor_rank: int = 0

    @property
    def prefix_len(self) -> int:
        return self.split.head_len + self.shared_end - len(self.recompute)

    @property
    def borrowed_len(self) -> int:
        return self.shared_end - self.shared_begin

    def without_recompute(self) -> SharedPrefixHandle:
        return replace(self, recompute=())

    def walked(self) -> SharedPrefixHandle:
        """This handle with its :class:`BorrowedPath` (walked now if it has none)."""
        return self if self.path is not None else replace(self, path=BorrowedPath.walk(self))

    def borrowed(self) -> BorrowedPath:
        """The borrowed tokens as arrays (walked now if the handle has none)."""
        return self.path if self.path is not None else BorrowedPath.walk(self)


@dataclass(frozen=True, eq=False)
class BorrowedPath:
    """Every token in ``[shared_begin, shared_end)`` of a handle's shared path, in shared order.

    Attributes (numpy, [B] each, B = the handle's ``borrowed_len``):
        offsets: int64 shared offsets (``shared_begin + arange(B)``).
        slots: int64 pool slot read: the owner's, or the reader agent's own leaf slot.
        shift: int64 key shift to apply (0 for a leaf slot: exact at the reader's position).
        foreign: bool, read from another context (another owner, or a non-zero shift).
        from_leaf: bool, read from the reader agent's own exact leaf.
        mass: float32 owner head mass (0 where none was recorded).
        factored: bool, read through the reader agent's own factored leaf (the owner's slot
            re-positioned, plus the token's deviation; foreign).
        factor_parts: (path indices [j] int64, their ``TokenFactors``) per factored-leaf part
            read.
    """

    offsets: np.ndarray
    slots: np.ndarray
    shift: np.ndarray
    foreign: np.ndarray
    from_leaf: np.ndarray
    mass: np.ndarray
    factored: np.ndarray
    factor_parts: tuple[tuple[np.ndarray, Any], ...] = ()

    @classmethod
    def walk(cls, handle: SharedPrefixHandle) -> BorrowedPath:
        """One walk of the handle's path: a slice of each node's slots and mass, its leaf's
        slots written over them."""
        head, agent = handle.split.head_len, handle.split.agent
        columns: list[tuple[np.ndarray, ...]] = []  # per node: slots ... factored
        parts: list[tuple[np.ndarray, Any]] = []
        at_path = 0
        for piece in SharedTree.path(handle.shared_node):
            node = piece.node
            lo = max(piece.offset, handle.shared_begin) - piece.offset
            hi = len(node)
            if hi <= lo:
                continue
            n = hi - lo
            d = head + piece.offset - node.owner_start
            s = node.slots.numpy()[lo:hi].copy()
            m = (node.head_mass.numpy()[lo:hi] if node.head_mass is not None
                 else np.zeros(n, dtype=np.float32))
            sh = np.full(n, d, dtype=np.int64)
            fo = np.full(n, node.owner != agent or d != 0, dtype=bool)
            fl = np.zeros(n, dtype=bool)
            leaf = node.exact_leaves.get(agent) if handle.use_leaves else None
            if leaf is not None and leaf.reader_start == head + piece.offset and len(leaf):
                at = leaf.offsets.numpy()
                inside = (at >= lo) & (at < hi)
                i = at[inside] - lo
                s[i], sh[i], fo[i], fl[i] = leaf.slots.numpy()[inside], 0, False, True
            fa = np.zeros(n, dtype=bool)
            fleaf = node.factors.get(agent) if handle.use_leaves else None
            if fleaf is not None and fleaf.reader_start == head + piece.offset:
                for part in fleaf.parts:
                    at = part.offsets.numpy()
                    inside = (at >= lo) & (at < hi)
                    inside[inside] &= ~fl[at[inside] - lo]  # an exact leaf wins
                    if inside.any():
                        i = at[inside] - lo
                        fa[i] = True
                        parts.append((at_path + i, part.factors if inside.all() else
                                      part.factors.select(torch.from_numpy(inside))))
            at_path += n
            columns.append((s, sh, fo, fl, m.astype(np.float32, copy=False), fa))
        b = handle.shared_end - handle.shared_begin
        if not columns:
            empty = np.zeros(0, dtype=np.int64)
            none = np.zeros(0, dtype=bool)
            return cls(empty, empty, empty, none, none, np.zeros(0, dtype=np.float32), none)
        out = cls(np.arange(handle.shared_begin, handle.shared_end, dtype=np.int64),
                  *(np.concatenate(c) for c in zip(*columns)), tuple(parts))
        if out.slots.shape[0] != b:
            raise RuntimeError(f"borrowed path walked {out.slots.shape[0]} tokens, expected {b}")
        return out

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def kept(self, recompute: Sequence[int]) -> np.ndarray:
        """[B] bool: the tokens read borrowed (not in ``recompute``)."""
        mask = np.ones(len(self), dtype=bool)
        if len(recompute) and len(self):
            mask[np.asarray(recompute, dtype=np.int64) - self.offsets[0]] = False
        return mask


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
    """The borrowed part of a handle's shared path as runs of one owner and one shift, a new
    run at every segment start (a node where an insert began): a transcript that one owner grew
    over several turns is several spans, so the first tokens of each new segment are a span's
    first tokens (``policy/recompute.boundary_offsets``), not only those of the first segment,
    which a reader of earlier turns already holds as its leaves."""
    out: list[BorrowedSpan] = []
    head = handle.split.head_len
    for piece in SharedTree.path(handle.shared_node):
        lo = max(piece.offset, handle.shared_begin)
        hi = piece.offset + len(piece.node)
        if hi <= lo:
            continue
        shift = head + piece.offset - piece.node.owner_start
        owner = piece.node.owner
        starts_segment = piece.node.segment_start and lo == piece.offset
        if out and out[-1].end == lo and (out[-1].shift, out[-1].owner) == (shift, owner) \
                and not starts_segment:
            out[-1] = replace(out[-1], end=hi)
        else:
            foreign = owner != handle.split.agent or shift != 0
            out.append(BorrowedSpan(lo, hi, foreign, shift, owner))
    return out


def borrowed_tokens(handle: SharedPrefixHandle) -> list[SlotToken]:
    """Every borrowed token in shared order, recomputed ones left out: the owner's slot read
    re-positioned, or the reader agent's own exact slot where its leaf holds one. One object per
    token: the reference :class:`BorrowedPath` is tested against."""
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
        leaf = node.exact_leaves.get(agent) if handle.use_leaves else None
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


def row_spans(rid: str, prompt_ids: Sequence[int], handle: SharedPrefixHandle
              ) -> tuple[RowSpans, np.ndarray]:
    """The row's per-key shifts in row coordinates (recomputed tokens left out of the borrowed
    part) with the recomputed tokens at their true positions; and the mask of borrowed tokens
    read (``BorrowedPath.kept``).

    Row layout (see ``integration/shared_tree_cache.py``): own radix match, borrowed tokens in
    shared order, then the recomputed tokens moved to the front of the extend.
    """
    path = handle.borrowed()
    head = handle.split.head_len
    kept = path.kept(handle.recompute)
    shifts = KeyShifts.of_row(handle.radix_len, torch.from_numpy(path.shift[kept]))
    leaves = row_leaves(handle, path, kept)
    if not handle.recompute:
        return RowSpans(rid, shifts, leaves=leaves), kept
    moved = np.asarray(handle.recompute, dtype=np.int64) + head
    n_before = handle.radix_len + int(kept.sum())
    positions = np.concatenate([np.arange(handle.radix_len, dtype=np.int64),
                                head + path.offsets[kept], moved])
    ids = np.asarray(prompt_ids, dtype=np.int64)[moved]
    recomputed = RecomputedTokens(n_before, tuple(ids.tolist()), tuple(moved.tolist()))
    return RowSpans(rid, shifts, recomputed, torch.from_numpy(positions), leaves), kept


def row_leaves(handle: SharedPrefixHandle, path: BorrowedPath, kept: np.ndarray
               ) -> RowLeaves | None:
    """The row's factored leaves (None when the request reads and keeps none): the tokens the
    walk found in the agent's factored leaves, at their row indices (:class:`LeafReads`), and
    (``handle.factor_rank``) the factoring of the recomputed foreign tokens it keeps (their
    owner slots and shifts, and the row indices where the row computes them: after the borrowed
    ones, in ``handle.recompute`` order; see :func:`row_spans`).
    """
    n_before = handle.radix_len + int(kept.sum())
    at = np.asarray(handle.recompute, dtype=np.int64) - handle.shared_begin
    rows = n_before + np.arange(at.shape[0], dtype=np.int64)
    factor = leaves = None
    if handle.factor_rank > 0 and handle.recompute and handle.use_leaves:
        keep = path.foreign[at]
        if keep.any():
            factor = LeafFactorFit(torch.from_numpy(path.slots[at][keep].copy()),
                                   torch.from_numpy(path.shift[at][keep].copy()),
                                   torch.from_numpy(rows[keep]),
                                   torch.from_numpy(path.offsets[at][keep].copy()),
                                   torch.from_numpy(path.offsets[at][keep] + handle.split.head_len),
                                   handle.factor_rank)
    if path.factor_parts:
        row_of = handle.radix_len + np.cumsum(kept) - 1  # path index -> row index, if kept
        parts = []
        for idx, factors in path.factor_parts:
            read = kept[idx]  # factored tokens are never recomputed; a guard all the same
            parts.append((torch.from_numpy(row_of[idx][read]),
                          torch.from_numpy(path.offsets[idx][read] + handle.split.head_len),
                          factors if read.all() else factors.select(torch.from_numpy(read))))
        leaves = LeafReads(parts)
    if factor is None and leaves is None:
        return None
    return RowLeaves(leaves, factor)


def adopt_recomputed(tree: SharedTree, handle: SharedPrefixHandle, slots: torch.Tensor,
                     bytes_per_token: int) -> torch.Tensor:
    """Keep the tokens a reader recomputed (unless it reads no leaves) as its exact leaves on
    the shared nodes, so its later turns read them exactly without recomputing.

    Args:
        slots: [len(handle.recompute)] int64 pool slots of the recomputed tokens, in
            ``handle.recompute`` order.
    Returns:
        [j] int64 slots the tree did not adopt (not kept, or a leaf already held the token); the
        caller frees them with the request.
    """
    offsets = torch.tensor(handle.recompute, dtype=torch.int64)
    keep = torch.full((offsets.shape[0],), handle.use_leaves, dtype=torch.bool)
    rejected = [slots[~keep]] if bool((~keep).any()) else []
    head = handle.split.head_len
    for piece in SharedTree.path(handle.shared_node) if bool(keep.any()) else ():
        mine = keep & (offsets >= piece.offset) & (offsets < piece.offset + len(piece.node))
        if bool(mine.any()):
            rejected.append(tree.add_overrides(
                piece.node, handle.split.agent, offsets[mine] - piece.offset, slots[mine],
                head + piece.offset, bytes_per_token,
            ))
    return torch.cat(rejected) if rejected else torch.empty(0, dtype=torch.int64)


def factored_reread(handle: SharedPrefixHandle) -> SharedPrefixHandle | None:
    """The handle a factored reader's row reads after its extend has kept its recomputed
    tokens as factored leaves (:func:`adopt_factored`): no recompute, its path walked afresh,
    so those tokens read as the owner's KV re-positioned plus their deviation, in shared order
    (row index = position). None when a recomputed token would then read worse than the exact
    KV the row holds: a foreign one that no factored leaf keeps (the request reads no leaves,
    or the fit kept nothing)."""
    if not handle.recompute:
        return None
    fresh = replace(handle, recompute=(), path=None).walked()
    at = np.asarray(handle.recompute, dtype=np.int64) - handle.shared_begin
    path = fresh.borrowed()
    return fresh if bool((path.factored[at] | ~path.foreign[at]).all()) else None


def adopt_factored(tree: SharedTree, handle: SharedPrefixHandle, fit: LeafFactorFit) -> int:
    """Keep a reader's factored tokens (``fit``, made during its extend) as its factored leaves
    on the shared nodes they belong to; its later turns read them through their deviation.

    Returns:
        tokens kept.
    """
    result = fit.result()
    if result is None or not handle.use_leaves:
        return 0
    offsets, head, kept = fit.offsets, handle.split.head_len, 0
    for piece in SharedTree.path(handle.shared_node):
        mine = (offsets >= piece.offset) & (offsets < piece.offset + len(piece.node))
        if bool(mine.any()):
            local = offsets[mine] - piece.offset
            order = torch.argsort(local)
            kept += tree.add_factors(piece.node, handle.split.agent, local[order],
                                     result.select(torch.nonzero(mine).flatten()[order]),
                                     head + piece.offset)
    return kept
