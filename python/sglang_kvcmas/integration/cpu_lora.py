"""SGLang's LoRA serving on a machine without an accelerator (the ``torch_native`` LoRA backend).

SGLang's LoRA layers and its ``torch_native`` backend compute with plain PyTorch, so they run on
CPU, but they allocate their small host-side index tensors with ``pin_memory=True`` (page-locked
memory, an optimisation for host-to-GPU copies), which PyTorch refuses without an accelerator
("Found no NVIDIA driver"). With no accelerator there is nothing to copy to, so pinning is a
no-op here: this module wraps the ``torch_native`` entry of SGLang's LoRA backend registry so
that, when the backend is created in a process without an accelerator (i.e. when a LoRA server
boots on CPU), the LoRA modules get a ``torch`` whose tensor factories ignore ``pin_memory`` and
``Tensor.pin_memory()`` returns the tensor itself (it would raise otherwise). Nothing changes on a
machine with an accelerator, and nothing is patched unless LoRA is enabled.

The launcher makes ``torch_native`` the LoRA backend on CPU (SGLang's default, ``csgmv``, is a
Triton kernel that needs a GPU).
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from typing import Any, Callable

import torch

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


def register_cpu_lora_backend() -> None:
    """Wrap the ``torch_native`` entry of SGLang's LoRA backend registry (once): creating that
    backend first makes the LoRA modules CPU-safe (see the module docstring)."""
    from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS

    original = LORA_SUPPORTED_BACKENDS.get(BACKEND)
    if original is None or getattr(original, "_kvcmas_cpu_safe", False):
        return

    def create_torch_native_backend() -> Any:
        make_lora_cpu_safe()
        return original()

    create_torch_native_backend._kvcmas_cpu_safe = True  # type: ignore[attr-defined]
    LORA_SUPPORTED_BACKENDS[BACKEND] = create_torch_native_backend
