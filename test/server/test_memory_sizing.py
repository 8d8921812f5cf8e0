"""The CPU default of ``--mem-fraction-static``: sized from the model and the pool (no server)."""

from __future__ import annotations

import json

from sglang_kvcmas.server.memory import (
    GIB,
    MAX_FRACTION,
    MIN_FRACTION,
    ModelFootprint,
    footprint_of_folder,
    static_fraction,
)
from sglang_kvcmas.server.options import build_sglang_argv, parse_launcher_args

SMOLLM2_135M = ModelFootprint(weight_bytes=538_090_408, kv_bytes_per_token=46_080)
QWEN25_05B = ModelFootprint(weight_bytes=2_520_702_368, kv_bytes_per_token=24_576)


def _fits(fp: ModelFootprint, tokens: int, free: int, fraction: float) -> bool:
    """SGLang's CPU check: what is left for the KV pool after the weights holds the pool."""
    slack = free * (1 - fraction)
    avail_after_load = free - fp.weight_bytes
    return avail_after_load - slack >= tokens * fp.kv_bytes_per_token


def test_old_fixed_default_fails_the_05b_model_but_the_sized_one_fits():
    launch_free, pre = 21 * GIB, 15 * GIB  # measured: the scheduler's pre is below it
    assert _fits(SMOLLM2_135M, 16384, pre, 0.1)
    assert not _fits(QWEN25_05B, 16384, pre, 0.1)  # "leave no memory for the KV cache"
    for fp in (SMOLLM2_135M, QWEN25_05B):
        assert _fits(fp, 16384, pre, static_fraction(fp, 16384, launch_free))


def test_fraction_grows_with_weights_and_pool_and_shrinks_with_free_memory():
    base = static_fraction(QWEN25_05B, 16384, 20 * GIB)
    assert static_fraction(QWEN25_05B, 65536, 20 * GIB) > base
    assert static_fraction(QWEN25_05B, 16384, 40 * GIB) < base
    assert static_fraction(SMOLLM2_135M, 16384, 20 * GIB) < base


def test_fraction_is_clamped():
    assert static_fraction(ModelFootprint(0, 0), 16384, 500 * GIB) == MIN_FRACTION
    assert static_fraction(QWEN25_05B, 16384, 1 * GIB) == MAX_FRACTION
    assert static_fraction(QWEN25_05B, 16384, 0) == MAX_FRACTION
    assert static_fraction(ModelFootprint(0, 0), 16384, 1 * GIB) == MIN_FRACTION  # unknown


def _write_model(folder, *, dtype="float32", weight_bytes=4000):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "dtype": dtype, "num_hidden_layers": 3, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}))
    (folder / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    return folder


def test_footprint_reads_config_and_scales_to_the_served_dtype(tmp_path):
    folder = _write_model(tmp_path / "m", dtype="bfloat16", weight_bytes=4000)
    # 3 layers * (K, V) * 2 kv heads * head_dim 16 * 4 bytes
    assert footprint_of_folder(folder, "float32") == ModelFootprint(8000, 3 * 2 * 2 * 16 * 4)
    assert footprint_of_folder(folder, "bfloat16") == ModelFootprint(4000, 3 * 2 * 2 * 16 * 2)
    assert footprint_of_folder(tmp_path / "missing") == ModelFootprint(0, 0)


def test_launcher_sizes_the_default_and_an_explicit_value_wins(tmp_path, monkeypatch):
    monkeypatch.setattr("sglang_kvcmas.server.options.free_host_bytes", lambda: 16 * GIB)
    folder = str(_write_model(tmp_path / "m", weight_bytes=2 * GIB))

    def fraction(user, explicit=frozenset()):
        argv = build_sglang_argv(parse_launcher_args(user), folder, set(explicit))
        assert argv.count("--mem-fraction-static") == 1
        return float(argv[argv.index("--mem-fraction-static") + 1])

    sized = fraction([])
    assert sized == static_fraction(footprint_of_folder(tmp_path / "m"), 16384, 16 * GIB) > 0.3
    assert fraction(["--max-total-tokens", "200000"], {"max_total_tokens"}) > sized
    assert fraction(["--mem-fraction-static", "0.3"], {"mem_fraction_static"}) == 0.3
