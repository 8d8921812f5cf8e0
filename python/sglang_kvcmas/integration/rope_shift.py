"""The model's rotary embedding for the shift, taken from SGLang's own rotary modules, or a refusal.

The pool's keys were rotated by the model's ``RotaryEmbedding`` (built by SGLang's ``get_rope``):
a borrowed key is re-positioned by rotating it by the shift with that module's frequencies and
layout (``attention/rope.py``). This module turns one of SGLang's rotary modules into a
:class:`~sglang_kvcmas.attention.rope.ShiftRope` by calling the module's own
``_compute_inv_freq`` the way its ``_compute_cos_sin_cache`` does, checks the result against the
module's ``cos_sin_cache``, and refuses whatever the shift cannot represent.

Supported (each neox or GPT-J style, full or partial rotary): ``default``, ``linear`` (one
factor), ``dynamic`` (NTK scaling or alpha, at the base SGLang's cache was built with once at
init, not HF's per-length base), ``llama3`` and ``yarn`` (its ``mscale`` scales cos and sin, so
every stored key carries it once already and the shift rotates by the unscaled angle).

Refused (:class:`UnsupportedRope`, at the attention backend's start, naming the model and the
variant): multimodal rotary (``mrope_section``, a ``vision_config``), dual-chunk attention,
sliding-window or chunked attention layers (a shifted key would fall in or out of the window),
every other rotary module or ``rope_type`` (``longrope``, ``deepseek_yarn``, ``proportional``,
Fourier RoPE, ...), layers with different rotary embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.rotary_embedding.base import (
    LinearScalingRotaryEmbedding,
    RotaryEmbedding,
)
from sglang.srt.layers.rotary_embedding.rope_variant import (
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
)
from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

from sglang_kvcmas.attention.rope import ShiftRope, rope_cos_sin

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
"""``rope_type`` values of a config the shift supports (see the module docstring)."""

CHECK_POSITIONS = 4096
"""Rows of a module's ``cos_sin_cache`` the derived frequencies are checked against."""


class UnsupportedRope(ValueError):
    """The model's rotary embedding is one the shift cannot re-position exactly."""


def _refuse(model: str, variant: str) -> UnsupportedRope:
    return UnsupportedRope(
        f"sglang-kvcmas: --kvcmas-share-context cannot re-position the keys of model {model}: "
        f"{variant} is not supported (supported: RoPE types {', '.join(SUPPORTED_ROPE_TYPES)}; "
        "neox or GPT-J style, full or partial rotary; every layer full attention with one "
        "rotary embedding). Serve this model without --kvcmas-share-context."
    )


def model_label(path: str | None, config: Any) -> str:
    """``path (Architecture)`` for messages."""
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    return f"{path or '?'} ({', '.join(map(str, archs))})"


# --- config ---------------------------------------------------------------------------------


