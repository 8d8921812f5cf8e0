"""What the shared-tree cache reads of one request: its options, agent split and namespace.

A request's ``kvcmas_*`` options and its split into agent head + shared transcript + suffix are
parsed once and kept on the request (``req._kvcmas_state``), so nothing outlives a request that
is aborted while it waits. Beside them: the request's sharing namespace, its shared-context token
ids (copied once) and whether it reads no other agent's KV. The request attributes the cache and
the turn-order hook share are named here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from sglang_kvcmas.policy.fidelity import EXACT_LEVEL
from sglang_kvcmas.policy.lora_share import lora_agent, sharing_namespace
from sglang_kvcmas.policy.request_options import RequestOptions
from sglang_kvcmas.tokens import as_token_array
from sglang_kvcmas.tree.agent_split import AgentSplit, split_request
from sglang_kvcmas.tree.template_markers import TemplateMarkers

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

READERS_ATTR = "_kvcmas_readers"
"""Request attribute: the most readers the turn-order hook saw wait with it for one leader."""
SPARE_ATTR = "_kvcmas_spare_exact"
"""Request attribute: set by the turn-order hook when its scheduling pass had prefill to spare
(the request is then served exactly)."""
REGISTERED_ATTR = "_kvcmas_registered_to"
"""Request attribute: the shared offset its last registration (chunk) ended at."""


def continues_at(req: Req) -> int | None:
    """Shared offset where the request's previous chunk's registration ended (its next chunk
    continues that segment rather than starting one), or None."""
    return getattr(req, REGISTERED_ATTR, None)


def readers_of(req: Req) -> int:
    """How many readers waited together for the segment ``req`` borrows (its own count
    included; ``integration/turn_order_hook.py`` records it on the request), 1 if none."""
    return getattr(req, READERS_ATTR, 1)


@dataclass(frozen=True)
class _RequestState:
    """What the cache keeps per request while it is queued or running (parsed once)."""

    options: RequestOptions | None
    split: AgentSplit | None


class AgentRequests:
    """The per-request reads of :class:`~sglang_kvcmas.integration.shared_tree_cache.
    KvcmasSharedTreeCache`, for one served chat template and LoRA sharing mode.

    Args:
        markers: the served chat template's head markers (None: requests name their head).
        lora_share: ``--kvcmas-lora-share`` (``policy/lora_share.py``).
    """

    def __init__(self, markers: TemplateMarkers | None, lora_share: str):
        self.markers = markers
        self.lora_share = lora_share

    def state(self, req: Req) -> _RequestState:
        """The request's options and agent split, parsed once. Never raises: requests with bad
        ``kvcmas_*`` fields were answered 400 before reaching the scheduler, and any that get
        here anyway are served without sharing."""
        state = getattr(req, "_kvcmas_state", None)
        if state is None:
            custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
            options = RequestOptions.lenient(custom)
            split = None
            if options is None:
                logger.warning("sglang-kvcmas: request %s: bad kvcmas_* fields; served without "
                               "sharing", req.rid)
            else:
                try:
                    split = split_request(req.origin_input_ids, options, self.markers)
                    lora_id = getattr(req, "lora_id", None)
                    if split is not None and lora_id is not None:
                        split = replace(split, agent=lora_agent(split.agent, lora_id))
                except ValueError as e:
                    logger.warning("sglang-kvcmas: request %s: %s; served without sharing",
                                   req.rid, e)
            state = req._kvcmas_state = _RequestState(options, split)
        return state

    def split(self, req: Req) -> AgentSplit | None:
        """The request's agent split; None: not an agent request."""
        return self.state(req).split

    def options(self, req: Req) -> RequestOptions:
        return self.state(req).options or RequestOptions()

    def namespace(self, req: Req) -> tuple:
        """The request's sharing namespace: never across ``extra_key`` or ``cache_salt``; across
        LoRA adapters only under ``lora_share=borrow`` (``policy/lora_share.py``)."""
        return sharing_namespace(getattr(req, "extra_key", None), getattr(req, "cache_salt", None),
                                 getattr(req, "lora_id", None), self.lora_share)

    def reads_across_adapters(self, req: Req) -> bool:
        """Whether ``req`` names an adapter and may read KV another adapter computed
        (``lora_share=borrow``)."""
        return self.lora_share == "borrow" and getattr(req, "lora_id", None) is not None

    def wants_exact(self, req: Req) -> bool:
        """Whether the request reads no other agent's KV: it asked to (``kvcmas_exact``), its
        scheduling pass had prefill to spare (:data:`SPARE_ATTR`), or the fidelity loop serves
        its namespace or agent exactly."""
        if getattr(req, SPARE_ATTR, False):
            return True
        options = self.options(req)
        return options.exact or options.fidelity_level >= EXACT_LEVEL

    def shared_tokens(self, req: Req) -> np.ndarray:
        """[n] int64 the request's shared-context token ids (copied once: a lasting view would
        pin the prompt's ``array('q')`` buffer); empty when it is not an agent request."""
        view = getattr(req, "_kvcmas_shared", None)
        if view is None:
            split = self.split(req)
            ids = as_token_array(req.origin_input_ids)
            view = (ids[split.head_len : split.shared_end] if split is not None
                    else ids[:0]).copy()
            req._kvcmas_shared = view
        return view
