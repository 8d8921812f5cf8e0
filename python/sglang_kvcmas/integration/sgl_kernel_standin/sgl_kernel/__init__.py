"""Stand-in for ``sgl_kernel`` on machines without it (CPU only). Every op raises.

SGLang's CPU engine imports ``sgl_kernel`` at module level in a few places but, for Llama-family
models on torch_native attention, never calls one of its ops; no CPU build of ``sgl_kernel`` is
on PyPI, so this module lets the server boot (``integration/cpu_runtime.py`` says when).

Any attribute looked up here is an op that raises :class:`NotImplementedError` naming itself
when called. If ``KVCMAS_SGL_KERNEL_STANDIN_LOG`` names a file, each call also appends one line
(``pid op``) to it before raising, so a test can prove that serving called no op even where
SGLang catches the exception.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

IS_KVCMAS_STANDIN = True
"""Marker: lets callers tell this module from a real ``sgl_kernel``."""

_LOG_ENV = "KVCMAS_SGL_KERNEL_STANDIN_LOG"  # declared in sglang_kvcmas.envs


class StandinOp:
    """A named ``sgl_kernel`` op that has no CPU implementation here."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__name__ = name
        self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        log_path = os.environ.get(_LOG_ENV)
        if log_path:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(f"{os.getpid()} {self.name}\n")
        raise NotImplementedError(
            f"sgl_kernel.{self.name} was called, but this process runs sglang-kvcmas's CPU "
            "stand-in for sgl_kernel (no real sgl_kernel is installed). This SGLang code path "
            "needs the real kernel package: install sglang-kernel on a CUDA machine, or choose "
            "a CPU path (--device cpu --attention-backend torch_native)."
        )

    def __repr__(self) -> str:
        return f"<sglang-kvcmas stand-in op sgl_kernel.{self.name}>"


def __getattr__(name: str) -> StandinOp:
    # Dunder lookups (__path__, __version__, ...) must fail normally, or import machinery and
    # feature probes would take this module for something it is not.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    op = StandinOp(name)
    globals()[name] = op
    return op
