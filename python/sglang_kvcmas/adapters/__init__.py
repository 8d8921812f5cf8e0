"""LoRA role adapters (planner, solver, critic) and their role data.

The embedded model's adapters ship as package data under ``roles/<config>/<role>/`` (peft
format, fp16 weights); another known model's, where trained, under
``roles/<model>/<config>/<role>/`` (``<model>``: its short name with ``.`` and ``-`` as ``_``).
``scripts/train_role_adapters.py`` reproduces them.
"""

from __future__ import annotations

from pathlib import Path

from sglang_kvcmas.adapters.role_data import ROLES

__all__ = ["ADAPTER_CONFIGS", "ROLES", "role_adapter_dir"]

# name -> peft target modules (rank 8, alpha 16 for all).
ADAPTER_CONFIGS: dict[str, tuple[str, ...]] = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def role_adapter_dir(config: str, role: str, model: str | None = None) -> Path:
    """Folder of a shipped adapter (adapter_config.json + adapter_model.safetensors) of the
    embedded model (``model`` None or ``"embedded"``) or of the known model ``model``."""
    if config not in ADAPTER_CONFIGS or role not in ROLES:
        raise KeyError(f"unknown adapter {config}/{role}")
    roles = Path(__file__).parent / "roles"
    if model in (None, "embedded"):
        return roles / config / role
    return roles / model.replace(".", "_").replace("-", "_") / config / role
