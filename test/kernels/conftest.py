"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else in Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before
any test module imports ``sglang_kvcmas.attention.triton_delta``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The extended grid (every size × rank × GQA ratio × page size) is opt-in; CI runs the default grid.
FULL_GRID = os.environ.get("KVCMAS_KERNEL_TESTS_FULL", "0").strip().lower() in ("1", "true", "yes")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
