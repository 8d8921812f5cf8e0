"""The launcher's command line: our defaults, user overrides, and a fast clear failure."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sglang_kvcmas.server.options import (
    DEFAULT_RADIX_CACHE_BACKEND,
    build_sglang_argv,
    default_flags,
    parse_launcher_args,
)


def _argv(user: list[str], explicit: set[str] = frozenset()) -> list[str]:
    return build_sglang_argv(parse_launcher_args(user), "/models/m", set(explicit))


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_defaults_on_cpu():
    argv = _argv([])
    assert _value(argv, "--model-path") == "/models/m"
    assert _value(argv, "--device") == "cpu"
    assert _value(argv, "--dtype") == "float32"
    assert _value(argv, "--attention-backend") == "torch_native"
    assert int(_value(argv, "--max-total-tokens")) == 16384
    assert float(_value(argv, "--mem-fraction-static")) <= 0.2
    assert _value(argv, "--radix-cache-backend") == DEFAULT_RADIX_CACHE_BACKEND == "kvcmas"
    assert "--enable-cache-report" in argv
    assert "--enable-metrics" in argv  # prometheus_client is installed


def test_user_flags_win():
    argv = _argv(["--dtype", "bfloat16", "--port", "30123"], explicit={"dtype", "port"})
    assert argv.count("--dtype") == 1 and _value(argv, "--dtype") == "bfloat16"
    assert _value(argv, "--port") == "30123"


def test_model_path_and_alias_are_ours():
    assert parse_launcher_args(["--model", "embedded"]).model == "embedded"
    opts = parse_launcher_args(["--model-path", "/x", "--port", "1"])
    assert opts.model == "/x" and opts.sglang_argv == ("--port", "1")


def test_stock_cache_leaves_backend_unset():
    argv = _argv(["--kvcmas-stock-cache"])
    assert "--radix-cache-backend" not in argv
    assert "--kvcmas-stock-cache" not in argv  # never reaches SGLang


def test_gpu_device_gets_no_cpu_defaults():
    opts = parse_launcher_args(["--device", "cuda"])
    assert not opts.on_cpu
    dests = {f.dest for f in default_flags(opts)}
    assert {"dtype", "attention_backend", "max_total_tokens"}.isdisjoint(dests)
    assert "radix_cache_backend" in dests


def test_share_context_flag_sets_delta_backend_and_server_env(monkeypatch):
    monkeypatch.delenv("KVCMAS_SHARE_CONTEXT", raising=False)
    opts = parse_launcher_args(["--kvcmas-share-context", "--kvcmas-recompute-tail", "8"])
    assert opts.share_context and "--kvcmas-share-context" not in opts.sglang_argv
    env = opts.server_env()
    assert env["KVCMAS_SHARE_CONTEXT"] == "1" and env["KVCMAS_RECOMPUTE_TAIL"] == "8"
    assert env["KVCMAS_RECOMPUTE_BOUNDARY"] == "16"  # every scheduler knob, parsed once here
    argv = build_sglang_argv(opts, "/models/m", set())
    assert _value(argv, "--attention-backend") == "kvcmas_delta"
    assert _value(argv, "--radix-cache-backend") == "kvcmas"
    gpu = parse_launcher_args(["--kvcmas-share-context", "--device", "cuda"])
    assert "attention_backend" in {f.dest for f in default_flags(gpu)}  # on every device
    assert parse_launcher_args([]).server_env()["KVCMAS_SHARE_CONTEXT"] == "0"
    with pytest.raises(SystemExit):
        parse_launcher_args(["--kvcmas-share-context", "--kvcmas-stock-cache"])
    monkeypatch.setenv("KVCMAS_SHARE_CONTEXT", "1")  # the deployment's environment counts too
    assert parse_launcher_args([]).share_context


def test_a_removed_flag_fails_naming_what_replaced_it():
    with pytest.raises(SystemExit, match="--kvcmas-cpu-threads is no longer served: set OMP_NUM"):
        parse_launcher_args(["--kvcmas-cpu-threads", "2"])
    with pytest.raises(SystemExit, match="--kvcmas-turn-order is no longer served"):
        parse_launcher_args(["--kvcmas-turn-order", "fifo"])


@pytest.mark.parametrize("argv, env, names", [
    (["--kvcmas-recompute-boundary", "x"], {}, "--kvcmas-recompute-boundary"),
    (["--kvcmas-recompute-mass-fraction", "1.5"], {}, "--kvcmas-recompute-mass-fraction"),
    (["--kvcmas-leaf-mode", "random"], {}, "--kvcmas-leaf-mode"),
    ([], {"KVCMAS_RECOMPUTE_TAIL": "-3"}, "KVCMAS_RECOMPUTE_TAIL"),
    ([], {"KVCMAS_SHARE_CONTEXT": "maybe"}, "KVCMAS_SHARE_CONTEXT"),
    ([], {"KVCMAS_LEAF_BUDGET": "nan"}, "KVCMAS_LEAF_BUDGET"),
    ([], {"KVCMAS_MIN_BORROWED": "64"}, "KVCMAS_MIN_BORROWED is no longer served"),
])
def test_bad_knob_fails_at_startup_naming_it(monkeypatch, capsys, argv, env, names):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        parse_launcher_args(argv)
    assert names in str(e.value)


def test_flag_wins_over_environment(monkeypatch):
    monkeypatch.setenv("KVCMAS_RECOMPUTE_BOUNDARY", "4")
    assert parse_launcher_args([]).config.recompute_boundary == 4
    opts = parse_launcher_args(["--kvcmas-recompute-boundary", "8"])
    assert opts.config.recompute_boundary == 8 and opts.server_env()["KVCMAS_RECOMPUTE_BOUNDARY"] == "8"


def test_explicit_dests_follow_sglang_aliases():
    from sglang_kvcmas.integration.serve import explicit_dests

    assert explicit_dests(["--model", "x", "--dtype=half", "--enable-metrics"]) == {
        "model_path", "dtype", "enable_metrics"}
    assert explicit_dests([]) == set()
    # A plugin's choice (ours) is SGLang's to check after plugins load, not a parse error here.
    assert explicit_dests(["--attention-backend", "kvcmas_delta"]) == {"attention_backend"}


def test_unknown_model_path_fails_fast_without_booting(tmp_path):
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kvcmas.launch_server", "--model-path", str(missing),
         "--port", "30999"],
        capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert "bad --model-path" in proc.stderr and str(missing) in proc.stderr
    assert "launching SGLang" not in proc.stderr  # failed before SGLang was even imported
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_an_adapter_that_does_not_fit_fails_fast_naming_it(tmp_path):
    import json

    wrong = tmp_path / "wrong-rank"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kvcmas.launch_server", "--enable-lora",
         "--max-lora-rank", "8", "--lora-paths", f"wrong={wrong}", "--port", "30999"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--lora-paths wrong: wrong-rank has rank 64" in proc.stderr, proc.stderr[-2000:]
    assert "launching SGLang" not in proc.stderr


def test_a_forecast_artifact_that_does_not_load_fails_fast(tmp_path):
    bad = tmp_path / "forecaster.json"
    bad.write_text('{"version": 99}')
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kvcmas.launch_server", "--kvcmas-forecast-artifact",
         str(bad), "--port", "30999"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "bad --kvcmas-forecast-artifact" in proc.stderr and "version 99" in proc.stderr
    assert "launching SGLang" not in proc.stderr


def test_the_forecast_artifact_follows_the_served_model(tmp_path):
    from types import SimpleNamespace

    from sglang_kvcmas.launch_server import forecast_artifact
    from sglang_kvcmas.policy import spend_forecast as sf

    def options(model, given=None):
        return SimpleNamespace(model=model, config=SimpleNamespace(forecast_artifact=given))

    assert forecast_artifact(options(None)) == sf.ARTIFACT.resolve()
    assert forecast_artifact(options("/some/hf/folder")) == sf.ARTIFACT.resolve()
    for own in sf.ARTIFACT.parent.glob("spend_forecast_*.json"):
        assert forecast_artifact(options(own.stem.removeprefix("spend_forecast_"))) == \
            own.resolve()
    mine = tmp_path / "mine.json"
    mine.write_text(sf.ARTIFACT.read_text())
    assert forecast_artifact(options(None, str(mine))) == mine.resolve()


def test_sharing_on_a_gpu_takes_sglangs_own_backend(monkeypatch):
    """On GPU the default is SGLang's FlashInfer backend (Triton without it), which serves
    sharing as a dispatcher; a backend that cannot read borrowed KV fails before boot."""
    import importlib.util

    from sglang_kvcmas.server import options

    gpu = parse_launcher_args(["--kvcmas-share-context", "--device", "cuda"])
    real = importlib.util.find_spec
    for installed, expected in ((True, "flashinfer"), (False, "triton")):
        monkeypatch.setattr(options.importlib.util, "find_spec", lambda name, *a: (
            (object() if installed else None) if name == "flashinfer" else real(name, *a)))
        assert _value(build_sglang_argv(gpu, "/models/m", set()), "--attention-backend") == (
            expected)
    for ok in ("triton", "flashinfer", "torch_native", "kvcmas_delta"):
        parse_launcher_args(["--kvcmas-share-context", "--attention-backend", ok])
    for flag in ("--attention-backend", "--decode-attention-backend"):
        with pytest.raises(SystemExit, match=f"got {flag} fa3"):
            parse_launcher_args(["--kvcmas-share-context", flag, "fa3"])
    parse_launcher_args(["--attention-backend", "fa3"])  # sharing off: SGLang's business


@pytest.mark.parametrize("argv, named", [
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    (["--enable-two-batch-overlap", "--port", "1"], "--enable-two-batch-overlap"),
    (["--kv-cache-dtype=fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
])
def test_sharing_refuses_what_it_does_not_serve(argv, named):
    with pytest.raises(SystemExit, match=f"does not serve {named}: "):
        parse_launcher_args(["--kvcmas-share-context", *argv])
    parse_launcher_args(argv)  # sharing off: SGLang's business


def test_sharing_serves_sglangs_default_kv_cache_dtype():
    parse_launcher_args(["--kvcmas-share-context", "--kv-cache-dtype", "auto"])


def test_our_backend_on_a_gpu_runs_without_cuda_graphs():
    """SGLang captures decode graphs for every backend but its torch ones; ours reads eagerly."""
    ours = _argv(["--kvcmas-share-context", "--device", "cuda",
                  "--attention-backend", "kvcmas_delta"])
    assert "--disable-cuda-graph" in ours
    for argv in (["--kvcmas-share-context", "--device", "cuda"],  # a dispatcher keeps its graphs
                 ["--kvcmas-share-context"]):  # CPU: SGLang captures none
        assert "--disable-cuda-graph" not in _argv(argv)
    assert _argv(["--device", "cuda", "--attention-backend", "kvcmas_delta",
                  "--disable-cuda-graph"], {"disable_cuda_graph"}).count(
        "--disable-cuda-graph") == 1