def rope_config(config: Any) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` as SGLang's Llama layer reads them (transformers v5
    ``rope_parameters`` or v4 ``rope_theta`` / ``rope_scaling``; a top-level
    ``original_max_position_embeddings`` copied in). The dict is a copy."""
    params = getattr(config, "rope_parameters", None)
    if params is not None:
        theta, scaling = params.get("rope_theta", getattr(config, "rope_theta", 10000)), params
    else:
        theta = getattr(config, "rope_theta", 10000)
        scaling = getattr(config, "rope_scaling", None)
    scaling = dict(scaling) if scaling is not None else None
    if scaling is not None and getattr(config, "original_max_position_embeddings", None):
        scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
    return float(theta), scaling


def rope_type_of(scaling: Mapping | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_config(config: Any, model: str) -> None:
    """Refuse, from the model's config alone, what the shift cannot support.

    Raises:
        UnsupportedRope: naming ``model`` and the variant.
    """
    if getattr(config, "vision_config", None) is not None:
        raise _refuse(model, "a multimodal model (vision_config; multimodal rotary positions)")
    if getattr(config, "dual_chunk_attention_config", None) is not None:
        raise _refuse(model, "dual-chunk attention (dual_chunk_attention_config)")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        raise _refuse(model, f"sliding-window attention (sliding_window={window})")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({str(t) for t in layer_types} - {"full_attention"})
    if other:
        raise _refuse(model, f"attention layers of type {', '.join(other)} (layer_types)")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise _refuse(model, f"chunked attention (attention_chunk_size="
                             f"{config.attention_chunk_size})")
    _, scaling = rope_config(config)
    kind = rope_type_of(scaling)
    if scaling and "mrope_section" in scaling:
        raise _refuse(model, f"multimodal rotary (mrope_section, rope_type {kind!r})")
    if scaling and scaling.get("use_fope"):
        raise _refuse(model, "Fourier RoPE (use_fope)")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise _refuse(model, f"rope_type {kind!r}")


def rope_module_of_config(config: Any) -> RotaryEmbedding:
    """The rotary module SGLang's Llama layer builds for this config (``get_rope`` with its
    arguments: ``head_dim``, ``partial_rotary_factor``, ``rope_is_neox_style``, ...)."""
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    theta, scaling = rope_config(config)
    return get_rope(
        int(head_dim),
        rotary_dim=int(getattr(config, "partial_rotary_factor", 1) * head_dim),
        max_position=getattr(config, "max_position_embeddings", 8192),
        base=theta,
        is_neox_style=getattr(config, "rope_is_neox_style", True),
        rope_scaling=scaling,
        dtype=torch.float32,
    )


def shift_rope_from_config(config: Any, model: str = "?") -> ShiftRope:
    """The shift's rotary for a model config: refusals first, then SGLang's own module.

    Raises:
        UnsupportedRope: naming ``model`` and the variant.
    """
    check_config(config, model)
    try:
        module = rope_module_of_config(config)
    except ValueError as e:  # get_rope's own refusals (an unknown scaling type)
        raise _refuse(model, f"rotary configuration ({e})") from e
    return shift_rope_of_module(module, model)


# --- SGLang's rotary modules -----------------------------------------------------------------


def _default(m: RotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    return m._compute_inv_freq(m.base), 1.0, "default"


def _linear(m: LinearScalingRotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    if len(m.scaling_factors) != 1:
        raise ValueError(f"linear scaling with several factors {m.scaling_factors}")
    factor = float(m.scaling_factors[0])
    return m._compute_inv_freq(m.base) / factor, 1.0, f"linear (factor {factor})"


def _dynamic(m: DynamicNTKScalingRotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    # SGLang's cache is built once at init with this base (its _compute_cos_sin_cache).
    max_len = m.max_position_embeddings * m.scaling_factor
    base = m.base * (
        (m.scaling_factor * max_len / m.max_position_embeddings) - (m.scaling_factor - 1)
    ) ** (m.rotary_dim / (m.rotary_dim - 2))
    return m._compute_inv_freq(base), 1.0, f"dynamic NTK (factor {m.scaling_factor})"


def _dynamic_alpha(m: DynamicNTKAlphaRotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    base = m.base * m.scaling_alpha ** (m.rotary_dim / (m.rotary_dim - 2))
    return m._compute_inv_freq(base), 1.0, f"dynamic NTK (alpha {m.scaling_alpha})"


def _llama3(m: Llama3RotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    return m._compute_inv_freq(m.base), 1.0, f"llama3 (factor {m.scaling_factor})"


def _yarn(m: YaRNScalingRotaryEmbedding) -> tuple[torch.Tensor, float, str]:
    return (m._compute_inv_freq(m.scaling_factor), float(m.mscale),
            f"yarn (factor {m.scaling_factor})")


_DERIVE: dict[type, Callable[[Any], tuple[torch.Tensor, float, str]]] = {
    RotaryEmbedding: _default,
    LinearScalingRotaryEmbedding: _linear,
    DynamicNTKScalingRotaryEmbedding: _dynamic,
    DynamicNTKAlphaRotaryEmbedding: _dynamic_alpha,
    Llama3RotaryEmbedding: _llama3,
    YaRNScalingRotaryEmbedding: _yarn,
}
"""Exact module type -> (inv_freq, attention factor, variant); subclasses (mrope, ...) are not
covered by their parent's entry."""


def shift_rope_of_module(module: torch.nn.Module, model: str = "?") -> ShiftRope:
    """The shift's rotary for one of SGLang's rotary modules, checked against its cache.

    Raises:
        UnsupportedRope: a module type not in the table above, or frequencies that do not
            reproduce the module's ``cos_sin_cache``.
    """
    derive = _DERIVE.get(type(module))
    if derive is None:
        raise _refuse(model, f"rotary module {type(module).__name__}")
    try:
        inv_freq, factor, variant = derive(module)
    except ValueError as e:
        raise _refuse(model, str(e)) from e
    if getattr(module, "position_start", 0):
        raise _refuse(model, f"{variant} with position_start {module.position_start}")
    rope = ShiftRope(
        inv_freq.detach().to("cpu", torch.float32), int(module.head_size),
        neox=bool(module.is_neox_style), attention_factor=factor, variant=variant,
    )
    _check_against_cache(rope, module.cos_sin_cache, model)
    return rope


def _check_against_cache(rope: ShiftRope, cache: torch.Tensor, model: str) -> None:
    """cos and sin at the cache's first rows, times the attention factor, equal the cache."""
    n = min(int(cache.shape[0]), CHECK_POSITIONS)
    cache = cache[:n].detach().to("cpu", torch.float32)
    if cache.shape[-1] != rope.rotary_dim:
        raise _refuse(model, f"{rope.variant} with a cos_sin_cache of width {cache.shape[-1]} "
                             f"for rotary_dim {rope.rotary_dim}")
    cos, sin = rope_cos_sin(torch.arange(n), rope.inv_freq)
    ours = torch.cat([cos, sin], dim=-1) * rope.attention_factor
    tol = 1e-3 if cache.dtype == torch.float32 else 3e-2
    err = float((ours - cache).abs().max()) if n else 0.0
    if err > tol:
        raise _refuse(model, f"{rope.variant} whose frequencies do not reproduce SGLang's "
                             f"cos_sin_cache (max error {err:.2e})")


def rotary_modules(model: torch.nn.Module | None) -> list[torch.nn.Module]:
    """Every distinct rotary module in a loaded model (SGLang shares one between layers with the
    same arguments): instances of ``RotaryEmbedding`` and any module whose class name ends in
    ``RotaryEmbedding``."""
    if model is None:
        return []
    seen: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        if isinstance(m, RotaryEmbedding) or type(m).__name__.endswith("RotaryEmbedding"):
            seen.setdefault(id(m), m)
    return list(seen.values())


def shift_rope_for_model(
    config: Any, modules: Iterable[torch.nn.Module], model: str = "?"
) -> ShiftRope:
    """The shift's rotary of a loaded model: its config's refusals, then the rotary modules its
    layers actually use (the config's module when none is found); all must agree.

    Raises:
        UnsupportedRope: naming ``model`` and the variant.
    """
    check_config(config, model)
    ropes = [shift_rope_of_module(m, model) for m in modules]
    if not ropes:
        return shift_rope_from_config(config, model)
    if any(not r.same_as(ropes[0]) for r in ropes[1:]):
        raise _refuse(model, "layers with different rotary embeddings "
                             f"({', '.join(sorted({r.variant for r in ropes}))})")
    return ropes[0]


def shift_rope_for_runner(model_runner: Any) -> ShiftRope:
    """:func:`shift_rope_for_model` of an SGLang ``ModelRunner`` (its loaded model, if any)."""
    mc = model_runner.model_config
    config = getattr(mc, "hf_config", None)
    model = model_label(getattr(mc, "model_path", None), config)
    if getattr(config, "vision_config", None) is None:
        config = getattr(mc, "hf_text_config", None) or config
    return shift_rope_for_model(config, rotary_modules(getattr(model_runner, "model", None)),
                                model)
