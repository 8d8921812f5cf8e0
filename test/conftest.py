"""Session-wide test setup.

Without a GPU, Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set before
triton is first imported in this process: triton decides then whether its own ``@jit`` library
functions (``tl.sum``, ``tl.max``, ...) are interpreted, and SGLang imports triton as soon as any
test imports ``sglang``. Servers started by tests drop the variable (``server/process.py``).

Servers started by tests run with the spare pass off (``KVCMAS_SPARE_PREFILL=0``): most server
tests measure what a reader borrows, one request at a time, which on an idle server the spare
pass would serve exactly. The tests of the spare pass turn it on for their own server.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("KVCMAS_SPARE_PREFILL", "0")
