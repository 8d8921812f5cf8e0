"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else in Triton's interpreter.

``TRITON_INTERPRET`` must be set before triton is first imported (the root ``test/conftest.py`` does
it for the whole session when there is no GPU: SGLang tests import triton early), and is read again
lazily while the interpreter runs, so it is also set around each test of this folder.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_kvcmas import envs

# The extended grid (every size × rank × GQA ratio × page size) is opt-in; CI runs the default grid.
FULL_GRID = envs.KVCMAS_KERNEL_TESTS_FULL.get_bool()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
