"""Session-wide test setup.

Without a GPU, Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set before
triton is first imported in this process: triton decides then whether its own ``@jit`` library
functions (``tl.sum``, ``tl.max``, ...) are interpreted, and SGLang imports triton as soon as any
test imports ``sglang``. Servers started by tests drop the variable (``server/process.py``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
