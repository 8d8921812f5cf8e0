"""``sglang_kvcmas_bench.model_arg``: one ``--model-path`` for every benchmark and lab, and every
benchmark that takes it still answers ``--help``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_kvcmas_bench.model_arg import (
    BenchModel,
    ModelPathError,
    add_model_arg,
    model_from_args,
)

ROOT = Path(__file__).resolve().parents[2]

TAKE_MODEL_PATH = [
    "benchmark/kernels/batched_decode_bench.py",
    "benchmark/kernels/delta_attention_bench.py",
    "benchmark/kernels/probe_mass_bench.py",
    "benchmark/kernels/shifted_decode_bench.py",
    "benchmark/lab/delta_growth_study.py",
    "benchmark/lab/kvcmas_lab.py",
    "benchmark/lab/kvcmas_selector_study.py",
    "benchmark/lab/owner_mass_study.py",
    "benchmark/lab/precache_drift_study.py",
    "benchmark/lab/precache_lab.py",
    "benchmark/lab/shared_basis_study.py",
    "benchmark/serving/backend_parity.py",
    "benchmark/serving/behaviour_check.py",
    "benchmark/serving/consistency_frontier.py",
    "benchmark/serving/head_to_head.py",
    "benchmark/serving/model_smoke.py",
    "benchmark/serving/recompute_fidelity.py",
    "benchmark/serving/reliability.py",
    "benchmark/serving/router_scale.py",
    "benchmark/serving/scale.py",
    "benchmark/serving/sglang_bench_serving.py",
    "benchmark/serving/soak.py",
    "benchmark/serving/throughput.py",
]


def tiny_qwen2(folder: Path) -> Path:
    """A Qwen2 config folder (no weights): 2 layers, 4 heads of 16, 2 KV heads."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    return folder


def test_embedded_model_is_the_default_and_keeps_todays_numbers_and_names():
    p = argparse.ArgumentParser()
    add_model_arg(p)
    model = BenchModel.resolve(p.parse_args([]).model_path)
    assert model.is_embedded and model.name == "embedded"
    assert model.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4  # head_to_head's constant
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (30, 9, 3, 64)
    assert model.rope_theta == 1e5  # the kernel benchmarks' constant
    assert model.server_args == ["--model-path", "embedded"]
    out = Path("results/head_to_head")
    assert model.named(out) == out and model.out_or_named(out, out) == out
    assert model.out_or_named(None, out) == out


def test_a_qwen2_folder_gives_its_own_bytes_name_and_suffix(tmp_path):
    folder = tiny_qwen2(tmp_path / "Tiny.Qwen")
    model = BenchModel.resolve(str(folder))
    assert not model.is_embedded and model.model_type == "qwen2"
    assert model.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4
    assert model.rope_theta == 10000.0  # none given
    assert model.name == "Tiny.Qwen" and model.slug == "tiny-qwen"
    assert model.server_args == ["--model-path", str(folder.resolve())]
    default = Path("results/consistency_frontier")
    named = model.out_or_named(default, default)
    assert named == Path("results/consistency_frontier_tiny-qwen")
    assert named.with_suffix(".jsonl").name == "consistency_frontier_tiny-qwen.jsonl"
    assert model.named(Path("r/scale.json")) == Path("r/scale_tiny-qwen.json")
    assert model.out_or_named(Path("mine"), default) == Path("mine")  # what the user gave wins
    model.require_lab_support()
    with pytest.raises(ModelPathError, match="embedded"):
        model.require_embedded("the adapters are the embedded model's")


def test_a_bad_model_path_says_what_is_wrong(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        BenchModel.resolve(str(tmp_path / "nothing"))


def test_a_model_a_benchmark_cannot_run_ends_it_with_the_reason(tmp_path, capsys):
    folder = tiny_qwen2(tmp_path / "tiny")
    p = argparse.ArgumentParser(prog="bench")
    add_model_arg(p)
    args = p.parse_args(["--model-path", str(folder)])
    assert model_from_args(p, args).name == "tiny"
    with pytest.raises(SystemExit) as e:
        model_from_args(p, args, embedded_only="the adapters are the embedded model's")
    assert e.value.code == 2
    assert "the adapters are the embedded model's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model_from_args(p, p.parse_args(["--model-path", str(tmp_path / "nothing")]))
    assert "does not exist" in capsys.readouterr().err


def test_embedded_template_markers_are_the_chatml_ids_head_to_head_used():
    from sglang_kvcmas.tree.template_markers import TemplateMarkers
    from sglang_kvcmas_bench.model_arg import chat_markers

    got = chat_markers(BenchModel.resolve().tokenizer())
    old = TemplateMarkers.chatml(1, 2, 198, system=(9690,), user=(4093,), assistant=(520, 9531))
    assert (got.system_open, got.head_sep, got.head_keep, got.generation_open) == (
        old.system_open, old.head_sep, old.head_keep, old.generation_open)


HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(script, run_name="__main__")
        code = "no exit"
    except SystemExit as e:
        code = e.code
    except Exception as e:  # noqa: BLE001 - reported per script
        code = repr(e)
    out[script] = [code, "--model-path" in buf.getvalue()]
print(json.dumps(out))
"""


def test_every_benchmark_takes_model_path():
    """``--help`` of every benchmark, in one subprocess (torch and SGLang imported once)."""
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, *TAKE_MODEL_PATH],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    bad = {s: r for s, r in got.items() if r != [0, True]}
    assert not bad and set(got) == set(TAKE_MODEL_PATH), (bad, run.stderr[-2000:])
