"""The environment variables of the process, the install scripts and the tests, declared once.

Serving knobs (``KVCMAS_SHARE_CONTEXT``, ``KVCMAS_RECOMPUTE_BOUNDARY``, ...) are not here: each is a
typed field of ``config.ServingConfig``, which derives its variable, flag and request field.
Each variable here is read when asked for (not at import), so tests can set it with ``monkeypatch``.
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


def cache_dir() -> Path:
    """Where converted models and other derived artifacts are kept: ``sglang-kvcmas`` under the
    user's standard cache directory (``$XDG_CACHE_HOME``, default ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-kvcmas"


KVCMAS_SGL_KERNEL_STANDIN_LOG = EnvVar(
    "KVCMAS_SGL_KERNEL_STANDIN_LOG",
    "",
    "If set, a file to which the sgl_kernel stand-in appends one line per op call (tests).",
)

# ----- tests and scripts (read where they are used; declared here so they are listed once) -----
KVCMAS_KERNEL_TESTS_FULL = EnvVar(
    "KVCMAS_KERNEL_TESTS_FULL",
    "0",
    "Kernel tests: run the full cross product of sizes x ranks x GQA x page sizes (slow in the "
    "Triton interpreter; scripts/gpu_check.sh turns it on).",
)
KVCMAS_GPU = EnvVar(
    "KVCMAS_GPU",
    "0",
    "scripts/install.sh: also install the CUDA extras (sglang-kernel, FlashInfer).",
)
KVCMAS_GPU_CHECK_QUICK = EnvVar(
    "KVCMAS_GPU_CHECK_QUICK",
    "1",
    "scripts/gpu_check.sh: the quick benchmark grid (0 for the full one).",
)

KVCMAS_SPARE_PREFILL = EnvVar(
    "KVCMAS_SPARE_PREFILL",
    "1",
    "Tests and read-path benchmarks: 0 turns the spare pass off (policy/turn_order.py: "
    "is_spare), so readers borrow on an idle server too (read once per scheduler).",
)
KVCMAS_BENCH_SERVER_ARGS = EnvVar(
    "KVCMAS_BENCH_SERVER_ARGS",
    "",
    "Benchmarks: launcher flags every arm's server gets after the benchmark's own (a GPU run: "
    "'--device cuda --dtype bfloat16 --mem-fraction-static 0.8'; scripts/gpu_check.sh --server).",
)

ALL = (KVCMAS_SGL_KERNEL_STANDIN_LOG, KVCMAS_KERNEL_TESTS_FULL, KVCMAS_GPU, KVCMAS_GPU_CHECK_QUICK,
       KVCMAS_SPARE_PREFILL, KVCMAS_BENCH_SERVER_ARGS)
