"""Sharing over SGLang's own attention backends: ``triton`` and ``flashinfer`` (GPU),
``torch_native`` (CPU).

With ``--kvcmas-share-context``, the factories SGLang's attention registry holds for those names
build the backend the user asked for and make it a dispatcher (:func:`as_shared`). Each forward
batch's route (``dispatch_route``, decided once per batch, counted by ``dispatch_counts``):

- no row reads borrowed KV (``plain``): that backend unchanged (its kernels, its metadata
  planning, its CUDA graphs);
- an extend whose rows record head mass but read nothing borrowed (``probe``: exact owners
  computing new shared segments): that backend unchanged too, eagerly, with the head mass read
  beside it at the probe layers (``stock_probes``). Over ``torch_native`` such a batch takes our
  torch path instead (:attr:`SharedDispatch.KEEP_PROBES_ON_DELTA`);
- a row reads borrowed spans (re-positioned keys, recomputed tokens, factored leaves):
  :class:`~sglang_kvcmas.integration.delta_attention_backend.DeltaAttnBackend`'s read path (on
  GPU our Triton delta kernels, the rest in PyTorch).

With sharing off the factories return SGLang's backends untouched.

The dispatcher is the user's backend object itself, its class swapped for a direct subclass
carrying :class:`SharedDispatch`'s methods: every method SGLang calls that this module does not
override (CUDA-graph state, capture and replay metadata, speculative buffers) is the backend's own,
``isinstance`` checks against SGLang's class still hold, and ``--attention-backend`` keeps its
value, so SGLang's per-backend decisions (workspace, graph buffers) are the ones it makes for the
stock backend.

CUDA graphs: a replayed decode graph runs the kernels it captured, which would read borrowed keys
unshifted, so the graph runners' ``can_run_graph`` answers no for a batch that reads borrowed KV
or records head mass (:func:`graph_gate`, an AFTER hook on the decode, prefill and CPU graph
runners; logged once per process). Such batches run eagerly; all others keep their graphs.

Overlap scheduler: the rows a batch reads ride on the forward batch itself (``batch_rows``), so a
later or overlapped batch never reads another batch's spans; the dispatcher keeps no state between
calls (each call decides from its own forward batch).

Refused at start (``ValueError`` naming the model and the backend): MLA attention (the delta
path reads per-KV-head keys), and every model the shift cannot serve exactly
(``rope_shift.shift_rope_for_runner``, as for ``kvcmas_delta``). Page sizes above 1 are refused by
the tree cache (``tree_cache_factory``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration.batch_rows import forward_reads_delta
from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend
from sglang_kvcmas.integration.dispatch_route import PROBE, STOCK, Route, route_of
from sglang_kvcmas.integration.stock_probes import probes_at, record_beside

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SHARED_BACKENDS = ("triton", "flashinfer", "torch_native")
"""SGLang attention backends that serve sharing through :func:`as_shared`."""

GRAPH_GATE_TARGETS = (
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
     ".can_run_graph"),
    ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
     ".can_run_graph"),
    "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner.can_run_graph",
)

_logged_gate = False


class SharedDispatch:
    """The methods a dispatcher overrides (see module docstring); :func:`dispatch_class` puts
    them on a direct subclass of SGLang's backend class (an object can change class in place only
    to a class of the same layout, which a mixin base would change).

    Attributes:
        kvcmas_delta: the delta read path, built over the same model runner.
        kvcmas_base: SGLang's backend class.
        kvcmas_probes_on_stock: whether a probe batch stays on this backend, the head mass read
            beside it (False for the bases in :attr:`KEEP_PROBES_ON_DELTA`).
    """

    KEEP_PROBES_ON_DELTA: tuple[type, ...] = (TorchNativeAttnBackend,)
    """Backends whose probe batches take our torch path rather than staying on them: SGLang's
    torch_native pads each row's new queries to its whole sequence (n_kv² work for n_q new
    tokens), where our path attends the new queries only (``span_reads.tail_attention``) and
    measures the head mass on the keys it gathered anyway."""

    kvcmas_delta: DeltaAttnBackend
    kvcmas_base: type
    kvcmas_probes_on_stock: bool

    def kvcmas_route(self, forward_batch) -> Route:
        """The batch's route (``dispatch_route``): one dict lookup after its first call."""
        return route_of(forward_batch, self.kvcmas_probes_on_stock, self.kvcmas_delta)

    def init_forward_metadata(self, forward_batch):
        if self.kvcmas_route(forward_batch).path != STOCK:
            self.kvcmas_delta.init_forward_metadata(forward_batch)
        else:
            self.kvcmas_base.init_forward_metadata(self, forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # On the stock route, the base's forward calls forward_extend / forward_decode below.
        if (not forward_batch.forward_mode.is_idle()
                and self.kvcmas_route(forward_batch).path != STOCK):
            _no_extra(kwargs)
            return self.kvcmas_delta.forward(q, k, v, layer, forward_batch, save_kv_cache)
        return self.kvcmas_base.forward(self, q, k, v, layer, forward_batch, save_kv_cache,
                                        **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        route = self.kvcmas_route(forward_batch)
        if route.path != STOCK:
            _no_extra(kwargs)
            return self.kvcmas_delta.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        out = self.kvcmas_base.forward_extend(self, q, k, v, layer, forward_batch,
                                              save_kv_cache, **kwargs)
        if route.reason == PROBE and probes_at(layer, forward_batch):
            delta = self.kvcmas_delta
            record_beside(q, layer, forward_batch, delta.token_to_kv_pool,
                          delta.req_to_token_pool.req_to_token)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.kvcmas_route(forward_batch).path != STOCK:
            _no_extra(kwargs)
            return self.kvcmas_delta.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.kvcmas_base.forward_decode(self, q, k, v, layer, forward_batch,
                                               save_kv_cache, **kwargs)


def _no_extra(kwargs: dict) -> None:
    """The delta path takes plain attention layers only (no sinks, no extra inputs)."""
    if kwargs:
        raise RuntimeError(
            f"sglang-kvcmas: a layer that reads borrowed KV passed {sorted(kwargs)} to attention; "
            "the delta read path does not take them"
        )


_CLASSES: dict[type, type] = {}


def dispatch_class(base: type) -> type:
    """``base`` with :class:`SharedDispatch`'s methods, one class per base."""
    cls = _CLASSES.get(base)
    if cls is None:
        methods = {name: fn for name, fn in vars(SharedDispatch).items() if callable(fn)}
        cls = type(f"Shared{base.__name__}", (base,), {
            **methods, "kvcmas_base": base, "__module__": __name__,
            "kvcmas_probes_on_stock": not issubclass(base, SharedDispatch.KEEP_PROBES_ON_DELTA),
            "__doc__": f"{base.__name__} + sharing (see ``SharedDispatch``)."})
        _CLASSES[base] = cls
    return cls


def as_shared(backend: Any, runner: ModelRunner, name: str,
              delta_factory: Callable[[Any], Any] = DeltaAttnBackend) -> Any:
    """Make ``backend`` (built by SGLang's factory ``name``) a dispatcher; returns it.

    Raises:
        ValueError: for MLA attention, or a model whose rotary the shift cannot serve.
    """
    model = getattr(getattr(runner, "model_config", None), "model_path", None) or "this model"
    if getattr(runner, "use_mla_backend", False):
        raise ValueError(
            f"--kvcmas-share-context does not serve MLA attention ({model}, attention backend "
            f"{name!r}): the delta read path re-positions per-KV-head keys"
        )
    delta = delta_factory(runner)  # refuses rotary variants it cannot shift exactly
    backend.__class__ = dispatch_class(type(backend))
    backend.kvcmas_delta = delta
    logger.info(
        "sglang-kvcmas: attention backend %r (%s) with sharing: batches that read borrowed KV "
        "take the delta read path (eager, no CUDA graph); owners' head-mass probes %s; all "
        "others run unchanged", name, type(backend).kvcmas_base.__name__,
        "run on it, the mass read beside it" if type(backend).kvcmas_probes_on_stock
        else "take our torch path",
    )
    return backend


def shared_factory(name: str, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """SGLang's factory ``original`` for backend ``name``, made a dispatcher with sharing on."""

    def create(runner):
        backend = original(runner)
        if not ServingConfig.from_env().share_context:
            return backend
        return as_shared(backend, runner, name)

    create.kvcmas_original = original
    create.__qualname__ = create.__name__ = f"create_shared_{name}_backend"
    return create


def wrap_registry(backends: dict[str, Callable[[Any], Any]]) -> None:
    """Replace the factories of :data:`SHARED_BACKENDS` in SGLang's registry (idempotent)."""
    for name in SHARED_BACKENDS:
        original = backends.get(name)
        if original is not None and not hasattr(original, "kvcmas_original"):
            backends[name] = shared_factory(name, original)


def graph_gate(result: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on the graph runners' ``can_run_graph``: no graph for a batch that reads
    borrowed KV (a captured graph would read it unshifted) or records head mass (a graph would
    skip the probe)."""
    global _logged_gate
    if not result or not forward_reads_delta(forward_batch):
        return None
    if not _logged_gate:
        _logged_gate = True
        logger.info("sglang-kvcmas: batches that read borrowed KV run eagerly (%s declined); "
                    "logged once", type(runner).__name__)
    return False
