"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else in Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined (and again lazily while the
interpreter runs), so this conftest imports ``sglang_kvcmas.attention.triton_delta`` with it set and
sets it around each test of this folder, leaving the rest of the session untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_kvcmas import envs

if not torch.cuda.is_available():
    # NOTE: set while our kernels are defined and while these tests run (the interpreter imports more
    # of triton lazily and checks the flag again), never process-wide: that would also turn later
    # @triton.jit code of other tests into interpreted functions and leak into servers they start.
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import sglang_kvcmas.attention.triton_delta  # noqa: F401
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous

# The extended grid (every size × rank × GQA ratio × page size) is opt-in; CI runs the default grid.
FULL_GRID = envs.KVCMAS_KERNEL_TESTS_FULL.get_bool()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
