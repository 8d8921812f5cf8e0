"""The shared-context tree: a token radix tree over shared-context tokens only.

Keyed by tokens (never by agent) inside one namespace ``(extra_key, cache_salt)``, so the same
transcript matches for every agent of a tenant and never across tenants. A node holds the KV pool
slots of its owner's exact computation of those tokens and the owner position of its first token;
a reader at another position reads them re-positioned by ``shift = reader_pos - owner_pos``.

Slot ownership (who frees them) is one of two kinds:

- **anchored**: the slots belong to the owner's own path in SGLang's radix tree; ``anchor`` is the
  radix node ending that path. The node frees nothing; when the anchor is evicted the node and its
  subtree are dropped (:meth:`SharedTree.drop_anchor`). Readers lock the anchor.
- **owned** (``anchor is None``): slots computed by a request that itself read borrowed KV, so no
  radix path can hold them. The tree frees them when the node is evicted.

A reader agent's exact leaves (``exact_leaves``, ``tree/pool_overrides.py``) hold its exact KV
for some of a node's tokens (those it recomputed); the tree owns their slots like an owned node's,
counts them in ``owned_size`` and frees them when the leaf (least recently used first) or its
node is evicted. Its factored leaves (``factors``, ``tree/factored_leaves.py``: host memory, not
pool slots) are kept on the nodes likewise.

Keys are numpy int64 arrays and matching compares whole slices at once, not one Python step per
token.

NOTE: a node is locked (``lock_ref > 0``) while any request reads it or a descendant; locked nodes
and their exact leaves are never dropped or evicted. Bookkeeping only: slot tensors are opaque
int64 payloads.

NOTE: over 500 lines because ``SharedTree`` keeps one set of invariants (node map, lock counts,
owned and leaf sizes, eviction order, the leaf budget over both leaf types) that
``check_invariants`` and ``trim_leaves`` walk together; the borrowed-path walks live in
``tree/borrowed.py``, the leaves themselves in ``pool_overrides.py`` and ``factored_leaves.py``
(only their adoption, budget and byte counts are here, beside the sizes they change).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang_kvcmas.tokens import as_token_array, common_prefix
from sglang_kvcmas.tree.factored_leaves import FactorLeaf
from sglang_kvcmas.tree.pool_overrides import PoolOverrides

Namespace = Hashable
"""``(extra_key, cache_salt)`` of a request."""


@dataclass(eq=False)
class SharedNode:
    """One run of shared tokens with a single owner.

    Attributes:
        key: [len] int64 token ids (numpy).
        slots: [len] int64 pool slots holding the owner's KV of those tokens.
        owner: agent id of the owner.
        owner_start: owner position of ``key[0]`` (RoPE position the keys were rotated at).
        anchor: radix node protecting ``slots`` (anchored) or None (the tree owns them).
        exact_leaves: agent -> exact leaf (:class:`PoolOverrides`) over this node's tokens.
        factors: agent -> factored leaf (:class:`FactorLeaf`: low-rank deviations, host
            memory) over this node's tokens.
        head_mass: [len] float32 attention mass each token put on its owner's head in the
            owner's pass (0 where not recorded); readers recompute the largest first.
    """

    key: np.ndarray
    slots: torch.Tensor
    owner: str
    owner_start: int
    anchor: object | None
    parent: SharedNode | None = None
    children: dict[int, SharedNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = field(default_factory=time.monotonic)
    exact_leaves: dict[str, PoolOverrides] = field(default_factory=dict)
    factors: dict[str, FactorLeaf] = field(default_factory=dict)
    alive: bool = True
    head_mass: torch.Tensor | None = None
    segment_start: bool = True
    """Whether ``key[0]`` is where an insert began (False for the tail half of a split): a
    segment's first token, where ``tree/borrowed.borrowed_spans`` starts a new span."""

    def mass(self) -> torch.Tensor:
        """[len] float32 ``head_mass``, zeros when none was recorded."""
        return self.head_mass if self.head_mass is not None else torch.zeros(len(self))

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @property
    def first(self) -> int:
        """The first token id (the node's key in its parent's ``children``)."""
        return int(self.key[0])

    @property
    def owns_slots(self) -> bool:
        return self.anchor is None

    @property
    def exact_leaf_tokens(self) -> int:
        """Pool slots held by this node's exact leaves."""
        return sum(len(d) for d in self.exact_leaves.values())

    @property
    def owned_tokens(self) -> int:
        """Pool slots the tree frees when this node goes: its own (if owned) and its leaves'."""
        return (len(self) if self.owns_slots else 0) + self.exact_leaf_tokens


