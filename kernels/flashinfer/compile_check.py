"""Compile the sglang-kvcmas FlashInfer variant with this machine's nvcc (no GPU needed).

Renders ``delta_variant.cuh`` into FlashInfer's FA2 batch-prefill template exactly as
``DeltaFlashInferWrapper`` does at run time, then runs nvcc on the generated kernel sources through
FlashInfer's own ninja file. Object files only: linking needs libcuda, which CPU machines lack.

    FLASHINFER_CUDA_ARCH_LIST=9.0a python kernels/flashinfer/compile_check.py [--all] [--dtype bf16]

Default: the causal paged kernel (the one the wrapper launches), one dtype, head_dim 64; ``--all``
compiles every generated object (paged and ragged kernels for 4 mask modes, host code,
binding). Needs ``flashinfer-python``
importable (``pip install --no-deps flashinfer-python==0.7.2.post1 nvidia-ml-py``); FlashInfer's JIT
cache goes to ``$FLASHINFER_WORKSPACE_BASE`` (default: a folder under the system temp dir, never
``$HOME``). Exit status 0 means every requested object compiled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="compile every generated object")
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault(
        "FLASHINFER_WORKSPACE_BASE", str(Path(tempfile.gettempdir()) / "kvcmas-fi")
    )
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "8.0")
    import torch
    from flashinfer.jit.attention import gen_customize_batch_prefill_module
    from sglang_kvcmas_lab.attention.flashinfer_delta import jit_args

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    spec = gen_customize_batch_prefill_module("fa2", *jit_args(dtype, args.head_dim))
    spec.write_ninja()
    # Object targets as FlashInfer's ninja file names them (``build <object>: cuda_compile ...``).
    objects = [
        Path(line.split(":", 1)[0].split(None, 1)[1])
        for line in spec.ninja_path.read_text().splitlines()
        if line.startswith("build ") and ".o: " in line
    ]
    if not args.all:
        objects = [o for o in objects if "paged_kernel_mask_1" in o.name]  # causal, paged
    targets = [str(o) for o in objects]
    print(f"[compile-check] arch {os.environ['FLASHINFER_CUDA_ARCH_LIST']}, {spec.build_dir}")
    print(f"[compile-check] targets: {' '.join(o.name for o in objects)}", flush=True)
    t0 = time.time()
    jobs = os.environ.get("MAX_JOBS", "1")
    proc = subprocess.run(["ninja", "-C", str(spec.build_dir), "-j", jobs, *targets])
    elapsed = time.time() - t0
    ok = proc.returncode == 0 and all(o.exists() for o in objects)
    print(
        f"[compile-check] {'ok' if ok else 'FAILED'}: {len(objects)} object(s) in {elapsed:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
