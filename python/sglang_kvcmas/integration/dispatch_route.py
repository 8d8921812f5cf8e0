"""Which path a forward batch takes through a sharing backend, and why: decided once per batch.

A batch runs on one of three paths:

- ``stock``: the user's attention backend, unchanged (SGLang's ``triton``, ``flashinfer`` or
  ``torch_native``; under ``--attention-backend kvcmas_delta``, torch_native's code).
- ``kernel``: our Triton delta kernels (``DeltaAttnBackend``'s kernel path, GPU).
- ``torch``: our torch read path (``DeltaAttnBackend``'s PyTorch loops and SDPA).

and for one of a closed set of reasons (:data:`REASONS`). :func:`decide` is the rule;
:func:`route_of` caches its answer in the batch's per-forward cache (``batch_rows.TaggedRids``),
so every layer pays one dict lookup; a batch without rows (sharing off, exact requests) is
``stock``/``plain`` with no lookup at all. ``dispatch_counts`` counts each forward's route once.

What the route does not name: on the kernel path a reader's few recomputed tokens (masked by
true position) are read in PyTorch beside the kernel, and owners' head mass at the probe layers
too; at a non-causal layer the delta path takes torch; at a layer where no row reads anything
differently (a row's factored deviations all zero there) it runs torch_native's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kvcmas.attention.spans import BatchRow
from sglang_kvcmas.integration.batch_rows import TaggedRids, reads_delta

STOCK, KERNEL, TORCH = "stock", "kernel", "torch"
PATHS = (STOCK, KERNEL, TORCH)

PLAIN, PROBE, READER = "plain", "probe", "reader"
PROBE_ON_TORCH_NATIVE, NO_KERNEL, LEAVES_OUT_OF_ORDER = (
    "probe_on_torch_native", "no_kernel", "leaves_out_of_order")
REASONS = {
    PLAIN: "no row reads borrowed KV or records head mass (decode: none reads re-positioned or "
           "factored keys)",
    PROBE: "exact owners record head mass (extend, no borrowed spans): the user's backend "
           "attends, the mass is read beside it at the probe layers",
    READER: "a row reads borrowed spans: the delta kernels read the batch",
    PROBE_ON_TORCH_NATIVE: "as probe, but the user's backend is torch_native (or kvcmas_delta), "
                           "which pads queries to the whole sequence: our torch path is faster",
    NO_KERNEL: "a row reads borrowed spans; the kernels do not serve here (CPU outside "
               "Triton's interpreter, or a rotary they do not tile)",
    LEAVES_OUT_OF_ORDER: "a row reads factored-leaf tokens not at their row index, which the "
                         "kernels cannot place",
}
"""Every reason a route gives, and what it means."""


@dataclass(frozen=True)
class Route:
    """A forward batch's path and the reason for it."""

    path: str
    reason: str


PLAIN_ROUTE = Route(STOCK, PLAIN)
PROBE_ROUTE = Route(STOCK, PROBE)


def decide(rows: tuple[BatchRow | None, ...] | None, decode: bool, probes_on_stock: bool,
           kernel: bool) -> Route:
    """The route of a batch with these rows.

    Args:
        rows: the batch's rows (``batch_rows.rows_of_forward``), or None.
        decode: whether the batch decodes (else it extends).
        probes_on_stock: whether the user's backend attends while head mass is read beside it
            (``SharedDispatch.kvcmas_probes_on_stock``; False for torch_native).
        kernel: whether the delta kernels serve this model on this device
            (``DeltaAttnBackend.delta_kernel``).
    """
    if not reads_delta(rows, decode):
        return PLAIN_ROUTE
    spans = [e.spans for e in rows if e is not None and e.spans is not None]
    if not spans:  # extend, head-mass probes only
        return PROBE_ROUTE if probes_on_stock else Route(TORCH, PROBE_ON_TORCH_NATIVE)
    if not kernel:
        return Route(TORCH, NO_KERNEL)
    if any(s.leaves is not None and not s.leaves.kernel_reads for s in spans):
        return Route(TORCH, LEAVES_OUT_OF_ORDER)
    return Route(KERNEL, READER)


def route_of(forward_batch: Any, probes_on_stock: bool, delta: Any) -> Route:
    """:func:`decide` for a forward batch (decode by its forward mode), once per batch.

    Args:
        delta: the delta read path; its ``delta_kernel`` is read when the route is decided.
    """
    rids = getattr(forward_batch, "rids", None)
    if not isinstance(rids, TaggedRids):
        return PLAIN_ROUTE
    cache = rids.cache
    route = cache.get("route")
    if route is None:
        mode = getattr(forward_batch, "forward_mode", None)
        route = cache["route"] = decide(rids.rows, bool(mode is not None and mode.is_decode()),
                                        probes_on_stock,
                                        bool(getattr(delta, "delta_kernel", False)))
    return route
