"""Sharing over SGLang's own attention backends: ``triton`` and ``flashinfer`` (GPU),
``torch_native`` (CPU).

With ``--kvcmas-share-context``, the factories SGLang's attention registry holds for those names
build the backend the user asked for and make it a dispatcher (:func:`as_shared`): a forward batch
in which no row reads borrowed KV runs through that backend unchanged (its kernels, its metadata
planning, its CUDA graphs), and a batch in which one does (:func:`batch_rows.forward_reads_delta`:
borrowed spans, recomputed tokens, factored leaves, or a head-mass probe in extend) runs through
:class:`~sglang_kvcmas.integration.delta_attention_backend.DeltaAttnBackend`, the read path that
re-positions borrowed keys, places recomputed tokens at their true positions and adds the
deviations of tokens read through factored leaves. On GPU our Triton delta kernels read such a batch in one launch per layer
(each KV tile rotated by its run's shift in registers: every decode, every extend's new tokens
after a reader's recomputed ones), the rest in device-agnostic PyTorch (gathers, SDPA). With
sharing off the factories return SGLang's backends untouched.

The dispatcher is the user's backend object itself, its class swapped for a direct subclass
carrying :class:`SharedDispatch`'s methods: every method SGLang calls that this module does not
override (CUDA-graph state, capture and replay metadata, speculative buffers) is the backend's own,
``isinstance`` checks against SGLang's class still hold, and ``--attention-backend`` keeps its
value, so SGLang's per-backend decisions (workspace, graph buffers) are the ones it makes for the
stock backend.

CUDA graphs: a replayed decode graph runs the kernels it captured, which would read borrowed keys
unshifted, so the graph runners' ``can_run_graph`` answers no for a batch that reads borrowed KV
(:func:`graph_gate`, an AFTER hook on the decode, prefill and CPU graph runners; logged once per
process). Such batches run eagerly; batches of exact requests keep their graphs.

Overlap scheduler: the rows a batch reads ride on the forward batch itself (``batch_rows``), so a
later or overlapped batch never reads another batch's spans; the dispatcher keeps no state between
calls (each call decides from its own forward batch).

Refused at start (``ValueError`` naming the model and the backend): MLA attention (the delta
path reads per-KV-head keys), and every model the shift cannot serve exactly
(``rope_shift.shift_rope_for_runner``, as for ``kvcmas_delta``). Page sizes above 1 are refused by
the tree cache (``tree_cache_factory``).

Not yet here: layers that record head mass through a kernel (they take the torch path). Measured on a GPU by
``scripts/gpu_check.sh`` (kernels), not yet end to end.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from sglang_kvcmas.config import ServingConfig
from sglang_kvcmas.integration.batch_rows import forward_reads_delta
from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SHARED_BACKENDS = ("triton", "flashinfer", "torch_native")
"""SGLang attention backends that serve sharing through :func:`as_shared`."""

GRAPH_GATE_TARGETS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
    ".can_run_graph",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
    ".can_run_graph",
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
    """

    kvcmas_delta: DeltaAttnBackend
    kvcmas_base: type

    def init_forward_metadata(self, forward_batch):
        if forward_reads_delta(forward_batch):
            self.kvcmas_delta.init_forward_metadata(forward_batch)
        else:
            self.kvcmas_base.init_forward_metadata(self, forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_idle() and forward_reads_delta(forward_batch):
            _no_extra(kwargs)
            return self.kvcmas_delta.forward(q, k, v, layer, forward_batch, save_kv_cache)
        return self.kvcmas_base.forward(self, q, k, v, layer, forward_batch, save_kv_cache,
                                        **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_reads_delta(forward_batch):
            _no_extra(kwargs)
            return self.kvcmas_delta.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self.kvcmas_base.forward_extend(self, q, k, v, layer, forward_batch,
                                               save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_reads_delta(forward_batch):
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
        "take the delta read path (eager, no CUDA graph); all others run unchanged",
        name, type(backend).kvcmas_base.__name__,
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
    borrowed KV (a captured graph would read it unshifted)."""
    global _logged_gate
    if not result or not forward_reads_delta(forward_batch):
        return None
    if not _logged_gate:
        _logged_gate = True
        logger.info("sglang-kvcmas: batches that read borrowed KV run eagerly (%s declined); "
                    "logged once", type(runner).__name__)
    return False
