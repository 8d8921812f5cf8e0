"""Our Prometheus counters and gauges, each created once per process and only when it is first
used.

Metrics are optional, like SGLang's ``--enable-metrics``: without ``prometheus_client`` every
counter is None and callers skip counting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_COUNTERS: dict[str, Any] = {}


def counter(name: str, documentation: str, labels: Sequence[str]) -> Any | None:
    """The process's ``prometheus_client.Counter`` called ``name`` (created on first call), or
    None when prometheus_client is not installed."""
    if name not in _COUNTERS:
        try:
            from prometheus_client import Counter
        except ImportError:
            _COUNTERS[name] = None
        else:
            _COUNTERS[name] = Counter(name, documentation, list(labels))
    return _COUNTERS[name]


def gauge(name: str, documentation: str, labels: Sequence[str]) -> Any | None:
    """The process's ``prometheus_client.Gauge`` called ``name`` (created on first call; under
    SGLang's multiprocess collection the most recent value of any process), or None when
    prometheus_client is not installed."""
    if name not in _COUNTERS:
        try:
            from prometheus_client import Gauge
        except ImportError:
            _COUNTERS[name] = None
        else:
            _COUNTERS[name] = Gauge(name, documentation, list(labels),
                                    multiprocess_mode="mostrecent")
    return _COUNTERS[name]
