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

Active only when the tree cache is ours with sharing on.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission"


def admission_around(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: a reader with recomputed tokens is admitted whole or not at all."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache

    cache = getattr(adder, "tree_cache", None)
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
