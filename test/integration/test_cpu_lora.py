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
        assert issubclass(cls, TorchNativeLoRABackend) and cls.__name__ == "GroupedTorchLoRABackend"
        t = layers.torch.tensor([0, 5], dtype=torch.int32, device="cpu", pin_memory=True)
        assert t.tolist() == [0, 5] and t.cpu().pin_memory() is not None
        assert layers.torch.zeros(3, pin_memory=True).shape == (3,)
        assert layers.torch.cat is torch.cat  # everything else is torch itself
        register_all()  # idempotent: the registry entry is wrapped once
        assert get_backend_from_name("torch_native").__name__ == "GroupedTorchLoRABackend"
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_the_grouped_backend_runs_a_batch_as_sglangs_ops_do():
    # A real TorchNativeLoRABackend batch (segments, ranks, scalings on its batch info), run
    # through the grouped subclass and through SGLang's own ops.
    out = run("""
        import torch
        from sglang.srt.lora.backend.torch_backend import (TorchNativeLoRABackend,
                                                            TorchNativeLoRABatchInfo)
        from sglang_kvcmas.integration.cpu_lora import grouped_backend, make_lora_cpu_safe
        make_lora_cpu_safe()
        seg_lens, slots, ranks, scalings = [1, 1, 30, 1, 1], [1, 2, 1, 0, 2], [0, 4, 8], \
            [0.0, 2.0, 0.5]
        info = TorchNativeLoRABatchInfo(
            bs=5, num_segments=5, max_len=30, use_cuda_graph=False,
            seg_lens=torch.tensor(seg_lens, dtype=torch.int32), seg_indptr=None,
            weight_indices=torch.tensor(slots, dtype=torch.int32),
            lora_ranks=torch.tensor(ranks, dtype=torch.int32),
            scalings=torch.tensor(scalings), permutation=None)
        info.seg_lens_cpu, info.weight_indices_cpu = info.seg_lens, info.weight_indices
        info.lora_ranks_cpu, info.scalings_cpu = info.lora_ranks, info.scalings
        stock = TorchNativeLoRABackend(3, torch.device("cpu"))
        ours = grouped_backend(TorchNativeLoRABackend)(3, torch.device("cpu"))
        stock.batch_info = ours.batch_info = info
        g = torch.Generator().manual_seed(0)
        x = torch.randn(34, 12, generator=g)
        a, b = torch.randn(3, 3 * 8, 12, generator=g), torch.randn(3, 28, 8, generator=g)
        off = torch.tensor([0, 12, 20, 28], dtype=torch.int32)
        base = torch.randn(34, 28, generator=g)
        args = dict(x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=off, output_offset_cpu=off,
                    max_qkv_out_dim=12)
        want = stock.run_qkv_lora(base_output=base.clone(), **args)
        got = ours.run_qkv_lora(base_output=base.clone(), **args)
        torch.testing.assert_close(got, want)
        assert torch.equal(got[32], base[32])  # the base model's token
        gu_b = torch.randn(3, 16, 8, generator=g)
        off2 = torch.tensor([0, 8, 16], dtype=torch.int32)
        want = stock.run_gate_up_lora(x=x, gate_up_lora_a=a[:, :16], gate_up_lora_b=gu_b,
                                      output_offset=off2, output_offset_cpu=off2)
        got = ours.run_gate_up_lora(x=x, gate_up_lora_a=a[:, :16], gate_up_lora_b=gu_b,
                                    output_offset=off2, output_offset_cpu=off2)
        torch.testing.assert_close(got, want)
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
