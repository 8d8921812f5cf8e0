"""The centroid adapter of ``lora_share=rebase`` (``server/lora_centroid.py``): its delta is the
mean of the adapters' deltas, exactly, and it joins SGLang's command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_kvcmas.adapters import ROLES, role_adapter_dir
from sglang_kvcmas.models.adapter_check import AdapterError
from sglang_kvcmas.server.lora_centroid import (
    CONFIG,
    WEIGHTS,
    build_centroid,
    scaling,
    with_centroid,
)

PREFIX = "base_model.model.model.layers.{}.self_attn.{}"


def adapter(folder: Path, seed: int, r: int, alpha: float, modules: dict[str, tuple[int, int]],
            rslora: bool = False, **config) -> Path:
    """A PEFT LoRA folder: ``modules`` {name: (in, out)} on layers 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (0, 1):
        for name, (n_in, n_out) in modules.items():
            key = PREFIX.format(layer, name)
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": sorted(modules), **config}))
    return folder


def delta(folder: Path, key: str) -> torch.Tensor:
    """``s · B·A`` of one module of an adapter folder."""
    t = load_file(str(folder / WEIGHTS))
    config = json.loads((folder / CONFIG).read_text())
    return scaling(config) * (t[f"{key}.lora_B.weight"].double() @ t[f"{key}.lora_A.weight"].double())


def test_scaling_is_pefts():
    assert scaling({"r": 8, "lora_alpha": 16}) == 2.0
    assert scaling({"r": 16, "lora_alpha": 8, "use_rslora": True}) == 8 / math.sqrt(16)
    assert scaling({"r": 4}) == 1.0


def test_the_centroid_delta_is_the_mean_of_the_deltas_with_missing_modules_as_zero(tmp_path):
    qk = {"q_proj": (12, 12), "k_proj": (12, 4)}
    a = adapter(tmp_path / "a", 1, 4, 8, qk)
    b = adapter(tmp_path / "b", 2, 2, 7, {**qk, "v_proj": (12, 4)}, rslora=True)
    c = adapter(tmp_path / "c", 3, 3, 3, {"q_proj": (12, 12)})
    out = build_centroid([a, b, c], tmp_path / "cache")
    config = json.loads((out / CONFIG).read_text())
    assert config["r"] == 9 and scaling(config) == 1.0
    assert config["target_modules"] == ["k_proj", "q_proj", "v_proj"]
    for layer in (0, 1):
        for name in ("q_proj", "k_proj", "v_proj"):
            key = PREFIX.format(layer, name)
            parts = [delta(f, key) for f in (a, b, c)
                     if f"{key}.lora_A.weight" in load_file(str(f / WEIGHTS))]
            want = sum(parts) / 3
            torch.testing.assert_close(delta(out, key), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["attn", "attn_mlp"])
def test_the_centroid_sits_within_the_adapters_spread(tmp_path, config):
    """The base ``rebase`` serves deviates from each shipped role adapter, per projection, by at
    most (N-1)/N of that adapter's mean distance to the others (the triangle inequality on the
    mean), where ``borrow`` reads one such distance whole."""
    folders = [role_adapter_dir(config, role) for role in ROLES]
    out = build_centroid(folders, tmp_path / "cache")
    n = len(folders)
    keys = sorted(k[: -len(".lora_A.weight")] for k in load_file(str(folders[0] / WEIGHTS))
                  if k.endswith(".lora_A.weight"))
    assert keys
    for key in keys:
        deltas = [delta(f, key) for f in folders]
        mean = delta(out, key)
        for da in deltas:
            spread = sum(float(torch.linalg.norm(da - db)) for db in deltas) / (n - 1)
            assert float(torch.linalg.norm(da - mean)) <= (n - 1) / n * spread * (1 + 1e-6)


def test_it_is_built_once_per_set_of_inputs(tmp_path):
    a = adapter(tmp_path / "a", 1, 2, 2, {"q_proj": (6, 6)})
    b = adapter(tmp_path / "b", 2, 2, 2, {"q_proj": (6, 6)})
    first = build_centroid([a, b], tmp_path / "cache")
    stamp = (first / WEIGHTS).stat().st_mtime_ns
    assert build_centroid([a, b], tmp_path / "cache") == first
    assert (first / WEIGHTS).stat().st_mtime_ns == stamp
    assert build_centroid([b, a], tmp_path / "cache") != first  # order is part of the input


def test_bad_inputs_are_refused_by_name(tmp_path):
    a = adapter(tmp_path / "a", 1, 2, 2, {"q_proj": (6, 6)})
    with pytest.raises(AdapterError, match="at least two"):
        build_centroid([a], tmp_path / "cache")
    with pytest.raises(AdapterError, match="cannot read"):
        build_centroid([a, tmp_path / "missing"], tmp_path / "cache")
    p = adapter(tmp_path / "p", 2, 2, 2, {"q_proj": (6, 6)}, rank_pattern={"q_proj": 4})
    with pytest.raises(AdapterError, match="rank_pattern"):
        build_centroid([a, p], tmp_path / "cache")


def test_it_joins_the_last_lora_paths_and_raises_max_lora_rank():
    argv = ["--enable-lora", "--lora-paths", "x=/x", "--max-lora-rank", "8", "--lora-paths",
            "a=/a", "b=/b", "--port", "1"]
    out = with_centroid(argv, Path("/c"), 16, "kvcmas-centroid")
    assert out == ["--enable-lora", "--lora-paths", "x=/x", "--max-lora-rank", "16",
                   "--lora-paths", "a=/a", "b=/b", "kvcmas-centroid=/c", "--port", "1"]
    out = with_centroid(["--lora-paths=a=/a", "--max-lora-rank=32"], Path("/c"), 16, "c")
    assert out == ["--lora-paths", "a=/a", "c=/c", "--max-lora-rank=32"]
