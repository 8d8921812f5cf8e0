"""Every served Triton kernel compiles for Ampere and Hopper GPUs, on a machine without one.

The interpreter the other kernel tests use on CPU runs kernels as Python: it accepts code that
Triton's compiler refuses, such as a kernel reading a module global that is not a
``tl.constexpr``. Here each kernel goes through the real compiler (to PTX and cubin for
``sm_80`` and ``sm_90``) in a subprocess without ``TRITON_INTERPRET``, so such an error fails
CI rather than the first batch on a user's GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

# Compiles each kernel with a typical signature: pointer arguments by name, the rest int32.
_SCRIPT = r"""
import inspect
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_kvcmas.attention import triton_delta_kernels as kd, triton_head_mass as hm

BF16 = {"q", "o", "k_buffer", "v_buffer"}
FP32 = {"mid_o", "mid_lse", "k_u", "k_c", "v_u", "v_c", "inv_freq", "out"}
INT32_PTR = {"kv_indices", "qo_indptr", "kv_indptr", "q_pos", "k_pos"}
SCALARS = {"qk_scale": "fp32", "scale_log2": "fp32"}
TILES = dict(BLOCK_M=32, BLOCK_N=64, HALF=64, BLOCK_R=16, DOT_PREC="tf32")
KERNELS = [
    (kd._delta_extend_kernel, TILES, BF16),
    (kd._delta_decode_kernel, dict(TILES, BLOCK_M=16), BF16),
    (kd._merge_splits_kernel, dict(BLOCK_S=4, HEAD=64), {"o"}),
    (hm._head_mass_kernel, dict(GROUP=3, D=64, BLOCK_D=64, BLOCK_Q=32, BLOCK_K=64),
     {"q", "k"}),
]
for fn, consts, bf16 in KERNELS:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in bf16:
            sig[name] = "*bf16"
        elif name in FP32:
            sig[name] = "*fp32"
        elif name in INT32_PTR or name.startswith("tile_"):
            sig[name] = "*i32"
        else:
            sig[name] = SCALARS.get(name, "i32")
    target = GPUTarget("cuda", int(sys.argv[1]), 32)
    compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
    assert compiled.asm["cubin"], fn.fn.__name__
    print("compiled", fn.fn.__name__)
"""


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles(arch: int, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2] / "python"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(arch)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled") == 4, done.stdout
