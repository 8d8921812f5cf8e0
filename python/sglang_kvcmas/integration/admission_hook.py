"""Keep a reader's extend in one piece under chunked prefill (a hook on SGLang's admission).

A reader that recomputes borrowed tokens runs them at the front of its extend, at their true
(earlier) positions (``delta_attention_backend.DeltaAttnBackend._place_recomputed``), so its
extend must be one forward. SGLang's ``PrefillAdder`` truncates a request that overflows the
batch's remaining chunk budget; ``KvcmasSharedTreeCache._recompute_for`` only rules out an
extend above the whole ``--chunked-prefill-size``. This AROUND hook on the admission choice
(``PrefillAdder._select_prefill_admission``, called before anything is allocated or locked):

- a reader with recomputed tokens that would be truncated ends the batch before it
  (``AddReqResult.OTHER``); it stays first in the waiting queue and is admitted whole into the
  next batch, with a fresh budget;
- if even a batch holding nothing else would truncate it (the budget is below the chunk size,
  e.g. mixed decode tokens), it drops its recompute
  (``KvcmasSharedTreeCache.drop_recompute``) and is chunked as a plain reader.

And, under ``--kvcmas-recompute-batch-tokens``, a reader whose recomputed tokens would take the
batch's past the cap ends the batch before it the same way (:func:`over_recompute_cap`): readers
released together are prefilled in groups, and the KV their recomputed tokens take at once
stays bounded (under leaf mode ``factored`` they are freed right after each prefill).

Active only when the tree cache is ours with sharing on.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission"


def over_recompute_cap(cache: Any, adder: Any, req: Any) -> bool:
    """Whether ``req``'s recomputed tokens would take the batch's past
    ``--kvcmas-recompute-batch-tokens`` (never for the batch's first reader)."""
    cap = cache.config.recompute_batch_tokens
    mine = cache.recomputed_tokens(req) if cap is not None else 0
    if not mine:
        return False
    held = sum(cache.recomputed_tokens(r) for r in adder.can_run_list)
    if not held or held + mine <= cap:
        return False
    logger.debug("sglang-kvcmas: reader %s waits: its batch recomputes %d tokens (cap %d)",
                 req.rid, held, cap)
    return True


def admission_around(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: a reader with recomputed tokens is admitted whole or not at all."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache

    cache = getattr(adder, "tree_cache", None)
    if isinstance(cache, KvcmasSharedTreeCache) and over_recompute_cap(cache, adder, req):
        return AddReqResult.OTHER
    out = original(adder, req, *args, **kwargs)
    if not getattr(out, "is_chunked", False) or not isinstance(cache, KvcmasSharedTreeCache):
        return out
    if not cache.recomputes(req):
        return out
    if adder.can_run_list:
        logger.info("sglang-kvcmas: reader %s waits for a batch that holds its extend whole",
                    req.rid)
        return AddReqResult.OTHER
    logger.warning("sglang-kvcmas: reader %s: even an empty prefill batch would chunk its "
                   "extend; it reads its recompute set borrowed", req.rid)
    cache.drop_recompute(req)
    return original(adder, req, *args, **kwargs)
