"""``KvcmasSharedTreeCache``: SGLang's radix cache plus the agent-aware shared-context tree.

A request is split (``agent_split``) into agent head + shared context + suffix. Its prefix is the
exact radix match of its own tokens (head, and any of the transcript it computed itself),
continued by the shared tree's match of the rest of the shared context by tokens alone::

    reader row (req_to_token[req_pool_idx])
    index  0 ........ h ........ m_r ............... h+L-r .......... h+L ............ n
           | own head | own exact | borrowed shared span | recomputed | own new tokens |
           |<-- radix path slots ->|<- shared slots -->|<------- allocated -------->|
           |       reused exact    | reused repositioned |      recomputed          |
                                    owner position = reader position - shift
    prefix_len = h + L - r                 (SGLang extends from here)
    cache_protected_len = h + L - r        (release never frees borrowed slots)

The ``r`` recomputed tokens are borrowed tokens the reader computes in its own context (which
ones: ``policy/recompute.py``); they sit after the borrowed slots in the row and the attention
backend gives them their true positions (``attention.spans.RecomputedTokens``). After the prefill
they become the reader's exact leaves on the shared nodes and the protected length moves to
``h + L``; under leaf mode ``factored`` they become factored leaves instead, and the row's ``r``
slots are pointed at the owners' slots and freed right after the prefill. Tokens a leaf already
holds are read from it (exact, no shift) and not recomputed.

``req.last_node`` is then a :class:`~sglang_kvcmas.tree.borrowed.SharedPrefixHandle` (it and the
walks over its path: ``tree/borrowed.py``), which ``lock``/``unlock``/``prefix_device_indices``/
``resolve_node_handle`` understand. When the row is allocated (``maybe_hand_to_session``) its
borrowed spans and head-mass probe go on the request (``req.kvcmas_row``), which every forward
batch carries to the attention backend (``batch_rows.py``).

Writing (``checkpoint``): an exact request (no borrowed span) is inserted into the radix tree as
SGLang does, and its not-yet-shared transcript tokens are registered in the shared tree *anchored*
on its radix path (one copy: the shared node points at the owner's slots). A reader registers the
transcript tokens it computed after its borrowed span as an *owned* shared node and moves
``cache_protected_len`` past them, so release frees only its suffix and output.

Locks and eviction: a reader locks its radix head path, its shared path (``lock_ref``) and every
radix anchor on that path, so nothing it reads can be evicted or dropped. Eviction (:meth:`evict`)
takes the shared tree's leaves and owned nodes before the radix LRU; evicting a radix node drops
the shared nodes anchored on it.
``evictable_size``/``protected_size`` include owned shared slots, so SGLang's pool invariant
(available + evictable + protected + uncached == total) holds.

With sharing off (``--kvcmas-share-context`` not given) every method is the parent's: identical to
``RadixCache``.

NOTE: over 500 lines because SGLang's tree-cache interface is one class: each override (match,
locks, hand-off, checkpoint, release, eviction, sizes) must live on this subclass. The logic they
call lives in ``tree/``, ``policy/`` and ``agent_requests.py`` (``self.requests``); what stays
here is the wiring to SGLang's rows, locks and pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_kvcmas.attention.deviation_factors import MaterializedBytes, RowLeaves
from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe
from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration import inflight_fence, reuse_accounting
from sglang_kvcmas.integration.agent_requests import (
    REGISTERED_ATTR,
    SPARE_ATTR,
    AgentRequests,
    continues_at,
    readers_of,
)
from sglang_kvcmas.integration.leaf_metrics import LeafGauge
from sglang_kvcmas.integration.radix_cache_backend import KvcmasRadixCache
from sglang_kvcmas.policy.fidelity import LEVELS
from sglang_kvcmas.policy.leaf_mode import LeafConfig
from sglang_kvcmas.policy.lora_share import (
    LORA_RECOMPUTE_BOUNDARY,
    LORA_RECOMPUTE_MASS_FRACTION,
    LORA_RECOMPUTE_TAIL,
)
from sglang_kvcmas.policy.recompute import (
    BorrowedSpan,
    RecomputeConfig,
    borrow_pays,
    message_starts,
    select_recompute_arrays,
    split_spans,
)
from sglang_kvcmas.policy.turn_order import TurnConfig
from sglang_kvcmas.tree.agent_split import AgentSplit
from sglang_kvcmas.tree.borrowed import (
    SharedPrefixHandle,
    adopt_factored,
    adopt_recomputed,
    borrowed_spans,
    factored_reread,
    row_spans,
)
from sglang_kvcmas.tree.shared_tree import SharedTree
from sglang_kvcmas.tree.template_markers import TemplateMarkers

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class _SharedReceipt:
    radix_lock: TreeLock | None
    anchor_locks: list[TreeLock]


@dataclass(frozen=True, eq=False)
class PendingOwner:
    """An admitted agent request that will register new shared tokens at its checkpoint.

    Attributes:
        shared: [n] int64 its shared-context token ids (``AgentRequests.shared_tokens``).
    """

    rid: str
    namespace: tuple
    shared: np.ndarray
    since: float


class KvcmasSharedTreeCache(KvcmasRadixCache):
    """Radix cache + shared-context tree (see module docstring)."""

    def __init__(
        self,
        params: CacheInitParams,
        markers: TemplateMarkers | None = None,
        share_context: bool | None = None,
        config: ServingConfig | None = None,
        chunk_limit: int = 0,
    ):
        """
        Args:
            markers: the served chat template's head markers (None: no template detection;
                requests then name their head explicitly).
            share_context: overrides ``config.share_context`` (tests).
            config: the serving knobs (default: read from the environment once).
            chunk_limit: SGLang's chunked-prefill size (0: no chunking). A row whose extend
                would be chunked never recomputes borrowed tokens: each chunk re-matches.
        """
        config = config or ServingConfig.from_env()
        if share_context is not None:
            config = config.with_values(share_context=share_context)
        self.config = config
        self.shared = SharedTree(self._free_slots)
        self.markers = markers
        self.requests = AgentRequests(markers, config.lora_share)
        self.share_context = config.share_context
        self.recompute_config = RecomputeConfig.from_serving(config)
        self.leaf_config = LeafConfig.from_serving(config)
        self.turn_config = TurnConfig()
        self.chunk_limit = chunk_limit
        self.pending_owners: dict[str, PendingOwner] = {}
        self.broken_namespaces: set[tuple] = set()
        self.faults = 0
        self._overlap: bool | None = None  # ``rows_in_flight``, looked up once
        self.rows_reread = 0  # factored readers' rows re-pointed right after their prefill
        self.peak_held = 0  # most pool slots held after a row's allocation since the last reset
        self._extra_freed = 0
        self.leaf_gauge = LeafGauge()
        super().__init__(params)

    # ----- helpers -----

    def _free_slots(self, slots: torch.Tensor) -> None:
        if self.token_to_kv_pool_allocator is not None and slots.numel():
            self.token_to_kv_pool_allocator.free(slots.to(self.device))

    @property
    def head_preamble(self) -> int:
        """Leading head tokens every agent shares (the template's ``system_open``, e.g.
        ``<|im_start|>system\n`` for ChatML, else the first token): their KV is the same for all
        agents, so mass on them is not a signal."""
        return len(self.markers.system_open) if self.markers is not None else 1

    def _fault(self, req: Req, where: str) -> None:
        """Log an internal error of ours for one request and stop sharing in its namespace
        (every later request there is served as by the radix cache); the scheduler goes on."""
        self.broken_namespaces.add(self.requests.namespace(req))
        self.faults += 1
        self.pending_owners.pop(req.rid, None)
        logger.exception("sglang-kvcmas: internal error in %s for request %s; sharing is off "
                         "for its namespace from now on", where, req.rid)

    def shared_available(self, req: Req) -> int:
        """How many of the request's shared tokens the shared tree holds (a peek), recomputed
        only when the tree has gained or lost nodes since the request last asked."""
        version = self.shared.version
        cached = getattr(req, "_kvcmas_available", None)
        if cached is not None and cached[0] == version:
            return cached[1]
        ns = self.requests.namespace(req)
        available, _ = self.shared.match(ns, self.requests.shared_tokens(req), split=False)
        req._kvcmas_available = (version, available)
        return available

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
        """SGLang's cache reset (``/flush_cache``, nothing running): the shared tree empties
        too, and the high-water marks restart from what is held now."""
        super().reset()
        if hasattr(self, "shared"):
            self.shared.reset()
            self.pending_owners.clear()
            self.peak_held = 0
            MaterializedBytes.restart()

    # ----- match -----

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if (not self.share_context or self.disable or req is None or self.page_size != 1
                or self.requests.namespace(req) in self.broken_namespaces):
            return base
        try:
            return self._match_shared(params, base, req)
        except Exception:  # our bug must not take the scheduler down: serve it exactly
            self._fault(req, "match")
            return base

    def _match_shared(self, params: MatchPrefixParams, base: MatchResult, req: Req) -> MatchResult:
        """The radix match ``base`` continued into the shared tree, when borrowing pays."""
        split = self.requests.split(req)
        if split is None or base.device_prefix_len < split.head_len \
                or self.requests.wants_exact(req):
            return base  # unknown agent head, or asked to: compute it (and be an exact owner)
        key = params.key
        shared_tokens = key.token_ids[split.head_len : min(len(key), split.shared_end)]
        ns = self.requests.namespace(req)
        matched, node = self.shared.match(ns, shared_tokens, split=True)
        begin = base.device_prefix_len - split.head_len
        if node is None or matched <= begin:
            return base
        handle = SharedPrefixHandle(
            base.last_device_node, base.device_prefix_len, node, begin, matched, split, ns
        )
        options = self.requests.options(req)
        own_knobs = options.overrides
        spans = borrowed_spans(handle)
        foreign = sum(p.end - p.begin for p in spans if p.foreign)
        if not own_knobs and not borrow_pays(foreign, self.recompute_config):
            return base  # too little to borrow: compute it exactly
        handle = replace(handle, use_leaves=options.reads_leaves).walked()
        config = (RecomputeConfig.from_serving(self.config, **own_knobs) if own_knobs
                  else self.recompute_config)
        if self.requests.reads_across_adapters(req):
            config = self._across_adapters(config, own_knobs)
            spans = self._at_messages(spans, shared_tokens)
        config = config.with_readers(readers_of(req))
        if 0 < options.fidelity_level < len(LEVELS):  # the fidelity loop raised it
            config = LEVELS[options.fidelity_level].applied_to(config)
        recompute = self._recompute_for(req, handle, config, spans)
        leaf = LeafConfig.from_serving(self.config, **own_knobs) if own_knobs \
            else self.leaf_config
        if options.fidelity_level > 0:  # a raised level keeps what it recomputes exactly
            leaf = replace(leaf, mode="exact")
        handle = replace(handle, recompute=recompute, factor_rank=leaf.factor_rank)
        return base._replace(device_prefix_len=handle.prefix_len, last_device_node=handle)

    @staticmethod
    def _across_adapters(config: RecomputeConfig, own_knobs: dict) -> RecomputeConfig:
        """``config`` for a reader with an adapter under ``borrow``: at least the LoRA tail,
        the LoRA boundary and the LoRA mass share (``policy/lora_share.py``), each where the
        request does not set its own."""
        changes: dict = {}
        if "recompute_tail" not in own_knobs:
            changes["tail_tokens"] = max(config.tail_tokens, LORA_RECOMPUTE_TAIL)
        if "recompute_boundary" not in own_knobs:
            changes["boundary_tokens"] = LORA_RECOMPUTE_BOUNDARY
        if "recompute_mass_fraction" not in own_knobs:
            changes["mass_fraction"] = LORA_RECOMPUTE_MASS_FRACTION
        return replace(config, **changes)

    def _at_messages(self, spans: list[BorrowedSpan], shared_tokens: Any) -> list[BorrowedSpan]:
        """A reader with an adapter's ``spans`` cut at every message start of the chat template
        in ``shared_tokens`` (from the shared transcript's start), so its boundary picks open
        every message it borrows; unchanged without a detected template."""
        if self.markers is None:
            return spans
        return split_spans(spans, message_starts(shared_tokens, self.markers.head_close))

    def _recompute_for(self, req: Req, handle: SharedPrefixHandle, config: RecomputeConfig,
                       spans: list[BorrowedSpan]) -> tuple[int, ...]:
        """Borrowed offsets this request recomputes under ``config`` (``spans =
        borrowed_spans(handle)``), or none when the extend could be chunked or the request asks
        for logprobs of prompt tokens whose computation order changes."""
        path = handle.borrowed()
        factored = path.factored  # held by a factored leaf: never picked again
        offsets = select_recompute_arrays(spans, path.offsets, path.foreign & ~factored,
                                          path.from_leaf | factored, path.mass, config)
        if not offsets:
            return ()
        extend = len(req.full_untruncated_fill_ids) - handle.prefix_len
        if self.chunk_limit and extend + len(offsets) > self.chunk_limit:
            return ()
        start = getattr(req, "logprob_start_len", -1)
        if getattr(req, "return_logprob", False) and 0 <= start <= handle.prefix_len:
            return ()
        return offsets

    @staticmethod
    def recomputes(req: Req) -> bool:
        """Whether the request's matched prefix leaves borrowed tokens for it to recompute."""
        return KvcmasSharedTreeCache.recomputed_tokens(req) > 0

    @staticmethod
    def recomputed_tokens(req: Req) -> int:
        """How many borrowed tokens the request's matched prefix leaves for it to recompute."""
        handle = getattr(req, "last_node", None)
        return len(handle.recompute) if isinstance(handle, SharedPrefixHandle) else 0

    @staticmethod
    def drop_recompute(req: Req) -> None:
        """Read the tokens the request was to recompute borrowed instead (its extend will be
        chunked: ``admission_hook``), and move what SGLang took from the match along: the
        prefix, and its protected length, now end at the shared context's end."""
        handle: SharedPrefixHandle = req.last_node
        moved = len(handle.recompute)
        if req.kv.cache_protected_len == req.prefix_len:
            req.kv.cache_protected_len += moved
        req.last_node = handle.without_recompute()
        req.prefix_len += moved
        req.num_matched_prefix_tokens += moved

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        handle = req.last_node
        if not isinstance(handle, SharedPrefixHandle):
            return super().prefix_device_indices(req)
        own = self.path_device_indices(handle.radix_node)[: handle.radix_len]
        path = handle.borrowed()
        borrowed = torch.from_numpy(path.slots[path.kept(handle.recompute)])
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
        self._note_held()
        try:
            self._hand_off(req)
        except Exception:  # the row already holds borrowed slots: fail this one request
            self._fault(req, "hand-off")
            req.kvcmas_row = None
            if isinstance(req.last_node, SharedPrefixHandle):
                req.to_finish = FINISH_ABORT(
                    "sglang-kvcmas: internal error while preparing this request's shared KV "
                    "(logged); retry it", HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")

    def _hand_off(self, req: Req) -> None:
        """Accounting, the row's spans and head-mass probe, and the pending-owner entry."""
        split = self.requests.split(req)
        handle = req.last_node if isinstance(req.last_node, SharedPrefixHandle) else None
        spans = probe = None
        if handle is not None:
            spans, kept = row_spans(req.rid, req.origin_input_ids, handle)
            path = handle.borrowed()
            factored = int(path.factored[kept].sum())
            repositioned = int(path.foreign[kept].sum()) - factored
            from_leaves = int(path.from_leaf[kept].sum())
            recomputed_borrowed = len(handle.recompute)
        else:
            repositioned = factored = from_leaves = recomputed_borrowed = 0
        if not getattr(req, "_kvcmas_accounted", False):
            prompt = len(req.origin_input_ids)
            exact = req.prefix_len - repositioned - factored
            reuse_accounting.attach(req, reuse_accounting.ReuseRecord(
                agent=split.agent if split else None, workflow=self.requests.options(req).workflow,
                prompt_tokens=prompt, reused_exact=exact, reused_factored=factored,
                reused_repositioned=repositioned,
                recomputed=prompt - exact - repositioned - factored,
                recomputed_borrowed=recomputed_borrowed, exact_from_leaves=from_leaves,
                kv_bytes_per_token=self.kv_bytes_per_token,
            ))
            req._kvcmas_accounted = True
        covered = split.head_len + handle.shared_end if handle is not None else req.prefix_len
        if split is not None and covered < split.shared_end:
            probe = HeadMassProbe.for_row(min(self.head_preamble, split.head_len),
                                          split.head_len, split.shared_end)
            self.pending_owners[req.rid] = PendingOwner(
                req.rid, self.requests.namespace(req), self.requests.shared_tokens(req),
                time.monotonic())
        req.kvcmas_row = BatchRow(spans, probe) if spans is not None or probe is not None \
            else None

    def _note_held(self) -> None:
        """Raise the high-water mark of pool slots held (by requests or cached) after a row is
        allocated: the batch's transient peak, which SGLang's gauges miss (they are read once a
        factored reader's recomputed slots are freed again)."""
        allocator = self.token_to_kv_pool_allocator
        try:
            held = int(allocator.size) - int(allocator.available_size())
        except (AttributeError, TypeError):  # simulated pools in unit tests
            return
        self.peak_held = max(self.peak_held, held)

    # ----- checkpoint / release -----

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        if not self.share_context or self.disable:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        split = self.requests.split(req)
        if isinstance(req.last_node, SharedPrefixHandle):
            try:
                self._adopt_recomputed(req, req.last_node, up_to)
                self._register_borrowed(req, req.last_node, up_to)
            except Exception:  # what it computed is not shared; its slots go at release
                self._fault(req, "checkpoint")
        else:
            if split is not None and req.finished() and not getattr(req, SPARE_ATTR, False):
                # Outputs re-enter through the shared transcript; keep only the prompt. Served in
                # a spare pass, the outputs stay on its path as the radix cache keeps them: an
                # idle server's next turn, served exactly too, finds them there.
                up_to = max(min(up_to, len(req.origin_input_ids)), req.kv.cache_protected_len)
            super().checkpoint(req, up_to=up_to, **kwargs)
            if split is not None and self.requests.namespace(req) not in self.broken_namespaces:
                try:
                    self._register_exact(req, split, up_to)
                except Exception:  # the radix cache holds its KV; only sharing is lost
                    self._fault(req, "checkpoint")
        if split is None or req.finished() or up_to >= split.shared_end:
            # A chunked owner stays pending until its last chunk: its readers wait for all of
            # the segment rather than start on the part its first chunks published.
            self.pending_owners.pop(req.rid, None)
        try:
            self.leaf_gauge.maybe_update(self.shared.leaf_bytes_by_agent)
        except Exception:  # a metric must never fail a request
            logger.exception("sglang-kvcmas: leaf byte gauge update failed")

    def _register_exact(self, req: Req, split: AgentSplit, up_to: int) -> None:
        """Share the transcript tokens an exact request computed, anchored on its radix path."""
        end = min(split.shared_end, up_to)
        if end <= split.head_len:
            return
        ids = req.full_untruncated_fill_ids
        tokens = ids[split.head_len : end]
        ns = self.requests.namespace(req)
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
            segment_start=continues_at(req) != known,
        )
        setattr(req, REGISTERED_ATTR, len(tokens))

    def _adopt_recomputed(self, req: Req, handle: SharedPrefixHandle, up_to: int) -> None:
        """Keep the tokens a reader recomputed as its exact leaves on the shared nodes (its later
        turns read them without recomputing); the row's protected prefix then covers them, and
        the slots of those a leaf already held are freed at release. Under leaf mode ``factored``
        the leaves are the factors its extend made of them, and every recomputed slot is freed:
        now, the row re-pointed at the owners' slots (``factored_reread``) when :meth:`_rereads`
        allows and every such token has a leaf; else at release."""
        head = handle.split.head_len
        start = head + handle.shared_end
        if not handle.recompute or up_to < start or req.kv.cache_protected_len != handle.prefix_len:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[handle.prefix_len : start].to(torch.int64).cpu().clone()
        after = handle.without_recompute()
        if handle.factor_rank > 0:  # factored leaves: the slots go now, or with the request
            leaves = _row_leaves(req)
            if leaves is not None and leaves.factor is not None:
                adopt_factored(self.shared, handle, leaves.factor)
            fresh = factored_reread(handle) if self._rereads(req, handle) else None
            if fresh is not None:
                self._reread_factored(req, fresh, row)
                self._free_slots(slots)
                self.rows_reread += 1
                after, slots = fresh, slots[:0]
            left = slots
        else:
            left = adopt_recomputed(self.shared, handle, slots, self.kv_bytes_per_token)
        if left.numel():
            req._kvcmas_release_slots = left
        req.last_node = after
        req.kv.cache_protected_len = start
        self._trim_leaves()

    def _rereads(self, req: Req, handle: SharedPrefixHandle) -> bool:
        """Whether a factored reader's row is re-pointed right after its prefill: not for a
        reader with an adapter (``lora_share=borrow``) that reads every borrowed token at its own
        position (its decode stays on the plain path; re-reading would put it on the deviations
        path alone), and while a launched batch may still read the row only behind a fence on
        the forward stream (``inflight_fence``); without one the slots stay until release."""
        if self.requests.reads_across_adapters(req) and not handle.borrowed().shift.any():
            return False
        return not self.rows_in_flight or inflight_fence.fence(self.device)

    @staticmethod
    def _reread_factored(req: Req, fresh: SharedPrefixHandle, row: torch.Tensor) -> None:
        """Point the row's borrowed part at ``fresh``'s slots in shared order (the recomputed
        tokens' slots replaced by their owners') and hand it the spans that read them through
        the reader's factored leaves: its decode no longer needs the recomputed slots."""
        path = fresh.borrowed()
        row[fresh.radix_len : fresh.radix_len + len(path)] = torch.from_numpy(path.slots).to(row)
        spans, _ = row_spans(req.rid, req.origin_input_ids, fresh)
        old: BatchRow | None = getattr(req, "kvcmas_row", None)
        req.kvcmas_row = BatchRow(spans, old.probe if old is not None else None)

    @property
    def rows_in_flight(self) -> bool:
        """Whether a launched batch may still be reading rows while the previous batch's
        results are processed (then a row changes only behind ``inflight_fence``): SGLang's
        overlap scheduler on an accelerator, whose fence covers its own metadata reads, not ours
        during the layers. On CPU a forward has ended when it returns. Unknown counts as yes."""
        if self._overlap is None:
            try:
                from sglang.srt.runtime_context import get_schedule

                overlap = not bool(get_schedule().disable_overlap_schedule)
                self._overlap = overlap and torch.device(self.device).type != "cpu"
            except Exception:  # no scheduler context (unit tests): assume the cautious case
                self._overlap = True
        return self._overlap

    def _trim_leaves(self) -> None:
        """Hold readers' leaves, exact and factored, to ``--kvcmas-leaf-budget`` (tokens of KV,
        as a share of the tokens the shared tree indexes)."""
        if self.config.leaf_budget is not None:
            self.shared.trim_leaves(int(self.config.leaf_budget * self.shared.indexed_tokens()),
                                    self.kv_bytes_per_token)

    @staticmethod
    def _recorded_mass(req: Req, start: int, end: int) -> torch.Tensor | None:
        """[end - start] head mass the backend recorded for the request's row indices
        ``start .. end - 1`` (rows after any recomputed ones: row index = position), or None."""
        row: BatchRow | None = getattr(req, "kvcmas_row", None)
        return None if row is None or row.probe is None else row.probe.mean(start, end)

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
            segment_start=continues_at(req) != handle.shared_end,
        )
        if node is None:
            return  # another request registered these tokens first: ours are freed at release
        setattr(req, REGISTERED_ATTR, end - split.head_len)
        new_handle = replace(handle, shared_node=node, shared_end=end - split.head_len,
                             recompute=(), path=None)
        new_lock = self.lock(new_handle)
        self.unlock(req.lock)
        req.lock, req.last_node = new_lock, new_handle
        req.kv.cache_protected_len = end

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        slots = getattr(req, "_kvcmas_release_slots", None)
        if slots is not None:
            self._free_slots(slots)
            req._kvcmas_release_slots = None
        leaves = _row_leaves(req)
        if leaves is not None and leaves.reads is not None:
            leaves.reads.release()  # the last batch's plan may still hold the row
        req.kvcmas_row = None
        self.pending_owners.pop(req.rid, None)

    # ----- eviction and sizes -----

    def _delete_leaf(self, node: Any) -> None:
        super()._delete_leaf(node)
        if hasattr(self, "shared"):
            self._extra_freed += self.shared.drop_anchor(node)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free what is cheapest to lose first: the shared tree's unlocked exact leaves (exact
        copies a reader re-derives by recomputing a few tokens) and owned nodes (computed over
        borrowed KV: approximate), least recently used first; then SGLang's radix LRU, whose
        nodes are exact (heads, and the owners' paths that anchor the shared bases)."""
        freed = 0
        if not self.disable and self.share_context:
            freed = self.shared.evict(params.num_tokens)
        if freed >= params.num_tokens:
            return EvictResult(num_tokens_evicted=freed)
        self._extra_freed = 0
        result = super().evict(replace(params, num_tokens=params.num_tokens - freed))
        freed += result.num_tokens_evicted + self._extra_freed
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
            "exact_leaf_tokens": self.shared.exact_leaf_tokens(),
            "exact_leaf_bytes": self.shared.exact_leaf_nbytes(),
            "factored_tokens": sum(len(f) for n in nodes for f in n.factors.values()),
            "factored_bytes": sum(f.nbytes() for n in nodes for f in n.factors.values()),
            "factored_rows_reread": self.rows_reread,
            "peak_held_tokens": self.peak_held,
            "leaf_bytes_by_agent": self.shared.leaf_bytes_by_agent(),
        }


def _row_leaves(req: Req) -> RowLeaves | None:
    """The factored leaves the request's row was handed (``req.kvcmas_row``), or None."""
    row: BatchRow | None = getattr(req, "kvcmas_row", None)
    return row.spans.leaves if row is not None and row.spans is not None else None
