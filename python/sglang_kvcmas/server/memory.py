"""The CPU default of ``--mem-fraction-static``, sized from the model and the KV pool asked for.

How SGLang 0.5.23 sizes the KV pool on CPU: before loading the model, the scheduler measures
the free host memory ``pre`` (``psutil``'s available memory, bounded by the cgroup's limit,
divided by the NUMA nodes); after loading the weights it measures ``avail`` again and gives the
KV pool ``rest = avail - pre * (1 - mem_fraction_static)`` bytes, capped at
``--max-total-tokens`` tokens. ``rest <= 0`` fails the boot ("Loaded weights leave no GPU
memory for the KV cache"). So the fraction must cover what the scheduler allocates from ``pre``:

    fraction >= (weights + max_total_tokens * kv_bytes_per_token + overhead) / pre

A fixed fraction cannot be right for every model: one that fits a small model's float32
weights starves a model a few times larger. :func:`static_fraction` is that rule with headroom:
``pre`` is read after the server's other processes (and other jobs) have started, so it is below
what the launcher saw free, and loading weights peaks well above their size. A larger fraction
than needed costs nothing on CPU, as the pool is capped at ``--max-total-tokens`` anyway. Pure
functions except :func:`free_host_bytes` and :func:`footprint_of_folder`, which read the machine
and a model folder.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelFootprint", "footprint_of_folder", "free_host_bytes", "static_fraction"]

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
               "bfloat16": 2, "bf16": 2, "float64": 8, "double": 8}
MIN_FRACTION = 0.1
MAX_FRACTION = 0.95
OVERHEAD_BYTES = 1 * GIB
"""Fixed headroom: the torch runtime, activations of a chunked prefill, allocator slack."""
WEIGHT_HEADROOM = 1.0
"""Extra share of the weights' bytes: loading temporaries (a second copy at most)."""
LAUNCH_RESERVE_BYTES = 4 * GIB
"""Free memory assumed gone before the scheduler measures ``pre`` (its sibling processes)."""


@dataclass(frozen=True)
class ModelFootprint:
    """What a model holds in memory when served.

    Attributes:
        weight_bytes: the weights at the served dtype, bytes.
        kv_bytes_per_token: K and V of every layer for one token at the served dtype, bytes
            (``layers * 2 * kv_heads * head_dim * dtype_bytes``).
    """

    weight_bytes: int
    kv_bytes_per_token: int


def static_fraction(footprint: ModelFootprint, max_total_tokens: int, free_bytes: int) -> float:
    """The smallest ``--mem-fraction-static`` that fits ``footprint`` with a pool of
    ``max_total_tokens`` tokens in ``free_bytes`` of free host memory (as the launcher sees it),
    with headroom: ``need = 2 * weights + pool + 1 GiB`` over ``pre = free - min(4 GiB,
    free / 4)``.

    An unknown footprint (no weights found; SGLang reports a bad path itself) gets
    ``MIN_FRACTION``. Rounded up to 3 decimals and kept within ``[MIN_FRACTION, MAX_FRACTION]``
    (at the top the machine lacks the memory asked for; SGLang then sizes the pool smaller or
    fails, saying so).
    """
    if footprint.weight_bytes <= 0:
        return MIN_FRACTION
    pre = free_bytes - min(LAUNCH_RESERVE_BYTES, free_bytes // 4)
    if pre <= 0:
        return MAX_FRACTION
    need = (footprint.weight_bytes * (1 + WEIGHT_HEADROOM)
            + max_total_tokens * footprint.kv_bytes_per_token + OVERHEAD_BYTES)
    fraction = math.ceil(need / pre * 1000) / 1000
    return min(MAX_FRACTION, max(MIN_FRACTION, fraction))


def _weight_file_bytes(folder: Path) -> int:
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def footprint_of_folder(folder: Path, served_dtype: str = "float32") -> ModelFootprint:
    """The footprint of the HF model in ``folder`` when served at ``served_dtype``.

    Weights: the size of its weight files, scaled from the stored dtype (``config.json``'s
    ``dtype`` / ``torch_dtype``, float32 when absent) to the served one. Returns zeros for what
    cannot be read (the caller then falls back to the smallest fraction).
    """
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ModelFootprint(0, 0)
    text = config.get("text_config", config)
    served = DTYPE_BYTES.get(str(served_dtype).lower(), 4)
    stored = DTYPE_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
    weights = _weight_file_bytes(Path(folder)) * served // stored
    layers = int(text.get("num_hidden_layers", 0))
    heads = int(text.get("num_attention_heads", 1) or 1)
    kv_heads = int(text.get("num_key_value_heads", heads) or heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // heads)
    return ModelFootprint(weights, layers * 2 * kv_heads * head_dim * served)


def _cgroup_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def free_host_bytes() -> int:
    """Free host memory as SGLang's CPU path measures it: available memory, bounded by the
    cgroup's limit, divided by the NUMA nodes. 0 when it cannot be read."""
    try:
        import psutil
    except ImportError:
        return 0
    free = psutil.virtual_memory().available
    limit, used = _cgroup_int("/sys/fs/cgroup/memory.max"), _cgroup_int(
        "/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        free = min(free, max(0, limit - used))
    nodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")
                 and d[4:].isdigit()]) if os.path.isdir("/sys/devices/system/node") else 1
    return free // max(1, nodes)
