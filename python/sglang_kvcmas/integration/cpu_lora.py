"""SGLang's LoRA serving on a machine without an accelerator (the ``torch_native`` LoRA backend).

SGLang's LoRA layers and its ``torch_native`` backend compute with plain PyTorch, so they run on
CPU, but they allocate their small host-side index tensors with ``pin_memory=True`` (page-locked
memory for host-to-GPU copies), which PyTorch refuses without an accelerator. With nothing to
copy to, pinning is a no-op here: this module wraps the ``torch_native`` entry of SGLang's LoRA
backend registry so that, when the backend is created in a process without an accelerator, the
LoRA modules get a ``torch`` whose tensor factories ignore ``pin_memory`` and
``Tensor.pin_memory()`` returns the tensor itself. Nothing changes on a machine with an
accelerator, and nothing is patched unless LoRA is enabled.

The launcher makes ``torch_native`` the LoRA backend on CPU (SGLang's default is a Triton
kernel). Without an accelerator the entry also gives SGLang a subclass of its backend,
:func:`grouped_backend`, whose linear LoRA ops group a batch's tokens by adapter (the same math,
far less time per decode step; see ``lora/grouped_ops.py``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from sglang_kvcmas.lora.grouped_ops import AdapterGroups, lora_a, lora_b

logger = logging.getLogger(__name__)

BACKEND = "torch_native"
"""The LoRA backend this applies to (SGLang's registry name)."""

LORA_MODULES = (
    "sglang.srt.lora.layers",
    "sglang.srt.lora.mem_pool",
    "sglang.srt.lora.lora",
    "sglang.srt.lora.lora_manager",
    "sglang.srt.lora.backend.base_backend",
    "sglang.srt.lora.backend.torch_backend",
)
"""SGLang modules whose ``torch`` global gets the pin-free factories."""

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor", "empty_like",
              "zeros_like", "ones_like")


def accelerator_present() -> bool:
    """Whether this process can page-lock memory for a device (CUDA, ROCm, XPU, NPU...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def _drop_pin(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return factory


class _PinFreeTorch(types.ModuleType):
    """``torch`` as seen by SGLang's LoRA modules on a CPU-only machine: the same module, but the
    tensor factories accept and ignore ``pin_memory``."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _drop_pin(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _unpinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def make_lora_cpu_safe() -> bool:
    """Apply the pin-free ``torch`` to SGLang's LoRA modules when no accelerator is present.

    Returns whether it applied (idempotent). ``Tensor.pin_memory`` is replaced process-wide, but
    only with the identity, and only where the original would raise.
    """
    if accelerator_present():
        return False
    if torch.Tensor.pin_memory is not _unpinned:
        torch.Tensor.pin_memory = _unpinned
    shim = _PinFreeTorch()
    for name in LORA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = shim
    logger.info("sglang-kvcmas: no accelerator: SGLang's LoRA modules allocate without pinning")
    return True


def grouped_backend(base: type) -> type:
    """A subclass of SGLang's ``TorchNativeLoRABackend`` (``base``) whose linear LoRA ops run
    grouped by adapter (``lora/grouped_ops.py``); embeddings, MoE and graph batches keep
    SGLang's ops."""

    class GroupedTorchLoRABackend(base):  # type: ignore[misc, valid-type]
        _kvcmas_groups: tuple[Any, AdapterGroups | None] = (None, None)

        def _groups_for(self, x: torch.Tensor) -> AdapterGroups | None:
            """The batch's groups (built once per batch) when they cover ``x``'s tokens, else
            None (SGLang's ops)."""
            info = self.batch_info
            cached_for, groups = self._kvcmas_groups
            if cached_for is not info:
                groups = None
                if info is not None and not info.use_cuda_graph and \
                        getattr(info, "seg_lens_cpu", None) is not None:
                    groups = AdapterGroups.build(
                        info.seg_lens_cpu.tolist(), info.weight_indices_cpu.tolist(),
                        info.lora_ranks_cpu.tolist(), info.scalings_cpu.tolist())
                self._kvcmas_groups = (info, groups)
            return groups if groups is not None and groups.num_tokens == x.shape[0] else None

        def run_lora_a_sgemm(self, x, weights, stack_num=1, *args, **kwargs):
            groups = self._groups_for(x)
            if groups is None:
                return super().run_lora_a_sgemm(x, weights, stack_num, *args, **kwargs)
            return lora_a(x, weights, groups, stack_num)

        def run_lora_b_sgemm(self, x, weights, output_offset_cpu, base_output=None, *args,
                             **kwargs):
            groups = self._groups_for(x)
            if groups is None:
                return super().run_lora_b_sgemm(x, weights, output_offset_cpu, base_output,
                                                *args, **kwargs)
            return lora_b(x, weights, groups, output_offset_cpu.tolist(), base_output)

        def run_qkv_lora(self, x, qkv_lora_a, qkv_lora_b, output_offset, output_offset_cpu,
                         max_qkv_out_dim, base_output=None, n_slices=3, *args, **kwargs):
            groups = self._groups_for(x)
            if groups is None:
                return super().run_qkv_lora(x, qkv_lora_a, qkv_lora_b, output_offset,
                                            output_offset_cpu, max_qkv_out_dim, base_output,
                                            n_slices, *args, **kwargs)
            return lora_b(lora_a(x, qkv_lora_a, groups, n_slices), qkv_lora_b, groups,
                          output_offset_cpu.tolist(), base_output)

        def run_gate_up_lora(self, x, gate_up_lora_a, gate_up_lora_b, output_offset_cpu,
                             base_output=None, *args, **kwargs):
            groups = self._groups_for(x)
            if groups is None:
                return super().run_gate_up_lora(x, gate_up_lora_a, gate_up_lora_b,
                                                output_offset_cpu, base_output, *args, **kwargs)
            offsets = output_offset_cpu.tolist()
            return lora_b(lora_a(x, gate_up_lora_a, groups, len(offsets) - 1), gate_up_lora_b,
                          groups, offsets, base_output)

    GroupedTorchLoRABackend.__qualname__ = GroupedTorchLoRABackend.__name__
    return GroupedTorchLoRABackend


def register_cpu_lora_backend() -> None:
    """Wrap the ``torch_native`` entry of SGLang's LoRA backend registry (once): creating that
    backend first makes the LoRA modules CPU-safe (see the module docstring)."""
    from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS

    original = LORA_SUPPORTED_BACKENDS.get(BACKEND)
    if original is None or getattr(original, "_kvcmas_cpu_safe", False):
        return

    def create_torch_native_backend() -> Any:
        if not make_lora_cpu_safe():
            return original()
        return grouped_backend(original())

    create_torch_native_backend._kvcmas_cpu_safe = True  # type: ignore[attr-defined]
    LORA_SUPPORTED_BACKENDS[BACKEND] = create_torch_native_backend
