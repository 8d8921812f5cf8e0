"""Prefill and decode throughput of one sglang-kvcmas server (single request at a time).

Boots the server through our launcher (or uses ``--url``), then measures, after one warm-up:

- prefill tok/s: a prompt of ``--prompt-tokens`` token ids with ``max_new_tokens=1`` and the
  cache flushed first, so every token is prefilled; time = server-side first-token latency.
- decode tok/s: ``--decode-tokens`` new tokens (``ignore_eos``) after a short prompt;
  rate = (completion_tokens - 1) / (e2e latency - first-token latency).

Prints a summary and appends one JSONL record per configuration to ``--out``. Absolute numbers
on shared 2-core machines are noisy; compare configurations measured in one run.

    python benchmark/serving/throughput.py --threads 1 2 --out benchmark/serving/results/throughput.jsonl

``--model-path`` (``model_arg``): the served model; records name it, and the default
``--out`` gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests
from sglang_kvcmas.server.process import ServerProcess
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "throughput.jsonl"


@dataclass(frozen=True)
class Throughput:
    """One configuration's medians over ``repeats`` runs."""

    threads: int | None
    prompt_tokens: int
    decode_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    prefill_s: float
    repeats: int


def _generate(url: str, payload: dict) -> dict:
    r = requests.post(f"{url}/generate", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()["meta_info"]


def measure(url: str, prompt_tokens: int, decode_tokens: int, repeats: int) -> tuple[list, list]:
    """Per-repeat (prefill tok/s, prefill s) and decode tok/s lists."""
    vocab_ids = [(i * 7919) % 40000 + 1000 for i in range(prompt_tokens)]  # deterministic ids
    greedy = {"temperature": 0.0}
    _generate(url, {"input_ids": vocab_ids[:64], "sampling_params": {**greedy, "max_new_tokens": 4}})
    prefill, decode = [], []
    for _ in range(repeats):
        requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
        meta = _generate(url, {"input_ids": vocab_ids,
                               "sampling_params": {**greedy, "max_new_tokens": 1}})
        prefill.append((prompt_tokens / meta["first_token_latency"], meta["first_token_latency"]))
        meta = _generate(url, {"text": "Write a long story about a lighthouse keeper.",
                               "sampling_params": {**greedy, "max_new_tokens": decode_tokens,
                                                   "ignore_eos": True}})
        decode_s = meta["e2e_latency"] - meta["first_token_latency"]
        decode.append((meta["completion_tokens"] - 1) / decode_s)
    return prefill, decode


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_config(args: argparse.Namespace, threads: int | None) -> Throughput:
    def _measure(url: str) -> Throughput:
        prefill, decode = measure(url, args.prompt_tokens, args.decode_tokens, args.repeats)
        return Throughput(
            threads=threads, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
            prefill_tok_s=statistics.median(p for p, _ in prefill),
            decode_tok_s=statistics.median(decode),
            prefill_s=statistics.median(s for _, s in prefill), repeats=args.repeats,
        )

    if args.url:
        return _measure(args.url)
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    log = Path(tempfile.gettempdir()) / f"kvcmas-throughput-{os.getpid()}-{threads}.log"
    with ServerProcess(args=[*args.model.server_args, *args.server_args], log_path=log,
                       env=env) as server:
        return _measure(server.url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="measure this running server instead of booting one")
    p.add_argument("--threads", type=int, nargs="*", default=[None],
                   help="OMP_NUM_THREADS values to compare (one server boot each)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSONL appended to (default: results/throughput[_<model>].jsonl)")
    add_model_arg(p)
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after '--': extra flags for sglang-kvcmas-server")
    args = p.parse_args(argv)
    args.server_args = [a for a in args.server_args if a != "--"]
    args.model = model_from_args(p, args)
    args.out = args.model.out_or_named(args.out, DEFAULT_OUT)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "load_avg_1m": os.getloadavg()[0]}
    for threads in args.threads:
        result = run_config(args, threads)
        print(f"threads={threads}: prefill {result.prefill_tok_s:7.1f} tok/s "
              f"({result.prompt_tokens} tokens in {result.prefill_s:.2f} s), "
              f"decode {result.decode_tok_s:5.1f} tok/s", flush=True)
        rec = {"benchmark": "serving_throughput", "time": time.time(), "commit": _commit(),
               "machine": machine, "model": args.model.name, "server_args": args.server_args,
               **asdict(result)}
        record(args.out, json.dumps(rec) + "\n", append=True,
               what=f"server prefill / decode tokens per second ({args.model.name}, "
                    f"{args.prompt_tokens}-token prompt, {args.decode_tokens} decode tokens), one "
                    f"record appended per run; the latest ({rec['commit']}, {threads} threads): "
                    f"prefill {result.prefill_tok_s:.1f}, decode {result.decode_tok_s:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
