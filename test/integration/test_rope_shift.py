"""The shift against SGLang's own rotary modules: for every supported RoPE variant, keys rotated by
SGLang at positions p and shifted by d on our path equal SGLang rotating them at p + d directly;
and the refusals, with their messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.rope import ShiftRope, rope_inv_freq
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.span_reads import rotate_keys, transform_spans
from sglang_kvcmas.attention.spans import KeyShifts, RowSpans, SharedSpan
from sglang_kvcmas.integration import rope_shift
from sglang_kvcmas.integration.rope_shift import (
    UnsupportedRope,
    rope_module_of_config,
    shift_rope_for_model,
    shift_rope_for_runner,
    shift_rope_from_config,
)

MAX_ERR: dict[str, float] = {}
"""Largest |ours − SGLang| per variant (printed with ``pytest -s``)."""


@pytest.fixture(autouse=True)
def _sglang_cpu_rope(monkeypatch):
    """SGLang's rotary modules as its CPU engine builds them (no CUDA kernel fallback)."""
    from sglang.srt.layers.rotary_embedding import base

    monkeypatch.setattr(base, "_is_cpu", True)


def _config(head_dim=64, theta=10000.0, scaling=None, max_pos=4096, **extra):
    return SimpleNamespace(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                           max_position_embeddings=max_pos, rope_theta=theta,
                           rope_scaling=scaling, architectures=["LlamaForCausalLM"], **extra)


VARIANTS = {
    "default-64": _config(64),
    "default-128": _config(128, theta=5e5),
    "linear": _config(64, scaling={"rope_type": "linear", "factor": 4.0}, max_pos=2048),
    "dynamic": _config(128, scaling={"type": "dynamic", "factor": 2.0}, max_pos=4096),
    "dynamic-alpha": _config(64, scaling={"rope_type": "dynamic", "alpha": 3.0}),
    "llama3": _config(128, theta=5e5, max_pos=16384, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 2048}),
    "yarn": _config(64, scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 2048}),
    "yarn-mscale": _config(128, theta=1e6, scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
        "attn_factor": 1.2, "mscale": 1.0, "mscale_all_dim": 0.5}),
    "partial-0.5": _config(128, theta=5e5, partial_rotary_factor=0.5),
    "partial-yarn": _config(64, partial_rotary_factor=0.5, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
    "gptj": _config(64, rope_is_neox_style=False),
    "gptj-partial-llama3": _config(128, rope_is_neox_style=False, partial_rotary_factor=0.5,
                                   max_pos=8192, scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}),
}


