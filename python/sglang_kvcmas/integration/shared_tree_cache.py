"""``KvcmasSharedTreeCache``: SGLang's radix cache plus the agent-aware shared-context tree.

A request is split (``agent_split``) into agent head + shared context + suffix. Its prefix is the
exact radix match of its own tokens (head, and any of the transcript it computed itself),
continued by the shared tree's match of the rest of the shared context by tokens alone::

    reader row (req_to_token[req_pool_idx])
    index  0 ........ h ........ m_r ............... h+L-r .......... h+L ............ n
           | own head | own exact | borrowed shared span | recomputed | own new tokens |
           |<-- radix path slots ->|<- shared slots -->|<------- allocated -------->|
           |       reused exact    |  reused corrected |        recomputed          |
                                    owner position = reader position - shift
    prefix_len = h + L - r                 (SGLang extends from here)
    cache_protected_len = h + L - r        (release never frees borrowed slots)

The ``r`` recomputed tokens are borrowed shared tokens the reader computes in its own context
(``policy/recompute.py``: span boundaries and the owner's largest head-mass tokens); they sit
after the borrowed slots in the row and the attention backend gives them their true positions
(``span_registry.RecomputedTokens``). After the prefill they become the reader's delta leaves on
the shared nodes (exact overrides in the pool) and the protected length moves to ``h + L``.
Tokens a leaf already holds are read from it (exact, no shift) and not recomputed.

``req.last_node`` is then a :class:`SharedPrefixHandle` (radix node + deepest shared node);
``lock``/``unlock``/``prefix_device_indices``/``resolve_node_handle`` understand it. When the row
is allocated (``maybe_hand_to_session``) the shifts of the borrowed spans are published to the
attention backend through ``span_registry.SPANS[req_pool_idx]``; SGLang gives the reader's tokens
their own positions, and the backend rotates the owner's keys by each span's shift.

Writing (``checkpoint``): an exact request (no borrowed span) is inserted into the radix tree as
SGLang does, and its not-yet-shared transcript tokens are registered in the shared tree *anchored*
on its radix path (one copy: the shared node points at the owner's slots). A reader registers the
transcript tokens it computed after its borrowed span as an *owned* shared node and moves
``cache_protected_len`` past them, so release frees only its suffix and output.

Locks and eviction: a reader locks its radix head path, its shared path (``lock_ref``) and every
radix anchor on that path, so nothing it reads can be evicted or dropped. Evicting a radix node
drops the shared nodes anchored on it; unlocked owned shared leaves are evicted when the radix
tree alone cannot free enough. ``evictable_size``/``protected_size`` include owned shared slots,
so SGLang's pool invariant (available + evictable + protected + uncached == total) holds.

With ``KVCMAS_SHARE_CONTEXT`` off every method is the parent's: identical to ``RadixCache``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_kvcmas import envs
from sglang_kvcmas.attention.batch import SharedSpan
from sglang_kvcmas.integration import reuse_accounting
from sglang_kvcmas.integration.agent_split import AgentSplit, ChatTemplateIds, split_request
from sglang_kvcmas.integration.delta_attention_backend import BACKEND_NAME as DELTA_BACKEND_NAME
from sglang_kvcmas.integration.radix_cache_backend import KvcmasRadixCache
from sglang_kvcmas.integration.shared_tree import SharedNode, SharedTree
from sglang_kvcmas.integration.span_registry import (
    PROBES,
    SPANS,
    HeadMassProbe,
    RecomputedTokens,
    RowSpans,
    SpanRead,
)
from sglang_kvcmas.policy.recompute import (
    BorrowedSpan,
    RecomputeConfig,
    borrow_pays,
    boundary_offsets,
    kept_offsets,
    mass_offsets,
    tail_offsets,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

BOUNDARY_FIELD = "kvcmas_boundary_tokens"
"""``custom_params`` key of ``/generate`` that sets one request's recomputed boundary tokens."""
MASS_FIELD = "kvcmas_mass_fraction"
"""``custom_params`` key of ``/generate`` that sets one request's head-mass recompute share."""
TAIL_FIELD = "kvcmas_tail_tokens"
"""``custom_params`` key of ``/generate`` that sets one request's recomputed tail tokens."""
EXACT_FIELD = "kvcmas_exact"
"""``custom_params`` key of ``/generate``: true makes the request read no other agent's KV (it
computes its context exactly, as under SGLang's radix cache, and may own new shared segments)."""


