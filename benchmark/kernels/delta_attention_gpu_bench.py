"""GPU micro-benchmark: attention through per-agent deltas vs. plain attention vs. materializing.

Methods, timed side by side on the same batch (several reader agents sharing one span of base KV):

  flashinfer_plain       FlashInfer FA2 paged attention over the base KV as stored (no deltas):
                         the denominator of the target "rank-8 deltas cost <= 1.3x plain".
  triton_plain           our Triton kernel with the spans removed (same kernel, no delta work);
                         the denominator where FlashInfer is not installed (a GPU machine
                         without network gets no FlashInfer wheel).
  triton_delta           our Triton kernel reading base KV + rank-r K/V deltas + RoPE shift.
  materialize_flashinfer per-agent K/V written out first (torch), then FlashInfer plain over it
                         (``materialize_triton``: then our plain kernel, without FlashInfer).
  flashinfer_delta_key   our FlashInfer variant (key deltas only; see flashinfer_delta.py), decode
                         only, if --with-variant (first use JIT-compiles it: minutes).

    python benchmark/kernels/delta_attention_gpu_bench.py --out DIR [--quick] [--with-variant]

Writes ``DIR/delta_attention_gpu.jsonl`` (one record per configuration) and a PNG. Times are
medians of ``triton.testing.do_bench`` (CUDA events, warmed up, L2 flushed between calls).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton
from sglang_kvcmas.attention.delta_batch import DeltaRequest, LowRankDelta, SharedSpan, SpanFactors
from sglang_kvcmas.attention.delta_plan import pack_delta_factors, plan_delta_batch
from sglang_kvcmas.attention.rope import rope_inv_freq
from sglang_kvcmas.attention.triton_delta import delta_decode_triton, delta_extend_triton
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_lab.attention.reference import reader_kv

H, H_KV, D = 32, 8, 128  # Llama-3-8B-like attention (the grid varies H_KV and D)
DTYPE = torch.bfloat16
HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def build(num_agents: int, seq_len: int, num_queries: int, rank: int, seed: int = 0,
          spans: int = 1, device: str = "cuda"):
    """Readers share 90% of each sequence, the base KV at the same pool slots, read as ``spans``
    runs of alternating shifts (one owner, or leaves scattered through it); rank 0: the runs
    are re-positioned only (no factors)."""
    g = torch.Generator(device=device).manual_seed(seed)
    head = seq_len // 20
    span_len = int(seq_len * 0.9)
    own = seq_len - span_len
    pool = span_len + num_agents * own
    kb = torch.randn(pool, H_KV, D, device=device, dtype=DTYPE, generator=g)
    vb = torch.randn(pool, H_KV, D, device=device, dtype=DTYPE, generator=g)
    cuts = [span_len * j // spans for j in range(spans + 1)]
    reqs, facs = [], []
    for a in range(num_agents):
        own_slots = torch.arange(span_len + a * own, span_len + (a + 1) * own)
        slots = torch.cat([own_slots[:head], torch.arange(span_len), own_slots[head:]])
        runs = tuple(SharedSpan(head + lo, hi - lo, 3 * a - 5 + 7 * (j % 2))
                     for j, (lo, hi) in enumerate(zip(cuts, cuts[1:])))
        reqs.append(DeltaRequest(slots, num_queries, runs))

        def delta(n: int) -> LowRankDelta | None:
            if rank == 0:
                return None
            return LowRankDelta(
                torch.randn(n, H_KV, rank, device=device, generator=g),
                torch.randn(H_KV, D, rank, device=device, generator=g) * 0.05,
            )

        facs.append([SpanFactors(delta(r.length), delta(r.length)) for r in runs])
    q = torch.randn(num_agents * num_queries, H, D, device=device, dtype=DTYPE, generator=g)
    return q, kb, vb, reqs, facs


def flashinfer_plain(workspace, reqs, num_queries: int):
    """A planned plain FlashInfer wrapper over the pool (page size 1) and its run function."""
    import flashinfer

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    lens = [r.seq_len for r in reqs]
    kv_indptr = torch.tensor(
        [0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda"
    )
    qo_indptr = torch.arange(
        0, (len(reqs) + 1) * num_queries, num_queries, dtype=torch.int32, device="cuda"
    )
    idx = torch.cat([r.kv_indices for r in reqs]).to(device="cuda", dtype=torch.int32)
    w.plan(
        qo_indptr,
        kv_indptr,
        idx,
        torch.ones(len(reqs), dtype=torch.int32, device="cuda"),
        H,
        H_KV,
        D,
        1,
        causal=True,
        q_data_type=DTYPE,
        kv_data_type=DTYPE,
    )
    return lambda q, kb, vb: w.run(q, (kb.unsqueeze(1), vb.unsqueeze(1)))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(num_agents, seq_len, num_queries, rank, with_variant, workspace,
            spans: int = 1) -> dict:
    """Times of every method on one configuration (``H_KV`` and ``D`` as set by ``main``)."""
    q, kb, vb, reqs, facs = build(num_agents, seq_len, num_queries, rank, spans=spans)
    inv = rope_inv_freq(D, 5e5).cuda()
    plan = plan_delta_batch(reqs, 64, "cuda")
    packed = pack_delta_factors(plan, facs, H_KV, D, torch.float32, "cuda")
    plain_reqs = [DeltaRequest(r.kv_indices, r.num_queries) for r in reqs]
    plain_plan = plan_delta_batch(plain_reqs, 64, "cuda")
    plain_packed = pack_delta_factors(plain_plan, None, H_KV, D, torch.float32, "cuda")
    kernel = delta_decode_triton if num_queries == 1 else delta_extend_triton
    # Materialized readers: each agent's K/V written to its own slots, then plain attention.
    mat_reqs, off = [], 0
    for r in reqs:
        mat_reqs.append(DeltaRequest(torch.arange(off, off + r.seq_len), r.num_queries))
        off += r.seq_len
    if HAVE_FLASHINFER:
        fi_plain = flashinfer_plain(workspace, reqs, num_queries)
        fi_mat = flashinfer_plain(workspace, mat_reqs, num_queries)
    else:
        mat_plan = plan_delta_batch(mat_reqs, 64, "cuda")
        mat_packed = pack_delta_factors(mat_plan, None, H_KV, D, torch.float32, "cuda")

        def fi_mat(q, k, v):
            return kernel(q, k, v, mat_plan, mat_packed, inv)

    def materialize_then_attend():
        ks, vs = zip(*(reader_kv(kb, vb, r, f, inv) for r, f in zip(reqs, facs)))
        return fi_mat(q, torch.cat(ks).to(DTYPE), torch.cat(vs).to(DTYPE))

    times = {
        "triton_plain": bench(lambda: kernel(q, kb, vb, plain_plan, plain_packed, inv)),
        "triton_delta": bench(lambda: kernel(q, kb, vb, plan, packed, inv)),
    }
    if HAVE_FLASHINFER:
        times["flashinfer_plain"] = bench(lambda: fi_plain(q, kb, vb))
        times["materialize_flashinfer"] = bench(materialize_then_attend)
    else:
        times["materialize_triton"] = bench(materialize_then_attend)
    # NOTE: the variant does O(head_dim·r) CUDA-core work per (query head, key) pair; extend
    # shapes here would take seconds per call, so it is timed on decode only.
    if with_variant and num_queries == 1 and HAVE_FLASHINFER:
        from sglang_kvcmas_lab.attention.flashinfer_delta import DeltaFlashInferWrapper

        w = DeltaFlashInferWrapper(workspace, DTYPE, D)
        w.plan(reqs, plan, H, H_KV)
        times["flashinfer_delta_key"] = bench(lambda: w.run(q, kb, vb, packed.k_u, packed.k_c, inv))
    # The same read two ways must agree (bf16 output): a cheap guard on the numbers above.
    diff = (kernel(q, kb, vb, plan, packed, inv).float() - materialize_then_attend().float()).abs()
    baseline = "flashinfer_plain" if HAVE_FLASHINFER else "triton_plain"
    return {
        "ms": times,
        "baseline": baseline,
        "ratio_vs_plain": {k: v / times[baseline] for k, v in times.items()},
        "delta_over_triton_plain": times["triton_delta"] / times["triton_plain"],
        "max_abs_diff_triton_vs_materialized": float(diff.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    ap.add_argument("--with-variant", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    machine = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.version.cuda,
        "triton": triton.__version__,
    }
    global H_KV, D
    lengths = (1024, 4096, 8192) if args.quick else (1024, 4096, 8192, 32768)
    shapes = ((8, 128), (8, 64), (32, 128))  # (KV heads of 32 query heads, head_dim)
    grid = [("decode", 8, L, 1, r, s, 1) for L in lengths for r in (0, 4, 8, 16)
            for s in (shapes if r == 8 else shapes[:1])]
    grid += [("decode", 8, L, 1, r, shapes[0], 16) for L in lengths for r in (0, 8)]
    grid += [("extend", 4, L, 256, r, shapes[0], 1) for L in lengths[:3] for r in (0, 8, 16)]
    records = []
    jsonl = args.out / "delta_attention_gpu.jsonl"
    with jsonl.open("w") as f:
        for mode, agents, seq_len, nq, rank, (H_KV, D), spans in grid:
            try:
                m = measure(agents, seq_len, nq, rank, args.with_variant, workspace, spans)
            except Exception as exc:  # one failing method must not lose the other records
                m = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            rec = {
                "bench": "delta_attention_gpu",
                "commit": commit,
                "machine": machine,
                "config": {
                    "mode": mode,
                    "num_agents": agents,
                    "seq_len": seq_len,
                    "num_queries": nq,
                    "rank": rank,
                    "num_heads": H,
                    "num_kv_heads": H_KV,
                    "head_dim": D,
                    "dtype": "bfloat16",
                    "span_fraction": 0.9,
                    "spans": spans,
                },
                "metrics": m,
            }
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            r = m.get("ratio_vs_plain", {})
            print(
                f"{mode:>6} agents={agents} len={seq_len:>5} r={rank:>2} kv={H_KV} d={D} "
                f"spans={spans} "
                + " ".join(f"{k}={v:.2f}x" for k, v in r.items())
                + (m.get("error", "")),
                flush=True,
            )
    about = (f"delta attention against plain attention and materializing on {machine['gpu']} "
             f"({len(records)} configurations{', quick grid' if args.quick else ''})")
    record(jsonl, None, what=f"{about}: one record per configuration")
    record(args.out / "delta_attention_gpu.png", lambda p: plot(records, p),
           what=f"its plot ({about})")
    print(f"wrote {jsonl}")
    sys.exit(0 if all("error" not in r["metrics"] for r in records) else 1)


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: the JSONL is the result
        print("matplotlib missing: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r["metrics"]]
    modes = sorted({r["config"]["mode"] for r in ok})
    if not modes:
        return
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rs = [r for r in ok if r["config"]["mode"] == mode and r["config"]["rank"] == 8
              and (r["config"]["num_kv_heads"], r["config"]["head_dim"]) == (8, 128)
              and r["config"].get("spans", 1) == 1]
        xs = [r["config"]["seq_len"] for r in rs]
        for method in rs[0]["metrics"]["ratio_vs_plain"] if rs else []:
            ax.plot(
                xs,
                [r["metrics"]["ratio_vs_plain"][method] for r in rs],
                marker="o",
                label=method,
            )
        ax.axhline(1.3, color="red", lw=0.8, ls="--", label="target 1.3x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length per agent")
        ax.set_ylabel(f"time / {rs[0]['metrics']['baseline'] if rs else 'plain'} over base KV")
        ax.set_title(f"{mode}, rank 8, bf16")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
