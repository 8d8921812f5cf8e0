"""SGLang's ``torch_native`` LoRA backend made to run without an accelerator (``cpu_lora``).

Each check runs in a fresh interpreter: the shim changes module globals of SGLang's LoRA modules
and ``Tensor.pin_memory`` for the process, which the test process must not inherit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from sglang_kvcmas.integration.cpu_lora import accelerator_present

pytestmark = pytest.mark.skipif(accelerator_present(), reason="the shim only acts without one")


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_without_the_shim_sglangs_lora_layers_cannot_allocate_on_cpu():
    # The reason for the shim: what SGLang's LoRA layers do in their constructors.
    with pytest.raises(RuntimeError):
        torch.tensor([0, 1], dtype=torch.int32, device="cpu", pin_memory=True)


def test_creating_the_torch_native_backend_makes_the_lora_modules_cpu_safe():
    out = run("""
        from sglang_kvcmas.integration.registration import register_all
        register_all()
        from sglang.srt.lora.backend.lora_registry import get_backend_from_name
        from sglang.srt.lora import layers
        from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
        import torch
        assert layers.torch is torch  # untouched until a LoRA backend is created
        cls = get_backend_from_name("torch_native")
        assert cls is TorchNativeLoRABackend
        t = layers.torch.tensor([0, 5], dtype=torch.int32, device="cpu", pin_memory=True)
        assert t.tolist() == [0, 5] and t.cpu().pin_memory() is not None
        assert layers.torch.zeros(3, pin_memory=True).shape == (3,)
        assert layers.torch.cat is torch.cat  # everything else is torch itself
        register_all()  # idempotent: the registry entry is wrapped once
        assert get_backend_from_name("torch_native") is TorchNativeLoRABackend
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_other_backends_are_left_alone():
    out = run("""
        from sglang_kvcmas.integration.registration import register_all
        register_all()
        from sglang.srt.lora.backend import lora_registry
        from sglang.srt.lora import layers
        import torch
        assert getattr(lora_registry.LORA_SUPPORTED_BACKENDS["triton"], "_kvcmas_cpu_safe",
                       False) is False
        assert layers.torch is torch
        print("ok")
    """)
    assert out.strip().endswith("ok")