@dataclass(eq=False)
class SharedPrefixHandle:
    """``req.last_node`` of a request whose prefix continues into borrowed shared KV.

    Attributes:
        radix_node: last node of the request's own exact radix match.
        radix_len: tokens of that match (>= the head length).
        shared_node: deepest shared-tree node of the borrowed part.
        shared_begin: shared offset where borrowing starts (= radix_len − head_len).
        shared_end: shared offset where it ends (path length of ``shared_node``).
        split: the request's head / shared / suffix split.
        namespace: ``(extra_key, cache_salt)``.
        recompute: shared offsets in ``[shared_begin, shared_end)`` the request recomputes in its
            own context instead of borrowing (left out of its prefix; see ``RecomputedTokens``).
        use_leaves: read the agent's delta leaves and keep what it recomputes as new ones (off
            for a request that sets its own boundary size: it measures the owner's KV alone).
        keep: the recomputed offsets kept as delta leaves (None: all; the others are freed with
            the request, ``RecomputeConfig.leaf_mass_fraction``).
    """

    radix_node: Any
    radix_len: int
    shared_node: SharedNode
    shared_begin: int
    shared_end: int
    split: AgentSplit
    namespace: tuple
    recompute: tuple[int, ...] = ()
    use_leaves: bool = True
    keep: tuple[int, ...] | None = None

    @property
    def prefix_len(self) -> int:
        return self.split.head_len + self.shared_end - len(self.recompute)

    @property
    def borrowed_len(self) -> int:
        return self.shared_end - self.shared_begin


@dataclass(frozen=True)
class _Piece:
    """A run of the borrowed shared path with one owner and one shift (shared offsets)."""

    begin: int
    end: int
    shift: int
    owner: str
    foreign: bool


@dataclass(frozen=True)
class _Token:
    """One borrowed token: shared offset, pool slot, key shift, whether it is read from another
    context, whether the slot is the reader agent's own (a delta leaf)."""

    offset: int
    slot: int
    shift: int
    foreign: bool
    from_leaf: bool
    mass: float = 0.0


@dataclass
class _SharedReceipt:
    radix_lock: TreeLock | None
    anchor_locks: list[TreeLock]


@dataclass(frozen=True)
class PendingOwner:
    """An admitted agent request that will register new shared tokens at its checkpoint."""

    rid: str
    namespace: tuple
    shared: tuple[int, ...]
    since: float


def _optional_fraction(text: str | None) -> float | None:
    """An environment fraction where empty means unset."""
    return None if text is None or not str(text).strip() else float(text)


def _namespace(extra_key: Any, cache_salt: Any) -> tuple:
    return (extra_key, cache_salt or None)


