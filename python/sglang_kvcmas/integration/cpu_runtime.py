"""What SGLang's server needs to run on a CPU-only machine, without editing SGLang's files.

Two things, both applied by the launcher to its own process before SGLang boots (spawned
scheduler and detokenizer processes inherit ``sys.path`` and the environment):

- ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU platform. It is only for server processes:
  in a frontend-only process it makes ``memory_pool`` import ``sgl_kernel`` for nothing.
- A raising ``sgl_kernel`` stand-in, put on the path only when no real ``sgl_kernel`` is
  installed. SGLang's CPU engine imports ``sgl_kernel`` but, for Llama-family models on
  torch_native attention, never calls its ops; if it ever does, the stand-in raises
  ``NotImplementedError`` naming the op (see ``sgl_kernel_standin/sgl_kernel/__init__.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"
"""Directory that, on ``sys.path``, makes ``import sgl_kernel`` load the stand-in."""


@dataclass(frozen=True)
class SglKernelStatus:
    """Which ``sgl_kernel`` a server process will import.

    Attributes:
        source: ``"real"`` (an installed sgl_kernel) or ``"standin"`` (ours, on the path).
        location: file or directory of the module that ``import sgl_kernel`` will load.
    """

    source: str
    location: str | None


def _real_sgl_kernel_location() -> str | None:
    """Where a real ``sgl_kernel`` is installed, ignoring our stand-in directory."""
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != STANDIN_DIR]
        if getattr(sys.modules.get("sgl_kernel"), "IS_KVCMAS_STANDIN", False):
            return None
        spec = importlib.util.find_spec("sgl_kernel")
    finally:
        sys.path[:] = saved
    return None if spec is None else (spec.origin or str(spec.submodule_search_locations))


def install_sgl_kernel_standin(environ: MutableMapping[str, str] | None = None) -> SglKernelStatus:
    """Make ``import sgl_kernel`` work in this process and its children, if it must.

    Does nothing when a real ``sgl_kernel`` is installed. Otherwise appends the stand-in
    directory to ``sys.path`` (inherited by spawned processes) and to ``PYTHONPATH`` in
    ``environ`` (default ``os.environ``; for any other child). Appending, not prepending: a real
    package always wins. Idempotent.
    """
    environ = os.environ if environ is None else environ
    real = _real_sgl_kernel_location()
    if real is not None:
        return SglKernelStatus("real", real)
    entry = str(STANDIN_DIR)
    if entry not in sys.path:
        sys.path.append(entry)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entry not in parts:
        environ["PYTHONPATH"] = os.pathsep.join([*parts, entry])
    return SglKernelStatus("standin", str(STANDIN_DIR / "sgl_kernel" / "__init__.py"))


def prepare_cpu_server_process(environ: MutableMapping[str, str] | None = None) -> SglKernelStatus:
    """Set up this (server) process to run SGLang's CPU engine. Call before importing sglang.srt.

    Sets ``SGLANG_USE_CPU_ENGINE=1`` unless the caller already chose a value, then installs the
    stand-in if needed.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    return install_sgl_kernel_standin(environ)
