"""``sglang_kvcmas_bench.gpu_summary``: the GPU check's one JSON summary from what its steps
leave behind, including a kernel-test step cut off before pytest wrote its report."""

from __future__ import annotations

import json

from sglang_kvcmas_bench import gpu_summary


def _bench_record(mode, seq_len, rank, ratio, kv=8, d=128, spans=1, error=None):
    metrics = {"error": error} if error else {
        "baseline": "triton_plain", "ratio_vs_plain": {"triton_plain": 1.0, "triton_delta": ratio}}
    return {"machine": {"gpu": "NVIDIA H200", "torch": "13.0", "triton": "3.8.0"},
            "config": {"mode": mode, "seq_len": seq_len, "rank": rank, "num_kv_heads": kv,
                       "head_dim": d, "spans": spans}, "metrics": metrics}


def _write(out, name, lines):
    (out / name).write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_summary_reads_steps_tests_and_ratios(tmp_path):
    _write(tmp_path, gpu_summary.STEPS, [
        {"step": "kernel_tests", "limit_s": 200, "rc": 0, "seconds": 90},
        {"step": "benchmark", "limit_s": 130, "rc": 0, "seconds": 60}])
    (tmp_path / "kernel_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="test.a" name="t1"/>'
        '<testcase classname="test.a" name="t2"><failure message="x"/></testcase>'
        '<testcase classname="test.b" name="t3"><skipped/></testcase>'
        '<testcase time="0.000" /></testsuite></testsuites>')  # as pytest writes an interrupt
    _write(tmp_path, "delta_attention_gpu.jsonl", [
        _bench_record("decode", 1024, 4, 2.0),  # below the target's context: not judged
        _bench_record("decode", 4096, 4, 1.1),
        _bench_record("decode", 8192, 4, 1.25),
        _bench_record("decode", 8192, 8, 1.6),
        _bench_record("decode", 8192, 8, 9.0, kv=32),  # another head shape: not in the table
        _bench_record("decode", 8192, 0, 9.0, spans=16),  # scattered runs: not in the table
        _bench_record("extend", 4096, 8, 1.4),
        _bench_record("extend", 8192, 16, 0, error="OutOfMemoryError: ...")])
    s = gpu_summary.summarize(tmp_path)
    assert s["device"]["gpu"] == "NVIDIA H200" and s["baseline"] == "triton_plain"
    assert [x["step"] for x in s["steps"]] == ["kernel_tests", "benchmark"]
    assert s["kernel_tests"]["by_name"] == {"test.a::t1": "passed", "test.a::t2": "failed",
                                           "test.b::t3": "skipped"}
    assert s["kernel_tests"]["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1,
                                           "source": "kernel_tests.xml"}
    assert s["delta_vs_plain"] == {"decode": {"1024": {"4": 2.0}, "4096": {"4": 1.1},
                                              "8192": {"4": 1.25, "8": 1.6}},
                                   "extend": {"4096": {"8": 1.4}}}
    assert s["target"]["by_context"] == {"4096": 1.1, "8192": 1.25}
    assert s["target"]["worst"] == 1.25 and s["target"]["holds"] is True
    assert len(s["errors"]) == 1 and "OutOfMemory" in s["errors"][0]["error"]
    assert set(s) == {name.split(".")[0] for name in gpu_summary.FIELDS}


def test_a_cut_off_test_step_is_read_from_its_verbose_log(tmp_path):
    (tmp_path / "kernel_tests.log").write_text(
        "test/lab/kernels/test_x.py::test_a[4-64] PASSED                 [  1%]\n"
        "test/lab/kernels/test_x.py::test_b FAILED                       [  2%]\n"
        "some other line\n")
    s = gpu_summary.summarize(tmp_path)
    assert s["kernel_tests"]["by_name"] == {"test/lab/kernels/test_x.py::test_a[4-64]": "passed",
                                           "test/lab/kernels/test_x.py::test_b": "failed"}
    assert "cut off" in s["kernel_tests"]["counts"]["source"]
    assert s["target"]["holds"] is None and s["device"] is None  # no benchmark: nothing judged


def test_main_writes_the_summary_and_one_line(tmp_path, capsys):
    _write(tmp_path, "delta_attention_gpu.jsonl", [_bench_record("decode", 4096, 4, 1.5)])
    assert gpu_summary.main([str(tmp_path)]) == 0
    out = json.loads((tmp_path / gpu_summary.SUMMARY).read_text())
    assert out["target"]["holds"] is False
    line = capsys.readouterr().out
    assert line.startswith("GPU_CHECK ") and "target_holds=False" in line
