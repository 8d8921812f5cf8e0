"""PEFT adapters checked against the served model before SGLang loads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang_kvcmas.adapters import role_adapter_dir
from sglang_kvcmas.models.adapter_check import AdapterError, ModelShape, check_adapter
from sglang_kvcmas.server.lora_args import check_lora_paths, flag_values, named_adapters

# The embedded SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads of 64, MLP 1536.
SMOL = ModelShape.of_config({"hidden_size": 576, "num_attention_heads": 9,
                             "num_key_value_heads": 3, "intermediate_size": 1536,
                             "num_hidden_layers": 30})
PLANNER = role_adapter_dir("attn", "planner")


def fake_adapter(tmp: Path, *, hidden: int = 576, kv: int = 192, layers: int = 2, r: int = 8,
                 targets=("q_proj", "k_proj"), **config) -> Path:
    out = {"q_proj": hidden, "k_proj": kv}
    tensors = {}
    for i in range(layers):
        for t in targets:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(r, hidden)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out.get(t, hidden), r)
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": list(targets),
         **config}))
    return tmp


def test_the_shipped_role_adapters_fit_the_embedded_model():
    for role in ("planner", "solver", "critic"):
        assert check_adapter(role_adapter_dir("attn", role), SMOL) == 8
        assert check_adapter(role_adapter_dir("attn_mlp", role), SMOL, max_rank=8) == 8


def test_an_adapter_for_another_base_model_is_named_with_the_shapes(tmp_path):
    with pytest.raises(AdapterError, match=r"shape \[8, 896\].*another base model"):
        check_adapter(fake_adapter(tmp_path / "qwen", hidden=896), SMOL)
    with pytest.raises(AdapterError, match=r"layer 3\d, but the model has 30 layers"):
        check_adapter(fake_adapter(tmp_path / "deep", layers=32), SMOL)


def test_rank_targets_and_type_the_server_cannot_serve(tmp_path):
    with pytest.raises(AdapterError, match="rank 16, above .* 8"):
        check_adapter(fake_adapter(tmp_path / "r16", r=16), SMOL, max_rank=8)
    with pytest.raises(AdapterError, match="embed_tokens"):
        check_adapter(fake_adapter(tmp_path / "emb", targets=("q_proj", "embed_tokens")), SMOL)
    with pytest.raises(AdapterError, match="DoRA"):
        check_adapter(fake_adapter(tmp_path / "dora", use_dora=True), SMOL)
    with pytest.raises(AdapterError, match="IA3"):
        check_adapter(fake_adapter(tmp_path / "ia3", peft_type="IA3"), SMOL)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(AdapterError, match="not a folder"):
        check_adapter(tmp_path / "nowhere", SMOL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        check_adapter(tmp_path / "empty", SMOL)
    bad = shutil.copytree(PLANNER, tmp_path / "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"\x01")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_adapter(bad, SMOL)


def test_lora_paths_in_sglangs_three_spellings():
    argv = ["--enable-lora", "--lora-paths", "a=/x/a", "/y/b",
            '{"lora_name": "c", "lora_path": "/z/c", "pinned": true}', "--max-lora-rank", "8"]
    assert named_adapters(argv) == {"a": "/x/a", "/y/b": "/y/b", "c": "/z/c"}
    assert flag_values(argv, "--max-lora-rank") == ["8"]
    assert flag_values(["--max-lora-rank=16"], "--max-lora-rank") == ["16"]
    with pytest.raises(AdapterError, match="lora_name"):
        named_adapters(["--lora-paths", '{"path": 1}'])


def test_the_launcher_check_names_the_bad_adapter(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
         "intermediate_size": 1536, "num_hidden_layers": 30}))
    good = ["--lora-paths", f"planner={PLANNER}"]
    assert check_lora_paths(good, model) == {"planner": 8}
    assert check_lora_paths([], model) == {}
    wrong = fake_adapter(tmp_path / "wrong", hidden=896)
    with pytest.raises(AdapterError, match="--lora-paths wrong: .*another base model"):
        check_lora_paths([*good, f"wrong={wrong}"], model)
