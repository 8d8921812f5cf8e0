"""Our Prometheus metrics, each created once per process, when it is first used.

Metrics are optional, like SGLang's ``--enable-metrics``: without ``prometheus_client`` every
metric below is None and callers skip counting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_COUNTERS: dict[str, Any] = {}


def counter(name: str, documentation: str, labels: Sequence[str]) -> Any | None:
    """The process's ``prometheus_client.Counter`` called ``name``."""
    return _metric(name, lambda p: p.Counter(name, documentation, list(labels)))


def gauge(name: str, documentation: str, labels: Sequence[str]) -> Any | None:
    """The process's ``prometheus_client.Gauge`` called ``name`` (under SGLang's multiprocess
    collection, the most recent value of any process)."""
    return _metric(name, lambda p: p.Gauge(name, documentation, list(labels),
                                           multiprocess_mode="mostrecent"))


def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Any | None:
    """The process's ``prometheus_client.Histogram`` called ``name``."""
    return _metric(name, lambda p: p.Histogram(name, documentation, buckets=list(buckets)))


def _metric(name: str, make: Callable[[Any], Any]) -> Any | None:
    if name not in _COUNTERS:
        try:
            import prometheus_client
        except ImportError:
            _COUNTERS[name] = None
        else:
            _COUNTERS[name] = make(prometheus_client)
    return _COUNTERS[name]