def _sglang_rotate(module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang's own rotation (``forward_native``) of ``x: [n, H, d]`` at ``positions: [n]``."""
    n, h, d = x.shape
    _, k = module.forward_native(positions, x.reshape(n, h * d).clone(),
                                 x.reshape(n, h * d).clone())
    return k.reshape(n, h, d)


def _case(name: str, n: int = 37, h: int = 3):
    """(module, rope, raw keys, positions p, per-key shifts d with 0 <= p + d < cache rows)."""
    cfg = VARIANTS[name]
    module, rope = rope_module_of_config(cfg), shift_rope_from_config(cfg, name)
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(n, h, cfg.head_dim, generator=g)
    p = torch.randint(0, 1000, (n,), generator=g)
    choices = torch.tensor([-1, -7, 1, 13, 999, 3000])
    d = choices[torch.randint(0, len(choices), (n,), generator=g)]
    d[:5] = -p[:5]  # moved to position 0
    d = torch.where(p + d < 0, -p, d)
    assert int((p + d).max()) < module.cos_sin_cache.shape[0]
    return module, rope, x, p, d


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shifted_keys_equal_sglang_at_the_new_positions(name):
    module, rope, x, p, d = _case(name)
    stored = _sglang_rotate(module, x, p)  # what the pool holds: keys at the owner's positions
    want = _sglang_rotate(module, x, p + d)
    got = rotate_keys(stored, KeyShifts.of_row(0, d), rope)
    err = float((got - want).abs().max())
    MAX_ERR[name] = max(MAX_ERR.get(name, 0.0), err)
    assert err < 2e-3, (name, err)
    # the per-span reference agrees with the one-gather path
    spans = tuple(SharedSpan(i, 1, int(s)) for i, s in enumerate(d.tolist()))
    ref = transform_spans(stored.clone(), RowSpans.of_reads("r", spans), rope)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if not name.startswith("default"):  # the rope_theta-only shift served before: wrong here
        cfg = VARIANTS[name]
        plain = rotate_keys(stored, KeyShifts.of_row(0, d),
                            rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        assert (plain - want).abs().max() > 0.05
    # partial rotary: the pass-through dims are never touched
    torch.testing.assert_close(got[..., rope.rotary_dim:], x[..., rope.rotary_dim:])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_query_rotation_decode_equals_sglang_keys_at_the_new_positions(name):
    module, rope, x, p, d = _case(name, n=29, h=2)
    stored = _sglang_rotate(module, x, p)
    g = torch.Generator().manual_seed(7)
    q = _sglang_rotate(module, torch.randn(1, 6, x.shape[-1], generator=g),
                       torch.tensor([4000]))[0][:, None]  # [H, 1, d] at the reader's position
    v = torch.randn(2, x.shape[0], x.shape[-1], generator=g)
    want = scaled_dot_product_attention(q[None], _sglang_rotate(module, x, p + d).movedim(0, 1)[None],
                                        v[None], enable_gqa=True)[0]
    ks = KeyShifts.of_row(0, d)
    order, groups = ks.grouped(x.shape[0])
    got = grouped_shift_decode(q, stored[order].movedim(0, 1), v[:, order], ks.shifts, groups,
                               rope, x.shape[-1] ** -0.5)
    err = float((got - want).abs().max())
    MAX_ERR[name + " (decode)"] = err
    assert err < 2e-3, (name, err)


def test_yarn_attention_factor_is_in_the_stored_key_and_never_applied_again():
    module, rope, x, p, d = _case("yarn")
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    stored = _sglang_rotate(module, x, p)
    r = rope.rotary_dim
    # SGLang's rotation scales the rotated dims by the factor: |R(p)·k| = factor · |k| there
    torch.testing.assert_close(stored[..., :r].norm(dim=-1),
                               rope.attention_factor * x[..., :r].norm(dim=-1))
    want = _sglang_rotate(module, x, p + d)
    got = rotate_keys(stored, KeyShifts.of_row(0, d), rope)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    # scaling the shift as well would count the factor twice
    twice = rotate_keys(stored, KeyShifts.of_row(0, d), rope)[..., :r] * rope.attention_factor
    assert (twice - want[..., :r]).abs().max() > 0.05


def test_variants_are_named_and_dynamic_ntk_matches_sglangs_fixed_base():
    assert shift_rope_from_config(VARIANTS["llama3"]).variant == "llama3 (factor 8.0)"
    assert not shift_rope_from_config(VARIANTS["gptj"]).neox
    rope = shift_rope_from_config(VARIANTS["partial-0.5"])
    assert (rope.rotary_dim, rope.head_dim) == (64, 128)
    dyn = shift_rope_from_config(VARIANTS["dynamic"])
    # SGLang builds one cache at init, for max_len = factor · max_pos, with the base
    # θ · (factor · max_len / max_pos − (factor − 1))^(d/(d−2)) = θ · 3^(128/126) at factor 2
    # (HF would keep θ until a sequence outgrows max_pos)
    base = 10000.0 * (2.0 * 2.0 - 1.0) ** (128 / 126)
    torch.testing.assert_close(dyn.inv_freq, rope_inv_freq(128, base), rtol=1e-6, atol=0)


def test_a_transformers_v5_config_reads_rope_parameters():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, rope_parameters={
                          "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024})
    rope = shift_rope_from_config(cfg, "m")
    assert rope.variant.startswith("llama3") and rope.head_dim == 64


REFUSED = [
    ("sliding window", _config(sliding_window=4096), "sliding-window attention"),
    ("layer types", _config(layer_types=["full_attention", "sliding_attention"]),
     "sliding_attention"),
    ("mrope", _config(128, scaling={"rope_type": "default", "mrope_section": [16, 24, 24]}),
     "multimodal rotary (mrope_section"),
    ("vision", _config(vision_config={"hidden_size": 8}), "multimodal model"),
    ("longrope", _config(scaling={"rope_type": "longrope", "short_factor": [1.0] * 32,
                                  "long_factor": [2.0] * 32}), "rope_type 'longrope'"),
    ("unknown", _config(scaling={"rope_type": "made_up"}), "rope_type 'made_up'"),
    ("deepseek yarn", _config(scaling={"rope_type": "deepseek_yarn", "factor": 4.0}),
     "rope_type 'deepseek_yarn'"),
    ("dual chunk", _config(dual_chunk_attention_config={"chunk_size": 8}), "dual-chunk"),
]


@pytest.mark.parametrize("label,cfg,variant", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_variants_are_refused_naming_model_and_variant(label, cfg, variant):
    model = "/models/some-model (LlamaForCausalLM)"
    with pytest.raises(UnsupportedRope) as e:
        shift_rope_from_config(cfg, model)
    msg = str(e.value)
    assert model in msg and variant in msg and "--kvcmas-share-context" in msg, msg


def test_a_disabled_sliding_window_is_served():
    """Qwen2's configs carry a window with ``use_sliding_window: false``."""
    rope = shift_rope_from_config(_config(sliding_window=32768, use_sliding_window=False))
    assert rope.variant == "default"


class _Layer(torch.nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.rotary_emb = rotary


def test_the_loaded_models_modules_are_used_and_must_agree():
    cfg = VARIANTS["yarn"]
    shared = rope_module_of_config(cfg)
    model = torch.nn.ModuleList([_Layer(shared), _Layer(shared)])
    rope = shift_rope_for_model(cfg, rope_shift.rotary_modules(model), "m")
    assert rope.same_as(shift_rope_from_config(cfg)) and len(rope_shift.rotary_modules(model)) == 1
    mixed = torch.nn.ModuleList([_Layer(shared), _Layer(rope_module_of_config(VARIANTS["gptj"]))])
    with pytest.raises(UnsupportedRope, match="layers with different rotary embeddings"):
        shift_rope_for_model(cfg, rope_shift.rotary_modules(mixed), "m")


def test_a_runner_is_refused_at_backend_start_with_path_and_architecture():
    cfg = _config(sliding_window=4096)
    cfg.architectures = ["MistralForCausalLM"]
    runner = SimpleNamespace(model=None, model_config=SimpleNamespace(
        hf_config=cfg, hf_text_config=cfg, model_path="/models/mistral-7b"))
    with pytest.raises(UnsupportedRope, match=r"/models/mistral-7b \(MistralForCausalLM\).*"
                                              r"sliding-window attention \(sliding_window=4096\)"):
        shift_rope_for_runner(runner)
    ok = _config(64)
    runner = SimpleNamespace(model=torch.nn.ModuleList([_Layer(rope_module_of_config(ok))]),
                             model_config=SimpleNamespace(hf_config=ok, model_path="p"))
    assert shift_rope_for_runner(runner).same_as(ShiftRope.full(rope_inv_freq(64)))


def test_an_unknown_rotary_module_is_refused():
    class FancyRotaryEmbedding(torch.nn.Module):
        pass

    model = torch.nn.ModuleList([_Layer(FancyRotaryEmbedding())])
    with pytest.raises(UnsupportedRope, match="rotary module FancyRotaryEmbedding"):
        shift_rope_for_model(_config(), rope_shift.rotary_modules(model), "m")


def test_print_max_errors():
    """Runs last in this file: the measured maxima (``pytest -s``)."""
    for name, err in sorted(MAX_ERR.items()):
        print(f"{name:32s} max |ours - SGLang| = {err:.2e}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_decode_equals_sglang_keys_at_the_new_positions(name):
    """The GPU decode path (our delta kernel; Triton's interpreter on CPU) for every variant it
    serves: neox, full rotary. The others keep the torch path, said by ``kernel_serves``."""
    from sglang_kvcmas.attention.kernel_reads import (
        kernel_serves,
        plan_shifted,
        shifted_attention,
    )

    module, rope, x, p, d = _case(name, n=29, h=2)
    if not kernel_serves(rope):
        assert not rope.neox or rope.rotary_dim < rope.head_dim
        return
    d[-1] = 0  # the row's last key is its own new token
    stored = _sglang_rotate(module, x, p)
    g = torch.Generator().manual_seed(7)
    q = _sglang_rotate(module, torch.randn(1, 6, x.shape[-1], generator=g), torch.tensor([4000]))
    v = torch.randn(x.shape[0], 2, x.shape[-1], generator=g)
    want = scaled_dot_product_attention(
        q.movedim(0, 1)[None], _sglang_rotate(module, x, p + d).movedim(0, 1)[None],
        v.movedim(0, 1)[None], enable_gqa=True)[0, :, 0]
    planned = plan_shifted([torch.arange(x.shape[0])], [KeyShifts.of_row(0, d)], 2, rope,
                                  "cpu")
    got = shifted_attention(q, stored, v, planned, x.shape[-1] ** -0.5)[0]
    err = float((got - want).abs().max())
    MAX_ERR[name + " (kernel decode)"] = err
    assert err < 2e-3, (name, err)