@dataclass(frozen=True)
class PathPiece:
    """One node of a matched path: the node and the shared offset of its first token."""

    node: SharedNode
    offset: int


class SharedTree:
    """Token radix tree of shared contexts, one root per namespace.

    Args:
        free_slots: called with a [n] int64 tensor of slots the tree gives back to the pool.
    """

    def __init__(self, free_slots: Callable[[torch.Tensor], None]):
        self._free = free_slots
        self.reset()

    def reset(self) -> None:
        """Forget everything (the pool is being reset too: nothing is freed)."""
        self.roots: dict[Namespace, SharedNode] = {}
        self._by_anchor: dict[int, set[SharedNode]] = {}
        self.owned_size = 0
        self.owned_locked_size = 0
        self.leaf_size = 0
        """Pool slots held by exact leaves (part of ``owned_size``)."""
        self.version = getattr(self, "version", 0) + 1
        """Bumped whenever a node is added or removed (and on reset, never going back): a match
        computed at one version holds until the next (splits and leaves change no match
        length)."""

    # ----- reading -----

    def _root(self, ns: Namespace, create: bool) -> SharedNode | None:
        root = self.roots.get(ns)
        if root is None and create:
            root = SharedNode(np.zeros(0, dtype=np.int64), torch.empty(0, dtype=torch.int64), "",
                              0, anchor=None)
            root.lock_ref = 1  # the root is never evicted
            self.roots[ns] = root
        return root

    def match(self, ns: Namespace, tokens: Sequence[int], split: bool = True
              ) -> tuple[int, SharedNode | None]:
        """Longest prefix of ``tokens`` in the tree.

        Args:
            split: split the last node at the match end so the match ends on a node boundary
                (needed before locking); with False the tree is not modified (a peek).
        Returns:
            (matched length, deepest node fully matched or None). With ``split=False`` the length
            may end inside a node that is not returned.
        """
        node = self._root(ns, create=False)
        if node is None:
            return 0, None
        tokens = as_token_array(tokens)
        now = time.monotonic()
        pos, deepest = 0, None
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = common_prefix(child.key, tokens, pos)
            if n < len(child):
                if not split:
                    pos += n
                    break
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = deepest = child
        return pos, deepest

    @staticmethod
    def path(node: SharedNode | None) -> list[PathPiece]:
        """Root-to-``node`` pieces with their shared offsets (root excluded)."""
        nodes = []
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        out, offset = [], 0
        for n in reversed(nodes):
            out.append(PathPiece(n, offset))
            offset += len(n)
        return out

    @staticmethod
    def path_slots(node: SharedNode | None) -> torch.Tensor:
        """[path_len] int64 slots along the root-to-``node`` path."""
        pieces = SharedTree.path(node)
        if not pieces:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([p.node.slots for p in pieces])

    # ----- writing -----

    def insert(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        start: int,
        slots: torch.Tensor,
        owner: str,
        owner_start: int,
        anchor: object | None,
        head_mass: torch.Tensor | None = None,
        segment_start: bool = True,
    ) -> tuple[int, SharedNode | None]:
        """Add ``tokens[start:]`` after the existing path ``tokens[:start]``.

        Args:
            tokens: the whole shared context (from shared offset 0).
            start: shared offset where the new tokens begin; ``tokens[:start]`` must match fully.
            slots: [len(tokens) - start] int64 slots of the new tokens.
            owner_start: owner position of ``tokens[start]``.
            head_mass: optional [len(tokens) - start] float32 owner head mass of the new tokens.
            segment_start: whether the new tokens begin a segment (False: a later chunk of the
                same request's prefill, continuing the segment its earlier chunk began).
        Returns:
            (matched length before inserting, new node or None). When the tree already holds more
            than ``start`` tokens (another owner was faster) nothing is inserted and the caller
            keeps its slots.
        """
        if slots.numel() != len(tokens) - start:
            raise ValueError(f"{slots.numel()} slots for {len(tokens) - start} tokens")
        self._root(ns, create=True)
        matched, deepest = self.match(ns, tokens, split=True)
        if matched != start or matched == len(tokens):
            return matched, None
        parent = deepest if deepest is not None else self.roots[ns]
        node = SharedNode(
            as_token_array(tokens)[start:].copy(), slots.to(torch.int64).clone(), owner,
            owner_start, anchor, parent=parent,
            head_mass=None if head_mass is None else head_mass.float().clone(),
            segment_start=segment_start,
        )
        parent.children[node.first] = node
        self.version += 1
        if anchor is not None:
            self._by_anchor.setdefault(id(anchor), set()).add(node)
        else:
            self.owned_size += len(node)
        return matched, node

    def _split(self, node: SharedNode, n: int) -> SharedNode:
        """Split ``node`` after ``n`` tokens; returns the new first half (node keeps the tail)."""
        head = SharedNode(
            node.key[:n].copy(), node.slots[:n].clone(), node.owner, node.owner_start, node.anchor,
            parent=node.parent, lock_ref=node.lock_ref, last_access=node.last_access,
            segment_start=node.segment_start,
        )
        head.exact_leaves, node.exact_leaves = _split_leaves(node.exact_leaves, n)
        head.factors, node.factors = _split_leaves(node.factors, n)
        if node.head_mass is not None:
            head.head_mass, node.head_mass = node.head_mass[:n].clone(), node.head_mass[n:].clone()
        head.parent.children[head.first] = head
        node.key, node.slots = node.key[n:].copy(), node.slots[n:].clone()
        node.owner_start += n
        node.segment_start = False
        node.parent = head
        head.children = {node.first: node}
        if node.anchor is not None:
            self._by_anchor.setdefault(id(node.anchor), set()).add(head)
        return head

    # ----- locks -----

    def lock(self, node: SharedNode | None) -> list[object]:
        """Lock ``node`` and its ancestors; returns the distinct anchors on the path."""
        anchors: dict[int, object] = {}
        while node is not None and node.parent is not None:
            if not node.alive:
                raise RuntimeError("locking a shared node that was dropped")
            if node.lock_ref == 0:
                self.owned_locked_size += node.owned_tokens
            node.lock_ref += 1
            if node.anchor is not None:
                anchors[id(node.anchor)] = node.anchor
            node = node.parent
        return list(anchors.values())

    def unlock(self, node: SharedNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlocking a shared node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.owned_locked_size -= node.owned_tokens
            node = node.parent

    # ----- eviction -----

    def _remove_subtree(self, node: SharedNode) -> list[torch.Tensor]:
        freed = []
        stack = [node]
        self.version += 1
        while stack:
            n = stack.pop()
            if n.lock_ref:
                raise RuntimeError("dropping a shared node that a request still reads")
            stack.extend(n.children.values())
            n.alive = False
            for leaf in n.exact_leaves.values():
                self._forget_leaf(leaf)
                freed.append(leaf.slots)
            n.exact_leaves = {}
            n.factors = {}
            if n.owns_slots:
                self.owned_size -= len(n)
                freed.append(n.slots)
            else:
                group = self._by_anchor.get(id(n.anchor))
                if group is not None:
                    group.discard(n)
                    if not group:
                        del self._by_anchor[id(n.anchor)]
        if node.parent is not None and node.parent.children.get(node.first) is node:
            del node.parent.children[node.first]
        return freed

    def drop_anchor(self, anchor: object) -> int:
        """The radix node ``anchor`` is being evicted: drop every node it protects (and their
        subtrees, which can no longer be matched). Returns the number of owned slots freed."""
        nodes = list(self._by_anchor.pop(id(anchor), ()))
        freed = 0
        for n in nodes:
            if n.alive:
                for s in self._remove_subtree(n):
                    self._free(s)
                    freed += s.numel()
        return freed

    def evictable_owned_size(self) -> int:
        return self.owned_size - self.owned_locked_size

    def _evictable_leaves(self) -> Iterator[SharedNode]:
        return (n for n in self.nodes() if not n.children and n.lock_ref == 0)

    def evict(self, num_tokens: int) -> int:
        """Free ``num_tokens`` owned slots: least recently used first among unlocked exact
        leaves and unlocked tree leaves (anchored tree leaves free nothing but their exact
        leaves, and are removed on the way). Returns slots freed."""
        freed = 0
        while freed < num_tokens:
            candidates = [(leaf.last_access, 0, n, agent) for n in self._unlocked_nodes()
                          for agent, leaf in n.exact_leaves.items()]
            candidates += [(n.last_access, 1, n, None) for n in self._evictable_leaves()]
            if not candidates:
                break
            candidates.sort(key=lambda c: (c[0], c[1]))
            for _, _, node, agent in candidates:
                if not node.alive:
                    continue
                if agent is not None:
                    leaf = node.exact_leaves.pop(agent, None)
                    if leaf is None:
                        continue
                    self._forget_leaf(leaf)
                    slots = [leaf.slots]
                else:
                    slots = self._remove_subtree(node)
                for s in slots:
                    self._free(s)
                    freed += s.numel()
                if freed >= num_tokens:
                    break
        return freed

    def _unlocked_nodes(self) -> Iterator[SharedNode]:
        return (n for n in self.nodes() if n.lock_ref == 0)

    def _forget_leaf(self, leaf: PoolOverrides) -> None:
        """Take a dropped exact leaf's slots out of the sizes (the caller frees them)."""
        self.owned_size -= len(leaf)
        self.leaf_size -= len(leaf)

    # ----- exact leaves -----

    def add_overrides(
        self, node: SharedNode, agent: str, offsets: torch.Tensor, slots: torch.Tensor,
        reader_start: int, bytes_per_token: int = 0,
    ) -> torch.Tensor:
        """Adopt an agent's exact KV for some of ``node``'s tokens as its exact leaf.

        Args:
            offsets: [k] int64 node-local offsets, sorted and distinct.
            slots: [k] int64 pool slots of the agent's exact KV of those tokens.
            reader_start: the agent's position of the node's first token.
        Returns:
            [j] int64 slots the tree did not adopt (the node already holds those offsets for
            the agent, the agent read the node at another position, or the node is gone); the
            caller still owns them.
        """
        if not node.alive or node.parent is None:
            return slots
        leaf = node.exact_leaves.get(agent)
        if leaf is None:
            leaf = PoolOverrides(torch.empty(0, dtype=torch.int64),
                                 torch.empty(0, dtype=torch.int64), reader_start, bytes_per_token)
        elif leaf.reader_start != reader_start:
            return slots
        merged, rejected = leaf.merged(offsets.to(torch.int64), slots.to(torch.int64))
        merged.last_access = time.monotonic()
        adopted = len(merged) - len(leaf)
        node.exact_leaves[agent] = merged
        self.owned_size += adopted
        self.leaf_size += adopted
        if node.lock_ref:
            self.owned_locked_size += adopted
        return rejected

    def add_factors(self, node: SharedNode, agent: str, offsets: torch.Tensor, factors,
                    reader_start: int) -> int:
        """Keep an agent's factored tokens of ``node`` (``tree/factored_leaves.py``).

        Args:
            offsets: [k] int64 node-local offsets, sorted and distinct.
            factors: their ``attention.deviation_factors.TokenFactors``.
            reader_start: the agent's position of the node's first token.
        Returns:
            tokens kept (0: the node is gone, the agent read it at another position, or its
            leaf already holds them).
        """
        if not node.alive or node.parent is None:
            return 0
        leaf = node.factors.get(agent) or FactorLeaf(reader_start)
        if leaf.reader_start != reader_start:
            return 0
        leaf, added = leaf.with_part(offsets.to(torch.int64), factors)
        leaf.last_access = time.monotonic()
        node.factors[agent] = leaf
        if added:
            self.version += 1  # cached walks of this node miss the new tokens
        return added

    def exact_leaf_tokens(self) -> int:
        """Pool slots held by exact leaves (walked; :attr:`leaf_size` is the running count)."""
        return sum(n.exact_leaf_tokens for n in self.nodes())

    def indexed_tokens(self) -> int:
        """Tokens the tree indexes: its one copy of every shared transcript (walked)."""
        return sum(len(n) for n in self.nodes())

    def trim_leaves(self, max_tokens: int, bytes_per_token: int = 0) -> int:
        """Free leaves until they hold at most ``max_tokens`` tokens of KV: least recently used
        first, whole leaves; exact leaves only on nodes no request holds (a locked node's leaves
        are being read and stay, so the bound may be exceeded while they are). With
        ``bytes_per_token``, factored leaves count too (their bytes in tokens of KV, rounded up)
        and go in the same order (on unlocked nodes only, as exact leaves). Only leaves go, never
        the shared nodes: a reader that loses its leaf recomputes or re-positions those tokens on
        its next turn. Returns the tokens of KV freed (pool slots and factored bytes alike)."""
        factored = ([(n, agent, leaf) for n in self.nodes() for agent, leaf in n.factors.items()]
                    if bytes_per_token > 0 else [])

        def tokens_of(leaf) -> int:
            return -(-leaf.nbytes() // bytes_per_token)

        held = self.leaf_size + sum(tokens_of(leaf) for _, _, leaf in factored)
        excess = held - max(0, max_tokens)
        if excess <= 0:
            return 0
        candidates = sorted([(leaf.last_access, 0, n, agent, leaf) for n in self._unlocked_nodes()
                             for agent, leaf in n.exact_leaves.items()]
                            + [(leaf.last_access, 1, n, agent, leaf) for n, agent, leaf
                               in factored if n.lock_ref == 0],
                            key=lambda c: c[:2])
        freed = dropped = 0
        for _, kind, where, agent, leaf in candidates:
            if freed >= excess:
                break
            if kind == 1:  # a factored leaf: host memory
                where.factors.pop(agent)
                freed += tokens_of(leaf)
            else:
                where.exact_leaves.pop(agent)
                self._forget_leaf(leaf)
                self._free(leaf.slots)
                freed += len(leaf)
            dropped += 1
        if dropped:
            self.version += 1  # cached reads of the dropped leaves are stale
        return freed

    # ----- introspection -----

    def nodes(self) -> Iterator[SharedNode]:
        for root in self.roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                yield n

    def exact_leaf_nbytes(self) -> int:
        return sum(int(leaf.nbytes()) for n in self.nodes() for leaf in n.exact_leaves.values())

    def leaf_bytes_by_agent(self) -> dict[str, dict[str, int]]:
        """agent -> bytes of its leaves by type (``exact``: pool slots of its exact leaves;
        ``factored``: its factored leaves)."""
        out: dict[str, dict[str, int]] = {}
        for n in self.nodes():
            for kind, leaves in (("exact", n.exact_leaves), ("factored", n.factors)):
                for agent, leaf in leaves.items():
                    out.setdefault(agent, {"exact": 0, "factored": 0})[kind] += int(leaf.nbytes())
        return out

    def check_invariants(self) -> list[str]:
        """Bookkeeping drift, as messages (empty: consistent). Walks the whole tree: for debug
        readback and tests, not for the scheduler's hot path."""
        problems: list[str] = []
        owned = locked = 0
        slots: list[torch.Tensor] = []
        for n in self.nodes():
            if not n.alive:
                problems.append(f"dropped node still linked ({len(n)} tokens)")
            if n.parent is None or n.parent.children.get(n.first) is not n:
                problems.append("node not reachable from its parent")
            if n.lock_ref < 0 or (n.parent is not None and n.parent.parent is not None
                                  and n.parent.lock_ref < n.lock_ref):
                problems.append(f"lock_ref {n.lock_ref} above its parent's or negative")
            owned += n.owned_tokens
            locked += n.owned_tokens if n.lock_ref else 0
            if n.owns_slots:
                slots.append(n.slots)
            slots += [leaf.slots for leaf in n.exact_leaves.values()]
            for leaf in n.factors.values():
                at = leaf.offsets()
                if at.numel() and (int(at.min()) < 0 or int(at.max()) >= len(n)
                                   or torch.unique(at).numel() != at.numel()):
                    problems.append("a factored leaf holds an offset twice or off its node")
        if owned != self.owned_size:
            problems.append(f"owned_size {self.owned_size} but nodes own {owned}")
        leaves = self.exact_leaf_tokens()
        if leaves != self.leaf_size:
            problems.append(f"leaf_size {self.leaf_size} but leaves hold {leaves}")
        if locked != self.owned_locked_size:
            problems.append(f"owned_locked_size {self.owned_locked_size} but locked nodes own "
                            f"{locked}")
        if slots:
            flat = torch.cat(slots)
            if torch.unique(flat).numel() != flat.numel():
                problems.append("a pool slot is owned twice")
        for group in self._by_anchor.values():
            if any(not n.alive for n in group):
                problems.append("an anchor lists a dropped node")
        return problems


def _split_leaves(leaves: dict, n: int) -> tuple[dict, dict]:
    """A node's leaves (agent -> leaf) split after its first ``n`` tokens, empty halves dropped."""
    halves = {agent: leaf.split(n) for agent, leaf in leaves.items()}
    return ({a: h for a, (h, _) in halves.items() if len(h)},
            {a: t for a, (_, t) in halves.items() if len(t)})