class KvcmasSharedTreeCache(KvcmasRadixCache):
    """Radix cache + shared-context tree (see module docstring)."""

    def __init__(
        self,
        params: CacheInitParams,
        chat_ids: ChatTemplateIds | None = None,
        share_context: bool | None = None,
    ):
        self.shared = SharedTree(self._free_slots)
        self._chat_ids = chat_ids
        self.share_context = (
            envs.KVCMAS_SHARE_CONTEXT.get_bool() if share_context is None else share_context
        )
        self.cache_agent_outputs = envs.KVCMAS_CACHE_AGENT_OUTPUTS.get_bool()
        self.recompute_config = RecomputeConfig(
            boundary_tokens=int(envs.KVCMAS_RECOMPUTE_BOUNDARY.get()),
            mass_fraction=float(envs.KVCMAS_RECOMPUTE_MASS_FRACTION.get()),
            max_fraction=float(envs.KVCMAS_RECOMPUTE_MAX_FRACTION.get()),
            min_borrowed=int(envs.KVCMAS_MIN_BORROWED.get()),
            tail_tokens=int(envs.KVCMAS_RECOMPUTE_TAIL.get()),
            leaf_mass_fraction=_optional_fraction(envs.KVCMAS_LEAF_MASS_FRACTION.get()),
        )
        self._chunk_limit: int | None = None
        self._splits: dict[str, AgentSplit | None] = {}
        self.pending_owners: dict[str, PendingOwner] = {}
        self._extra_freed = 0
        super().__init__(params)

    # ----- helpers -----

    def _free_slots(self, slots: torch.Tensor) -> None:
        if self.token_to_kv_pool_allocator is not None and slots.numel():
            self.token_to_kv_pool_allocator.free(slots.to(self.device))

    @property
    def chat_ids(self) -> ChatTemplateIds | None:
        """ChatML delimiter ids, read from the served tokenizer on first use."""
        if self._chat_ids is None:
            try:
                from sglang.srt.runtime_context import get_server_args

                args = get_server_args()
                path = getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None)
            except Exception:  # no server context (unit tests): no ChatML detection
                path = None
            self._chat_ids = chat_ids_for(path) or False
        return self._chat_ids or None

    @property
    def chunk_limit(self) -> int:
        """SGLang's chunked-prefill size (0: no chunking). A row whose extend would be chunked
        never recomputes borrowed tokens: each chunk re-matches its prefix."""
        if self._chunk_limit is None:
            try:
                from sglang.srt.runtime_context import get_server_args

                size = getattr(get_server_args(), "chunked_prefill_size", None)
            except Exception:  # no server context (unit tests)
                size = None
            self._chunk_limit = int(size) if size and size > 0 else 0
        return self._chunk_limit

    @property
    def head_preamble(self) -> int:
        """Leading head tokens every agent shares (``<|im_start|>system\n`` for ChatML, else the
        first token): their KV is the same for all agents, so mass on them is not a signal."""
        return 3 if self.chat_ids is not None else 1

    def split_of(self, req: Req) -> AgentSplit | None:
        """The request's agent split (memoized per rid); None: not an agent request."""
        if req.rid not in self._splits:
            custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
            try:
                self._splits[req.rid] = split_request(req.origin_input_ids, custom, self.chat_ids)
            except ValueError as e:
                logger.warning("sglang-kvcmas: request %s: %s; served without sharing", req.rid, e)
                self._splits[req.rid] = None
        return self._splits[req.rid]

    def radix_peek(self, req: Req, n: int) -> int:
        """How many of the request's first ``n`` tokens the radix tree holds: its own exact
        prefix (a peek: nothing is split, locked or touched)."""
        key = RadixKey(req.origin_input_ids[:n], req.extra_key, cache_salt=req.cache_salt)
        node, pos = self.root_node, 0
        while pos < len(key):
            child = node.children.get(key.child_key_at(pos))
            if child is None or child.evicted:
                return pos
            m = child.key.match_at(key, pos)
            if m < len(child.key):
                return pos + m
            pos, node = pos + m, child
        return pos

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "shared"):
            self.shared.reset()
            self.pending_owners.clear()
            SPANS.reset()
            PROBES.reset()

    # ----- match -----

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if not self.share_context or self.disable or req is None or self.page_size != 1:
            return base
        split = self.split_of(req)
        if split is None or base.device_prefix_len < split.head_len or self.wants_exact(req):
            return base  # unknown agent head, or asked to: compute it (and be an exact owner)
        key = params.key
        limit = min(len(key), split.shared_end)
        shared_tokens = key.token_ids[split.head_len : limit]
        ns = _namespace(key.extra_key, key.cache_salt)
        matched, node = self.shared.match(ns, shared_tokens, split=True)
        begin = base.device_prefix_len - split.head_len
        if node is None or matched <= begin:
            return base
        handle = SharedPrefixHandle(
            base.last_device_node, base.device_prefix_len, node, begin, matched, split, ns
        )
        own_knobs = self._request_recompute(req)
        pieces = self._pieces(handle)
        foreign = sum(p.end - p.begin for p in pieces if p.foreign)
        if not own_knobs and not borrow_pays(foreign, self.recompute_config):
            return base  # too little to borrow: compute it exactly
        handle = replace(handle, use_leaves=not own_knobs)
        config = replace(self.recompute_config, **own_knobs)
        recompute, keep = self._recompute_for(req, handle, config, pieces)
        handle = replace(handle, recompute=recompute, keep=keep)
        return base._replace(device_prefix_len=handle.prefix_len, last_device_node=handle)

    @staticmethod
    def wants_exact(req: Req) -> bool:
        """Whether the request asked to read no other agent's KV (``custom_params``)."""
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        return isinstance(custom, dict) and custom.get(EXACT_FIELD) is True

    @staticmethod
    def _request_recompute(req: Req) -> dict[str, float]:
        """The request's own recompute knobs (``custom_params`` on ``/generate``:
        ``kvcmas_boundary_tokens``, ``kvcmas_mass_fraction``, ``kvcmas_tail_tokens``) as
        ``RecomputeConfig`` fields; bad values are ignored."""
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
        out: dict[str, float] = {}
        if not isinstance(custom, dict):
            return out
        for key, field_name, kind in ((BOUNDARY_FIELD, "boundary_tokens", int),
                                      (MASS_FIELD, "mass_fraction", float),
                                      (TAIL_FIELD, "tail_tokens", int)):
            if key not in custom:
                continue
            try:
                out[field_name] = kind(custom[key])
                replace(RecomputeConfig(), **{field_name: out[field_name]})  # validates
            except (TypeError, ValueError):
                out.pop(field_name, None)
                logger.warning("sglang-kvcmas: request %s: bad %s=%r; deployment default used",
                               req.rid, key, custom[key])
        return out

    def _recompute_for(self, req: Req, handle: SharedPrefixHandle, config: RecomputeConfig,
                       pieces: list[_Piece]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Borrowed offsets this request recomputes under ``config`` (``policy/recompute.py``;
        ``pieces = _pieces(handle)``), or none when the extend could be chunked or the request
        asks for logprobs of prompt tokens whose computation order changes; and the subset it
        keeps as delta leaves afterwards (None: all of them)."""
        spans = [BorrowedSpan(p.begin, p.end, p.foreign) for p in pieces]
        tokens = self._borrowed(handle)
        exact = {t.offset for t in tokens if not t.foreign}
        deviating = [t for t in tokens if t.foreign or t.from_leaf]

        def select(cfg: RecomputeConfig) -> tuple[int, ...]:
            budget = int(cfg.max_fraction * len(tokens))
            picked = dict.fromkeys([*boundary_offsets(spans, cfg), *tail_offsets(spans, cfg)])
            # boundary first, then tail, within the budget
            offsets = tuple(sorted([o for o in picked if o not in exact][:budget]))
            return mass_offsets([t.offset for t in deviating], [t.mass for t in deviating],
                                exact, offsets, len(tokens), cfg)

        offsets = select(config)
        if not offsets:
            return (), None
        extend = len(req.full_untruncated_fill_ids) - handle.prefix_len
        if self.chunk_limit and extend + len(offsets) > self.chunk_limit:
            return (), None
        start = getattr(req, "logprob_start_len", -1)
        if getattr(req, "return_logprob", False) and 0 <= start <= handle.prefix_len:
            return (), None
        if config.keeps_all:
            return offsets, None
        return offsets, kept_offsets(offsets, select(config.for_leaves()))

    @staticmethod
    def recomputes(req: Req) -> bool:
        """Whether the request's matched prefix leaves borrowed tokens for it to recompute."""
        handle = req.last_node
        return isinstance(handle, SharedPrefixHandle) and bool(handle.recompute)

    @staticmethod
    def drop_recompute(req: Req) -> None:
        """Read the tokens the request was to recompute borrowed instead (its extend will be
        chunked: ``admission_hook``), and move what SGLang took from the match along: the
        prefix, and its protected length, now end at the shared context's end."""
        handle: SharedPrefixHandle = req.last_node
        moved = len(handle.recompute)
        if req.kv.cache_protected_len == req.prefix_len:
            req.kv.cache_protected_len += moved
        req.last_node = replace(handle, recompute=(), keep=None)
        req.prefix_len += moved
        req.num_matched_prefix_tokens += moved

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        handle = req.last_node
        if not isinstance(handle, SharedPrefixHandle):
            return super().prefix_device_indices(req)
        own = self.path_device_indices(handle.radix_node)[: handle.radix_len]
        borrowed = torch.tensor([t.slot for t in self._borrowed(handle)], dtype=torch.int64)
        out = torch.cat([own.to(torch.int64), borrowed.to(own.device)])
        return out[: req.prefix_len]

    def resolve_node_handle(self, node_handle: Any) -> Any:
        if isinstance(node_handle, SharedPrefixHandle):
            return node_handle.radix_node
        return super().resolve_node_handle(node_handle)

    # ----- locks -----

    def lock(self, node: Any) -> TreeLock | None:
        if not isinstance(node, SharedPrefixHandle):
            return super().lock(node)
        radix_lock = super().lock(node.radix_node)
        anchors = self.shared.lock(node.shared_node)
        now = time.monotonic()
        anchor_locks = []
        for anchor in anchors:
            anchor.last_access_time = now  # readers keep the owner's path warm
            anchor_locks.append(super().lock(anchor))
        return TreeLock(node, _SharedReceipt(radix_lock, anchor_locks))

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is None or not isinstance(lock.node, SharedPrefixHandle):
            return super().unlock(lock)
        receipt: _SharedReceipt = lock.receipt
        self.shared.unlock(lock.node.shared_node)
        for anchor_lock in receipt.anchor_locks:
            super().unlock(anchor_lock)
        super().unlock(receipt.radix_lock)

    # ----- allocation hand-off: spans for the attention backend, accounting -----

    def maybe_hand_to_session(self, req: Req) -> None:
        super().maybe_hand_to_session(req)
        if not self.share_context:
            return
        split = self.split_of(req)
        handle = req.last_node if isinstance(req.last_node, SharedPrefixHandle) else None
        prompt = len(req.origin_input_ids)
        correction = "none"
        if handle is not None:
            tokens = self._borrowed(handle)
            row, corrected = self._row_spans(req, handle, tokens)
            SPANS.set(req.kv.req_pool_idx, row)
            exact = req.prefix_len - corrected
            correction = self._correction_label(handle, tokens)
        else:
            exact, corrected = req.prefix_len, 0
        if getattr(req, "_kvcmas_accounted", False) is False:
            reuse_accounting.attach(
                req,
                reuse_accounting.ReuseRecord(
                    split.agent if split else None, prompt, exact, corrected,
                    prompt - exact - corrected, correction,
                ),
            )
            req._kvcmas_accounted = True
        covered = split.head_len + handle.shared_end if handle is not None else req.prefix_len
        if split is not None and covered < split.shared_end:
            PROBES.set(req.kv.req_pool_idx, HeadMassProbe.for_row(
                min(self.head_preamble, split.head_len), split.head_len, split.shared_end))
            ns = _namespace(req.extra_key, req.cache_salt)
            shared = tuple(int(t) for t in req.origin_input_ids[split.head_len : split.shared_end])
            self.pending_owners[req.rid] = PendingOwner(req.rid, ns, shared, time.monotonic())

    @staticmethod
    def _correction_label(handle: SharedPrefixHandle, tokens: list[_Token]) -> str:
        """How the request's borrowed tokens (``_borrowed(handle)``) were corrected, for its
        reuse record."""
        from_leaves = sum(t.from_leaf for t in tokens)
        parts = [f"boundary_recompute:{len(handle.recompute)}"] if handle.recompute else []
        if from_leaves:
            parts.append(f"delta_leaf:{from_leaves}")
        return "+".join(parts) or "none"

    @staticmethod
    def _pieces(handle: SharedPrefixHandle) -> list[_Piece]:
        """The borrowed part of a handle's shared path as runs of one owner and one shift."""
        out: list[_Piece] = []
        head = handle.split.head_len
        for piece in SharedTree.path(handle.shared_node):
            lo = max(piece.offset, handle.shared_begin)
            hi = piece.offset + len(piece.node)
            if hi <= lo:
                continue
            shift = head + lo - (piece.node.owner_start + lo - piece.offset)
            owner = piece.node.owner
            if out and out[-1].end == lo and (out[-1].shift, out[-1].owner) == (shift, owner):
                out[-1] = replace(out[-1], end=hi)
            else:
                foreign = owner != handle.split.agent or shift != 0
                out.append(_Piece(lo, hi, shift, owner, foreign))
        return out

    @staticmethod
    def _borrowed(handle: SharedPrefixHandle) -> list[_Token]:
        """Every borrowed token in shared order, recomputed ones left out: the owner's slot read
        re-positioned, or the reader agent's own exact slot where its delta leaf holds one."""
        head, agent, skip = handle.split.head_len, handle.split.agent, set(handle.recompute)
        use_leaves = handle.use_leaves
        out: list[_Token] = []
        for piece in SharedTree.path(handle.shared_node):
            node = piece.node
            lo = max(piece.offset, handle.shared_begin)
            hi = piece.offset + len(node)
            if hi <= lo:
                continue
            shift = head + piece.offset - node.owner_start
            foreign = node.owner != agent or shift != 0
            leaf = node.deltas.get(agent) if use_leaves else None
            own = leaf.lookup() if leaf is not None and leaf.reader_start == (
                head + piece.offset) else {}
            slots, mass = node.slots.tolist(), node.mass().tolist()
            for offset in range(lo, hi):
                if offset in skip:
                    continue
                i = offset - piece.offset
                if i in own:
                    out.append(_Token(offset, own[i], 0, False, True, mass[i]))
                else:
                    out.append(_Token(offset, slots[i], shift, foreign, False, mass[i]))
        return out

    @staticmethod
    def _row_spans(req: Req, handle: SharedPrefixHandle,
                   tokens: list[_Token]) -> tuple[RowSpans, int]:
        """The row's borrowed spans in row coordinates from ``tokens = _borrowed(handle)``
        (recomputed tokens left out), the recomputed tokens with their true positions; and how
        many borrowed tokens are read from another context (what the accounting calls corrected
        reuse)."""
        head = handle.split.head_len
        spans: list[list[int]] = []  # [row start, length, shift]
        positions = list(range(handle.radix_len))
        foreign = 0
        for tok in tokens:
            row = len(positions)
            positions.append(head + tok.offset)
            foreign += tok.foreign
            if spans and spans[-1][0] + spans[-1][1] == row and spans[-1][2] == tok.shift:
                spans[-1][1] += 1
            else:
                spans.append([row, 1, tok.shift])
        reads = tuple(SpanRead(SharedSpan(s, n, d)) for s, n, d in spans if d != 0)
        if not handle.recompute:
            return RowSpans(req.rid, reads), foreign
        moved = tuple(head + o for o in handle.recompute)
        recomputed = RecomputedTokens(
            len(positions), tuple(int(req.origin_input_ids[p]) for p in moved), moved
        )
        positions.extend(moved)
        return RowSpans(req.rid, reads, recomputed, torch.tensor(positions)), foreign

    # ----- checkpoint / release -----

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        if not self.share_context or self.disable:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        split = self.split_of(req)
        if isinstance(req.last_node, SharedPrefixHandle):
            self._adopt_recomputed(req, req.last_node, up_to)
            self._register_borrowed(req, req.last_node, up_to)
        else:
            if split is not None and req.finished() and not self.cache_agent_outputs:
                # Outputs re-enter through the shared transcript; keep only the prompt.
                up_to = max(min(up_to, len(req.origin_input_ids)), req.kv.cache_protected_len)
            super().checkpoint(req, up_to=up_to, **kwargs)
            if split is not None:
                self._register_exact(req, split, up_to)
        if split is None or req.finished() or up_to >= split.shared_end:
            # A chunked owner stays pending until its last chunk: its readers wait for all of
            # the segment rather than start on the part its first chunks published.
            self.pending_owners.pop(req.rid, None)

    def _register_exact(self, req: Req, split: AgentSplit, up_to: int) -> None:
        """Share the transcript tokens an exact request computed, anchored on its radix path."""
        end = min(split.shared_end, up_to)
        if end <= split.head_len:
            return
        ids = req.full_untruncated_fill_ids
        tokens = ids[split.head_len : end]
        ns = _namespace(req.extra_key, req.cache_salt)
        known, _ = self.shared.match(ns, tokens, split=False)
        if known >= len(tokens):
            return
        found = super().match_prefix(
            MatchPrefixParams(RadixKey(ids[:end], req.extra_key, cache_salt=req.cache_salt))
        )
        if found.device_prefix_len != end:
            return  # the radix path is shorter than the transcript (e.g. evicted): skip
        anchor = found.last_device_node
        slots = self.path_device_indices(anchor)[split.head_len + known : end]
        self.shared.insert(
            ns, tokens, known, slots.cpu(), split.agent, split.head_len + known, anchor=anchor,
            head_mass=self._recorded_mass(req, split.head_len + known, end),
        )

    def _adopt_recomputed(self, req: Req, handle: SharedPrefixHandle, up_to: int) -> None:
        """Keep the tokens a reader recomputed (``handle.keep`` of them) as its delta leaves on
        the shared nodes (its later turns read them exactly, without recomputing); the row's
        protected prefix then covers them, and the other recomputed slots and those a leaf
        already held are freed at release."""
        head = handle.split.head_len
        start = head + handle.shared_end
        if not handle.recompute or up_to < start or req.kv.cache_protected_len != handle.prefix_len:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = dict(zip(handle.recompute,
                         row[handle.prefix_len : start].to(torch.int64).cpu().tolist()))
        kept = (set() if not handle.use_leaves
                else set(handle.recompute if handle.keep is None else handle.keep))
        transient = [slots[o] for o in handle.recompute if o not in kept]
        rejected = [torch.tensor(transient, dtype=torch.int64)] if transient else []
        for piece in SharedTree.path(handle.shared_node) if kept else ():
            mine = [o for o in handle.recompute
                    if o in kept and piece.offset <= o < piece.offset + len(piece.node)]
            if mine:
                rejected.append(self.shared.add_overrides(
                    piece.node, handle.split.agent, torch.tensor(mine) - piece.offset,
                    torch.tensor([slots[o] for o in mine]), head + piece.offset,
                    self.kv_bytes_per_token,
                ))
        left = torch.cat(rejected) if rejected else torch.empty(0, dtype=torch.int64)
        if left.numel():
            req._kvcmas_release_slots = left
        req.last_node = replace(handle, recompute=(), keep=None)
        req.kv.cache_protected_len = start

    @staticmethod
    def _recorded_mass(req: Req, start: int, end: int) -> torch.Tensor | None:
        """[end - start] head mass the backend recorded for the request's row indices
        ``start .. end - 1`` (rows after any recomputed ones: row index = position), or None."""
        kv = getattr(req, "kv", None)
        probe = PROBES.get(kv.req_pool_idx) if kv is not None and kv.req_pool_idx is not None \
            else None
        return None if probe is None else probe.mean(start, end)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one pool slot holds (all layers, K and V); 0 when there is no pool."""
        if getattr(self, "_kv_bytes", None) is None:
            try:
                pool = self.token_to_kv_pool_allocator.get_kvcache()
                size = torch.empty(0, dtype=pool.dtype).element_size()
                self._kv_bytes = int(2 * pool.layer_num * pool.head_num * pool.head_dim * size)
            except Exception:  # simulated caches in unit tests have no KV pool
                self._kv_bytes = 0
        return self._kv_bytes

    def _register_borrowed(self, req: Req, handle: SharedPrefixHandle, up_to: int) -> None:
        """Share the transcript tokens a reader computed after its borrowed span (owned)."""
        split = handle.split
        end = min(split.shared_end, up_to)
        start = split.head_len + handle.shared_end
        if end <= start or req.kv.cache_protected_len != handle.prefix_len:
            return
        tokens = req.full_untruncated_fill_ids[split.head_len : end]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[start:end].to(torch.int64).cpu()
        _, node = self.shared.insert(
            handle.namespace, tokens, handle.shared_end, slots, split.agent, start, anchor=None,
            head_mass=self._recorded_mass(req, start, end),
        )
        if node is None:
            return  # another request registered these tokens first: ours are freed at release
        new_handle = replace(handle, shared_node=node, shared_end=end - split.head_len,
                             recompute=())
        new_lock = self.lock(new_handle)
        self.unlock(req.lock)
        req.lock, req.last_node = new_lock, new_handle
        req.kv.cache_protected_len = end

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        PROBES.clear(getattr(req.kv, "req_pool_idx", None))
        slots = getattr(req, "_kvcmas_release_slots", None)
        if slots is not None:
            self._free_slots(slots)
            req._kvcmas_release_slots = None
        SPANS.clear(getattr(req.kv, "req_pool_idx", None))
        self.pending_owners.pop(req.rid, None)
        self._splits.pop(req.rid, None)

    # ----- eviction and sizes -----

    def _delete_leaf(self, node: Any) -> None:
        super()._delete_leaf(node)
        if hasattr(self, "shared"):
            self._extra_freed += self.shared.drop_anchor(node)

    def evict(self, params: EvictParams) -> EvictResult:
        self._extra_freed = 0
        result = super().evict(params)
        freed = result.num_tokens_evicted + self._extra_freed
        if freed < params.num_tokens and not self.disable:
            freed += self.shared.evict(params.num_tokens - freed)
        self._extra_freed = 0
        return EvictResult(num_tokens_evicted=freed)

    def evictable_size(self) -> int:
        return super().evictable_size() + self.shared.evictable_owned_size()

    def protected_size(self) -> int:
        return super().protected_size() + self.shared.owned_locked_size

    def total_size(self) -> int:
        return super().total_size() + self.shared.owned_size

    def shared_stats(self) -> dict[str, int]:
        """Sizes for ``/server_info`` and tests."""
        nodes = list(self.shared.nodes())
        return {
            "shared_nodes": len(nodes),
            "shared_tokens": sum(len(n) for n in nodes),
            "shared_owned_tokens": self.shared.owned_size,
            "delta_tokens": self.shared.delta_tokens(),
            "delta_bytes": self.shared.delta_nbytes(),
        }


def chat_ids_for(tokenizer_path: str | None) -> ChatTemplateIds | None:
    """ChatML delimiter ids of a tokenizer, or None when it has no ChatML tokens."""
    if not tokenizer_path:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    system = tok.encode("system", add_special_tokens=False)
    if any(i is None or i == tok.unk_token_id for i in ids) or len(system) != 1:
        return None
    return ChatTemplateIds(ids[0], ids[1], system[0])


def build_shared_tree_cache(ctx: TreeCacheBuildContext) -> KvcmasSharedTreeCache:
    """Factory registered as radix cache backend ``kvcmas``: SGLang calls it once per scheduler.

    Raises:
        ValueError: for model or cache features the Python radix tree does not implement
            (SGLang's default backend handles those, so the message says to drop
            ``--radix-cache-backend``); with sharing on, for page size > 1 or an attention
            backend that would read borrowed KV without re-positioning it.
    """
    share = envs.KVCMAS_SHARE_CONTEXT.get_bool()
    unsupported = [
        name
        for name, on in (
            ("hybrid sliding-window attention", ctx.is_hybrid_swa),
            ("hybrid state-space (mamba) layers", ctx.is_hybrid_ssm),
            ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
            ("DSA sparse attention", ctx.is_dsa),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"--radix-cache-backend {KvcmasRadixCache.backend_name} does not support "
            f"{', '.join(unsupported)} yet; run without --radix-cache-backend to use SGLang's "
            "default tree cache."
        )
    args = getattr(ctx, "server_args", None)
    if share:
        if ctx.params.page_size != 1:
            raise ValueError("--kvcmas-share-context needs --page-size 1")
        backends = {getattr(args, f, None) for f in ("attention_backend",
                                                     "prefill_attention_backend",
                                                     "decode_attention_backend")} - {None}
        if args is not None and backends != {DELTA_BACKEND_NAME}:
            raise ValueError(
                f"--kvcmas-share-context reads other agents' KV re-positioned, which only the "
                f"{DELTA_BACKEND_NAME!r} attention backend does; got {sorted(backends)}"
            )
    chat = chat_ids_for(getattr(args, "tokenizer_path", None) or getattr(args, "model_path", None))
    cache = KvcmasSharedTreeCache(ctx.params, chat_ids=chat, share_context=share)
    cls = type(cache)
    logger.info(
        "sglang-kvcmas: tree cache %s.%s in use (radix cache backend %r, page_size=%d, "
        "disabled=%s, tp_rank=%d, share_context=%s, chatml=%s, boundary_recompute=%d)",
        cls.__module__, cls.__qualname__, cls.backend_name, ctx.params.page_size,
        ctx.disable_radix_cache, ctx.tp_rank, share, chat is not None,
        cache.recompute_config.boundary_tokens,
    )
    return cache
