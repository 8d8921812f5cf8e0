"""Carry each row's span metadata with its forward batch (scheduler -> attention backend).

The tree cache keeps a reader's borrowed spans, recomputed tokens and head-mass probe on its
request (``req.kvcmas_row``, an :class:`~sglang_kvcmas.attention.spans.BatchRow`) from when the
row is allocated until it is released. An AFTER hook on ``ForwardBatch.init_new(batch, ...)``
snapshots them, in the batch's row order, onto the forward batch; the attention backend reads
that snapshot (:func:`rows_of_forward`) and nothing else, so a later or overlapped batch can never
see another batch's rows, and a released row index handed to a new request carries nothing of
the old one.

NOTE: SGLang's model runner re-creates the forward batch it runs (``dataclasses.replace`` onto
static buffers), which keeps declared fields only. The snapshot therefore rides on one: the
batch's ``rids`` list is replaced by a :class:`TaggedRids` (the same request ids, a ``list``
subclass) holding the rows. Each entry names its request, and the backend checks that it reads
the row of the request at that position.
"""

from __future__ import annotations

from typing import Any

from sglang_kvcmas.attention.spans import BatchRow

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


class TaggedRids(list):
    """``forward_batch.rids`` with the batch's rows attached (``rows[i]`` for ``self[i]``), and
    the attention backend's per-batch cache (slot orders, a kernel plan: what every layer of
    this batch reads), so nothing computed for one batch is ever found by another."""

    rows: tuple[BatchRow | None, ...] = ()

    @property
    def cache(self) -> dict:
        return self.__dict__.setdefault("_cache", {})


def rows_of(reqs: Any) -> tuple[BatchRow | None, ...] | None:
    """``BatchRow | None`` per request, in batch order; None when every entry is None."""
    rows = tuple(getattr(r, "kvcmas_row", None) for r in reqs or ())
    return rows if any(r is not None for r in rows) else None


def attach_rows(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook for the classmethod ``ForwardBatch.init_new(batch, model_runner, ...)``."""
    batch = kwargs.get("batch")
    if batch is None:
        batch = next((a for a in args if not isinstance(a, type) and hasattr(a, "reqs")), None)
    reqs = getattr(batch, "reqs", None)
    rows = rows_of(reqs)
    if result is not None and rows is not None:
        tagged = TaggedRids(r.rid for r in reqs)
        tagged.rows = rows
        result.rids = tagged
    return result


def rows_of_forward(forward_batch: Any) -> tuple[BatchRow | None, ...] | None:
    """The rows a forward batch carries, or None (no row needs anything)."""
    rids = getattr(forward_batch, "rids", None)
    return rids.rows if isinstance(rids, TaggedRids) else None


def cache_of_forward(forward_batch: Any) -> dict:
    """The per-batch cache of a forward batch that carries rows (a new empty dict otherwise:
    such a batch reads nothing cached)."""
    rids = getattr(forward_batch, "rids", None)
    return rids.cache if isinstance(rids, TaggedRids) else {}


def reads_delta(rows: tuple[BatchRow | None, ...] | None, decode: bool) -> bool:
    """Whether a forward batch with these rows must take the delta read path.

    Extend: any row with borrowed spans (re-positioned keys, recomputed tokens at their true
    positions, factored leaves) or a head-mass probe. Decode: any row whose keys are read
    re-positioned or through factored leaves (a probe or a position mask changes nothing in
    decode).
    """
    for entry in rows or ():
        if entry is None:
            continue
        spans = entry.spans
        if decode:
            if spans is not None and (spans.reads_transformed or spans.leaves is not None):
                return True
        elif spans is not None or entry.probe is not None:
            return True
    return False


def forward_reads_delta(forward_batch: Any) -> bool:
    """:func:`reads_delta` for a forward batch (decode by its forward mode), decided once per
    batch (every layer asks)."""
    rids = getattr(forward_batch, "rids", None)
    if not isinstance(rids, TaggedRids):
        return False
    if "reads_delta" not in rids.cache:
        mode = getattr(forward_batch, "forward_mode", None)
        rids.cache["reads_delta"] = reads_delta(rids.rows, bool(mode is not None
                                                                and mode.is_decode()))
    return rids.cache["reads_delta"]
