"""CPU micro-benchmark of the torch reference: reading through deltas vs. plain attention.

For each (mode, length, rank) it times, side by side in one run, attention of a batch of reader
agents over the same pool (a) plain, exactly as stored, (b) through shared spans with rank-r K/V
deltas and position shifts by the reference (``reference.delta_attention``), and (c) the same by
the planned torch path (``torch_delta``: rotations precomputed once per batch, LoRA-form values;
its per-batch plan time is reported separately — it is shared by every layer). Reported: the
median over repeats of the per-repeat ratio to plain (the three are timed back to back, rotating
which goes first, each as the minimum of 3 calls, so machine noise hits all and preemption is
filtered), with absolute milliseconds as context. Writes one JSONL record per configuration
and a PNG.

    python benchmark/kernels/delta_attention_bench.py [--out DIR] [--repeats N]

Shapes follow the embedded model (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64), float32,
one torch thread (the CI machines are 2 shared cores; one thread keeps the ratio stable).
``--model-path`` (``model_arg``) takes another model's heads, head_dim and RoPE base
(no weights are read); records name the model, and the output files get ``_<model>``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from sglang_kvcmas.attention.delta_batch import (
    DeltaRequest,
    LowRankDelta,
    SharedSpan,
    SpanFactors,
)
from sglang_kvcmas.attention.rope import rope_inv_freq
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_lab.attention.reference import delta_attention, plain_attention
from sglang_kvcmas_lab.attention.torch_delta import plan_torch_delta, run_torch_delta

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
ROPE_THETA = 1e5
NUM_AGENTS = 4


def build(seq_len: int, num_queries: int, rank: int, seed: int = 0,
          shape: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """NUM_AGENTS readers share one span (90% of the sequence) on the same pool slots.
    ``shape``: (query heads, KV heads, head_dim), default the embedded model's."""
    heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    head = max(1, seq_len // 20)
    span_len = min(seq_len - num_queries - head, int(seq_len * 0.9))
    pool = seq_len * NUM_AGENTS + span_len
    k_buffer = torch.randn(pool, kv_heads, head_dim, generator=g)
    v_buffer = torch.randn(pool, kv_heads, head_dim, generator=g)
    shared = torch.arange(span_len)  # the base copy of the shared span
    requests, factors, free = [], [], span_len
    for a in range(NUM_AGENTS):
        own = seq_len - span_len
        own_slots = torch.arange(free, free + own)
        free += own
        slots = torch.cat([own_slots[:head], shared, own_slots[head:]])
        requests.append(DeltaRequest(slots, num_queries, (SharedSpan(head, span_len, 3 * a - 4),)))

        def delta() -> LowRankDelta:
            return LowRankDelta(
                torch.randn(span_len, kv_heads, rank, generator=g),
                torch.randn(kv_heads, head_dim, rank, generator=g) * 0.1,
            )

        factors.append([SpanFactors(delta(), delta())])
    q = torch.randn(num_queries * NUM_AGENTS, heads, head_dim, generator=g)
    return q, k_buffer, v_buffer, requests, factors


def measure(
    seq_len: int, num_queries: int, rank: int, repeats: int, warmup: int, inner: int = 3,
    shape: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM),
    rope_theta: float = ROPE_THETA,
) -> dict:
    q, kb, vb, reqs, facs = build(seq_len, num_queries, rank, shape=shape)
    inv = rope_inv_freq(shape[2], rope_theta)
    t0 = time.perf_counter()
    plan = plan_torch_delta(reqs, inv)
    plan_s = time.perf_counter() - t0
    methods = {
        "plain": lambda: plain_attention(q, kb, vb, reqs),
        "reference": lambda: delta_attention(q, kb, vb, reqs, facs, inv),
        "planned": lambda: run_torch_delta(q, kb, vb, plan, facs),
    }

    def timed(fn) -> float:
        # Min over a few back-to-back calls: on a shared machine, preemption only adds time.
        best = float("inf")
        for _ in range(inner):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    for _ in range(warmup):
        for fn in methods.values():
            fn()
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
        t = {n: timed(methods[n]) for n in order}
        for n in names:
            times[n].append(t[n])
        for n in names[1:]:
            ratios[n].append(t[n] / t["plain"])
    out = {f"{n}_ms": 1e3 * statistics.median(times[n]) for n in names}
    out["plan_ms"] = 1e3 * plan_s
    for n in names[1:]:
        q1, med, q3 = statistics.quantiles(ratios[n], n=4)
        out.update(
            {
                f"ratio_{n}_median": statistics.median(ratios[n]),
                f"ratio_{n}_q1": q1,
                f"ratio_{n}_q3": q3,
            }
        )
    return out


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["config"]["mode"] for r in records})
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for k, rank in enumerate(sorted({r["config"]["rank"] for r in records})):
            rs = [r for r in records if r["config"]["mode"] == mode and r["config"]["rank"] == rank]
            xs = [r["config"]["seq_len"] for r in rs]
            for method, style in (("planned", "-"), ("reference", ":")):
                m = [r["metrics"] for r in rs]
                med = [x[f"ratio_{method}_median"] for x in m]
                err = [
                    [a - x[f"ratio_{method}_q1"] for a, x in zip(med, m, strict=True)],
                    [x[f"ratio_{method}_q3"] - a for a, x in zip(med, m, strict=True)],
                ]
                ax.errorbar(
                    xs,
                    med,
                    yerr=err,
                    marker="o",
                    ls=style,
                    capsize=3,
                    color=f"C{k}",
                    label=f"{method}, rank {rank}",
                )
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("time through deltas / plain attention")
        ax.set_title(f"torch on CPU, {mode}, {NUM_AGENTS} agents")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    shape = (model.num_heads, model.num_kv_heads, model.head_dim)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    records = []
    print(
        f"{'mode':>7} {'len':>5} {'rank':>4} {'plain ms':>9} {'ref ms':>8} {'plan+run ms':>11}"
        f" {'ref/plain':>9} {'planned/plain (IQR)':>20}"
    )
    for mode, num_queries in (("decode", 1), ("extend", 32)):
        for seq_len in args.lengths:
            for rank in args.ranks:
                m = measure(seq_len, num_queries, rank, args.repeats, args.warmup,
                            shape=shape, rope_theta=model.rope_theta)
                rec = {
                    "bench": "delta_attention_torch_cpu",
                    "commit": commit(),
                    "machine": machine,
                    "model": model.name,
                    "config": {
                        "mode": mode,
                        "seq_len": seq_len,
                        "num_queries": num_queries,
                        "rank": rank,
                        "num_agents": NUM_AGENTS,
                        "num_heads": shape[0],
                        "num_kv_heads": shape[1],
                        "head_dim": shape[2],
                        "dtype": "float32",
                        "repeats": args.repeats,
                    },
                    "metrics": m,
                }
                records.append(rec)
                print(
                    f"{mode:>7} {seq_len:>5} {rank:>4} {m['plain_ms']:>9.2f}"
                    f" {m['reference_ms']:>8.2f} {m['planned_ms']:>6.2f}+{m['plan_ms']:<4.2f}"
                    f" {m['ratio_reference_median']:>9.2f} {m['ratio_planned_median']:>9.2f}"
                    f" ({m['ratio_planned_q1']:.2f}-{m['ratio_planned_q3']:.2f})",
                    flush=True,
                )
    stem = model.named(Path("delta_attention_bench")).name
    about = (f"reading KV through deltas against plain attention on CPU (1 thread, {model.name} "
             f"shapes, {NUM_AGENTS} agents): decode and extend, "
             f"{', '.join(map(str, args.lengths))} "
             f"tokens, ranks {', '.join(map(str, args.ranks))}, {args.repeats} repeats")
    jsonl = record(args.out / f"{stem}.jsonl", "".join(json.dumps(r) + "\n" for r in records),
                   what=f"{about}: per configuration the plain, torch-reference and planned "
                        f"times and their median ratios")
    png = record(args.out / f"{stem}.png", lambda p: plot(records, p),
                 what=f"its plot: the ratios ({about})")
    print(f"wrote {jsonl} and {png}")


if __name__ == "__main__":
    main()
