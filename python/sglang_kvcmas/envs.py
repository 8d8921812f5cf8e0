"""Every environment variable sglang-kvcmas reads, declared once.

Each is read when asked for (not at import), so tests can set them with ``monkeypatch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        return self.get().strip().lower() in ("1", "true", "yes", "on")


KVCMAS_CACHE_DIR = EnvVar(
    "KVCMAS_CACHE_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-kvcmas"),
    "Where converted models and other derived artifacts are kept.",
)
KVCMAS_ALLOW_SGL_KERNEL_STANDIN = EnvVar(
    "KVCMAS_ALLOW_SGL_KERNEL_STANDIN",
    "1",
    "Allow the raising sgl_kernel stand-in when no real sgl_kernel is installed (CPU only).",
)

KVCMAS_SGL_KERNEL_STANDIN_LOG = EnvVar(
    "KVCMAS_SGL_KERNEL_STANDIN_LOG",
    "",
    "If set, a file to which the sgl_kernel stand-in appends one line per op call (tests).",
)

ALL = (KVCMAS_CACHE_DIR, KVCMAS_ALLOW_SGL_KERNEL_STANDIN, KVCMAS_SGL_KERNEL_STANDIN_LOG)
