"""Forward batches and their tokens counted by route: path and reason (``dispatch_route``).

An AFTER hook on ``ModelRunner.forward`` counts every forward the model runner ran once, by the
route its attention backend gave it (``kvcmas_route``: a sharing dispatcher, or
``kvcmas_delta`` as the user's backend; a forward through any other backend is not counted).
Counting there, not in the backend, sees the batches a CUDA graph replays too (they never call
the backend in Python) and counts each batch once however many layers it has.

Tokens: an extend's new tokens (``extend_num_tokens``), else one per row (``batch_size``).

Reported per scheduler process in ``/server_info`` (``internal_states[i].kvcmas.dispatch``,
:func:`snapshot`) and as Prometheus counters ``kvcmas:forward_batches_total{path,reason}`` and
``kvcmas:forward_tokens_total{path,reason}`` (when ``prometheus_client`` is installed).
"""

from __future__ import annotations

from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.dispatch_route import Route

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
"""The SGLang method :func:`count_forward` follows (checked by test/test_sglang_contract.py)."""

BATCHES: dict[tuple[str, str], int] = {}
"""(path, reason) -> forward batches counted in this process."""
TOKENS: dict[tuple[str, str], int] = {}
"""(path, reason) -> their tokens."""

_CHILDREN: dict[tuple[str, str, str], Any] = {}  # (metric, path, reason) -> labelled counter


def count(route: Route, tokens: int) -> None:
    """Count one forward batch of ``tokens`` tokens on ``route``."""
    key = (route.path, route.reason)
    BATCHES[key] = BATCHES.get(key, 0) + 1
    TOKENS[key] = TOKENS.get(key, 0) + tokens
    for name, value in (("batches", 1), ("tokens", tokens)):
        child = _CHILDREN.get((name, *key))
        if child is None:
            metric = _counter(name)
            if metric is None:
                return
            child = _CHILDREN[(name, *key)] = metric.labels(path=route.path, reason=route.reason)
        child.inc(value)


def batch_tokens(forward_batch: Any) -> int:
    """Tokens a forward batch computes: an extend's new tokens, else one per row."""
    n = getattr(forward_batch, "extend_num_tokens", None)
    if n is not None and forward_batch.forward_mode.is_extend():
        return int(n)
    return int(forward_batch.batch_size)


def count_forward(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook for ``ModelRunner.forward(forward_batch, ...)``; keeps its result."""
    route_of = getattr(getattr(runner, "attn_backend", None), "kvcmas_route", None)
    forward_batch = args[0] if args else kwargs.get("forward_batch")
    if route_of is not None and forward_batch is not None and (
            not forward_batch.forward_mode.is_idle()):
        count(route_of(forward_batch), batch_tokens(forward_batch))


def snapshot() -> dict[str, dict[str, dict[str, int]]]:
    """``{"forward_batches": {path: {reason: n}}, "forward_tokens": {...}}``, counted so far."""
    out: dict[str, dict[str, dict[str, int]]] = {"forward_batches": {}, "forward_tokens": {}}
    for name, counts in (("forward_batches", BATCHES), ("forward_tokens", TOKENS)):
        for (path, reason), n in sorted(counts.items()):
            out[name].setdefault(path, {})[reason] = n
    return out


def _counter(name: str) -> Any:
    return metrics.counter(f"kvcmas:forward_{name}",
                           f"Forward {name} by attention path (stock: the user's backend; "
                           "kernel: our delta kernels; torch: our torch path) and reason.",
                           ["path", "reason"])
