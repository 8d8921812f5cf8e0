"""Soak a sharing server: mixed multi-agent workflows with random disconnects for a fixed time.

Boots one server with sharing on and runs workflows back to back from several client threads:
3-agent debates (the agents of a round together) and reviewer chains over GSM8K questions, each
request streamed, and a share of them dropped by the client at a random point. Every
``--sample-s`` seconds it records the resident memory of the server's processes (launcher,
tokenizer, scheduler, detokenizer: psutil) and the KV pool's use (``/server_info``).

Writes ``results/soak[_<model>].jsonl`` (one sample per line), ``.png`` (resident memory and
pool use over time) and ``.txt`` (the summary line), and prints::

    SOAK minutes=30 requests=<n> dropped=<n> failed=<n> rss_slope_mib_per_min=<x> (after warm-up)
         pool_used_max=<f> invariants_ok=<bool>

The slope is a least-squares fit of total resident memory against time over the samples after
``--warmup-min``.

    python benchmark/serving/soak.py --minutes 30 [--model-path NAME]

``--model-path`` (``model_arg``): the served model; every sample names it, and the file names
get ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

from sglang_kvcmas_bench.debate_prompts import Prompts
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import ArmServer, kvcmas_state, shared_tree_stats
from sglang_kvcmas_bench.server_calls import call, raw_stream
from sglang_kvcmas_bench.workflows import debate, reviewer_chain

RESULTS = Path(__file__).resolve().parent / "results"


def rss_mib(pid: int) -> float:
    """Resident memory of a process and all its children, MiB."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def slope_per_min(samples: list[dict], warmup_min: float) -> float:
    """Least-squares slope of ``rss_mib`` against minutes, after the warm-up."""
    pts = [(s["t_min"], s["rss_mib"]) for s in samples if s["t_min"] >= warmup_min]
    if len(pts) < 3:
        return float("nan")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")


class Load:
    """Client threads running workflows until stopped."""

    def __init__(self, url: str, prompts: Prompts, drop_share: float, max_new: int):
        self.url, self.p, self.drop_share, self.max_new = url, prompts, drop_share, max_new
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "dropped": 0, "failed": 0}

    def _turn(self, rng: random.Random, system: str, transcript: str) -> str:
        body = {"model": "default", "max_tokens": self.max_new, "temperature": 0,
                "stream": True, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": transcript}]}
        drop = rng.random() < self.drop_share
        with self.lock:
            self.counts["requests"] += 1
            self.counts["dropped"] += drop
        if drop:
            raw_stream(self.url, body, rng.choice([0, 1, 4, 12]))
            return ""
        reply = call(self.url, "/v1/chat/completions", {**body, "stream": False}, timeout=600)
        if reply.status != 200:
            with self.lock:
                self.counts["failed"] += 1
            return ""
        return reply.json()["choices"][0]["message"]["content"] or ""

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        w = 0
        while not self.stop.is_set():
            q = rng.choice(self.p.questions)
            flow = debate(seed * 1000 + w, q, rounds=2) if rng.random() < 0.7 else \
                reviewer_chain(seed * 1000 + w, q)
            for step, agents in enumerate(flow.steps):
                if self.stop.is_set():
                    return
                outs: dict[str, str] = {}
                threads = [threading.Thread(target=lambda a=a: outs.__setitem__(
                    a, self._turn(rng, flow.heads[a], flow.user_message(step))))
                    for a in agents]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                flow.record(step, {a: outs.get(a, "") for a in agents})
            w += 1


def plot(samples: list[dict], path: Path, slope: float, warmup_min: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_min"] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s["rss_mib"] for s in samples], label="resident memory (MiB)", color="C0")
    ax.axvline(warmup_min, color="grey", ls=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax2 = ax.twinx()
    ax2.plot(t, [s["pool_used"] for s in samples], label="KV pool in use", color="C1", alpha=0.6)
    ax2.set_ylabel("pool share in use")
    ax2.set_ylim(0, 1.05)
    ax.set_title(f"soak: server memory and KV pool (slope after warm-up {slope:+.2f} MiB/min)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-min", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=4, help="concurrent workflows")
    ap.add_argument("--drop-share", type=float, default=0.15, help="requests dropped by the client")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--pool", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder of soak[_<model>].{jsonl,png,txt} (default: results/); the "
                         "server's log and the samples as taken go to a folder of that name")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    name = model.named(Path("soak")).name
    scratch = args.out / name
    scratch.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(model.folder)
    samples: list[dict] = []
    print(f"[soak] model {model.name}", file=sys.stderr, flush=True)
    with ArmServer("kvcmas", scratch / "server.log",
                   [*model.server_args, "--max-total-tokens", str(args.pool)]) as server:
        load = Load(server.url, prompts, args.drop_share, args.max_new_tokens)
        threads = [threading.Thread(target=load.worker, args=(i,), daemon=True)
                   for i in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        with open(scratch / "samples.jsonl", "w") as f:  # kept as taken: a crash loses none
            while (elapsed := time.monotonic() - t0) < args.minutes * 60:
                state = kvcmas_state(server.url)
                pool = state.get("pool") or {}
                used = 1 - (pool.get("available", 0) + pool.get("evictable", 0)) / max(
                    pool.get("total", 1), 1)
                tree = state.get("shared_tree") or {}
                sample = {"model": model.name, "t_min": round(elapsed / 60, 3), "rss_mib": round(rss_mib(
                    server.proc.pid), 1), "pool_used": round(used, 4),
                    "pool_cached": round(pool.get("evictable", 0) / max(pool.get("total", 1), 1),
                                         4),
                    "shared_nodes": tree.get("shared_nodes"),
                    "invariants": tree.get("invariants", []), **load.counts}
                samples.append(sample)
                f.write(json.dumps(sample) + "\n")
                f.flush()
                print(f"[soak] {elapsed / 60:5.1f} min rss={sample['rss_mib']:.0f} MiB "
                      f"pool_used={used:.2f} requests={load.counts['requests']} "
                      f"dropped={load.counts['dropped']} failed={load.counts['failed']}",
                      file=sys.stderr, flush=True)
                time.sleep(args.sample_s)
        load.stop.set()
        for t in threads:
            t.join(timeout=600)
        final = shared_tree_stats(server.url)
    slope = slope_per_min(samples, args.warmup_min)
    ok = not final.get("invariants") and all(not s["invariants"] for s in samples)
    line = (f"SOAK minutes={args.minutes:g} requests={load.counts['requests']} "
            f"dropped={load.counts['dropped']} failed={load.counts['failed']} "
            f"rss_slope_mib_per_min={slope:.3f} (after {args.warmup_min:g} min warm-up) "
            f"pool_used_max={max(s['pool_used'] for s in samples):.2f} invariants_ok={ok}")
    about = (f"{args.minutes:g}-minute soak of a sharing server ({args.clients} clients, "
             f"{args.drop_share:.0%} of requests dropped, pool {args.pool}, {model.name})")
    record(args.out / f"{name}.jsonl", "".join(json.dumps(s) + "\n" for s in samples),
           what=f"{about}: one sample per {args.sample_s:g} s (resident memory of the server's "
                f"processes, pool use, shared nodes, invariants, requests so far)")
    record(args.out / f"{name}.png", lambda p: plot(samples, p, slope, args.warmup_min),
           what="its plot: resident memory and pool use over time, slope after warm-up")
    record(args.out / f"{name}.txt", line + "\n", what=f"{about}: `{line}`")
    print(line)
    return 0 if ok and load.counts["failed"] == 0 and slope < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
