"""One JSON summary of ``scripts/gpu_check.sh``: its steps, kernel tests by name, and delta
attention / plain attention time ratios by mode, context and rank.

    python -m sglang_kvcmas_bench.gpu_summary OUT_DIR      # writes OUT_DIR/gpu_check_summary.json
    python -m sglang_kvcmas_bench.gpu_summary --fields     # the summary's fields, one a line

Reads what the check's steps leave in ``OUT_DIR``: ``gpu_check_steps.jsonl`` (one record a step:
name, limit, exit status, seconds), ``kernel_tests.xml`` (pytest's JUnit report) or, when a step
was cut off before pytest wrote it, the verbose lines of ``kernel_tests.log``, and
``delta_attention_gpu.jsonl`` (the micro-benchmark, one record per configuration). Anything
missing is reported as missing, never guessed. Standard library only: it runs on a machine with
PyTorch and Triton alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SUMMARY = "gpu_check_summary.json"
STEPS = "gpu_check_steps.jsonl"
TARGET_RATIO = 1.3
"""The target: delta attention at most this many times plain attention's time ..."""
TARGET_MIN_CONTEXT = 4096
"""... at this context or longer ..."""
TARGET_RANK = 4
"""... with factors of this rank (decode, one span: the shape a reader decodes)."""

FIELDS = {
    "device": "the GPU's name, CUDA and Triton versions (from the benchmark's records)",
    "steps": "each step: name, limit_s, rc (124: cut off at its limit), seconds",
    "kernel_tests.counts": "passed / failed / error / skipped, and where they were read from",
    "kernel_tests.by_name": "test id -> outcome",
    "delta_vs_plain": "mode -> context -> rank -> triton_delta time / plain time (median)",
    "baseline": "what 'plain' is: flashinfer_plain where FlashInfer is installed, else "
                "triton_plain",
    "target": f"delta <= {TARGET_RATIO}x plain at context >= {TARGET_MIN_CONTEXT}, rank "
              f"{TARGET_RANK}: the worst ratio there and whether it holds",
    "errors": "configurations whose measurement failed, with the error",
}
_VERBOSE = re.compile(r"^(\S+::\S+(?:\[.*?\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def read_steps(out: Path) -> list[dict[str, Any]]:
    path = out / STEPS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_tests(out: Path) -> tuple[dict[str, str], str]:
    """(test id -> outcome, source): the JUnit report, else the verbose log, else nothing."""
    xml = out / "kernel_tests.xml"
    if xml.is_file():
        by_name = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.get("name") is None:  # the test an interrupt stopped: pytest names none
                continue
            outcome = next((t.tag for t in case if t.tag in ("failure", "error", "skipped")),
                           "passed")
            by_name[f"{case.get('classname')}::{case.get('name')}"] = \
                {"failure": "failed"}.get(outcome, outcome)
        return by_name, "kernel_tests.xml"
    log = out / "kernel_tests.log"
    if log.is_file():
        by_name = {m.group(1): m.group(2).lower() for line in log.read_text().splitlines()
                   if (m := _VERBOSE.match(line))}
        return by_name, "kernel_tests.log (no JUnit report: the step was cut off)"
    return {}, "missing"


def read_bench(out: Path) -> list[dict[str, Any]]:
    path = out / "delta_attention_gpu.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ratios(records: list[dict[str, Any]]) -> tuple[dict, str | None, list[dict]]:
    """(mode -> context -> rank -> ratio, baseline, errors) over the one-span records of the
    benchmark's main shape (the first head shape it times at every rank)."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    errors, baseline = [], None
    for rec in records:
        cfg, m = rec["config"], rec["metrics"]
        if "error" in m:
            errors.append({"config": cfg, "error": m["error"]})
            continue
        if cfg.get("spans", 1) != 1 or (cfg["num_kv_heads"], cfg["head_dim"]) != (8, 128):
            continue
        baseline = m.get("baseline", baseline)
        table.setdefault(cfg["mode"], {}).setdefault(str(cfg["seq_len"]), {})[
            str(cfg["rank"])] = round(m["ratio_vs_plain"]["triton_delta"], 4)
    return table, baseline, errors


def target(table: dict) -> dict[str, Any]:
    at = {ctx: r[str(TARGET_RANK)] for ctx, r in table.get("decode", {}).items()
          if int(ctx) >= TARGET_MIN_CONTEXT and str(TARGET_RANK) in r}
    worst = max(at.values()) if at else None
    return {"max_ratio": TARGET_RATIO, "min_context": TARGET_MIN_CONTEXT, "rank": TARGET_RANK,
            "by_context": at, "worst": worst,
            "holds": None if worst is None else worst <= TARGET_RATIO}


def summarize(out: Path) -> dict[str, Any]:
    by_name, source = read_tests(out)
    counts = {k: sum(v == k for v in by_name.values())
              for k in ("passed", "failed", "error", "skipped")}
    records = read_bench(out)
    table, baseline, errors = ratios(records)
    return {
        "device": records[0]["machine"] if records else None,
        "steps": read_steps(out),
        "kernel_tests": {"counts": {**counts, "source": source}, "by_name": by_name},
        "delta_vs_plain": table,
        "baseline": baseline,
        "target": target(table),
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="the check's output folder")
    ap.add_argument("--fields", action="store_true", help="print the summary's fields")
    args = ap.parse_args(argv)
    if args.fields:
        for name, what in FIELDS.items():
            print(f"  {name}: {what}")
        return 0
    if args.out is None:
        ap.error("give the check's output folder, or --fields")
    summary = summarize(args.out)
    (args.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    c, t = summary["kernel_tests"]["counts"], summary["target"]
    print(f"GPU_CHECK tests_passed={c['passed']} tests_failed={c['failed'] + c['error']} "
          f"tests_skipped={c['skipped']} delta_vs_plain_rank{TARGET_RANK}_ge4k={t['worst']} "
          f"target_holds={t['holds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
