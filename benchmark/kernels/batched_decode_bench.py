"""Decode of a whole batch of reader rows over re-positioned keys, per layer call: one row at a
time against the batched read, timed beside radix's decode of the same keys.

A batch of ``--rows`` readers (the model's heads: SmolLM2's 9 query / 3 KV heads, head_dim
64), each row about ``--n-kv`` keys long (lengths spread +-20%), a sixth its own, the rest
borrowed from ``--owners`` owners and cut into runs by exact leaves (one leaf token every 9),
its slots scattered over a ``--pool``-slot pool (40000, the serving benchmarks' pool):

- ``plain``: per row, gather its keys from the pool and SDPA, no shift (SGLang's torch_native
  decode: what radix runs);
- ``per_row``: per row, keys gathered grouped by shift, the query rotated once per shift
  (``attention/shifted_query.py``: served before ``batched_decode``, still served for rows with
  a low-rank correction or more than ``MAX_SHIFTS`` owners);
- ``batched``: the batch bucketed by length once per forward, each bucket read in a few tensor
  ops (``attention/batched_decode.py``: what the backend serves). The plan's cost is
  reported apart (``plan_us``, once per forward, shared by every layer);
- ``leaves``: ``batched`` with every row reading one borrowed token in ``--leaf-every`` through
  a factored leaf (rank ``--leaf-rank``, the default's): what a reader's decode serves once its
  picks are factored. Every layer's leaves are expanded before timing (a request's first decode
  step does that; the steps after read them ready: until 2026-12-06 the timed calls expanded a
  new layer each, charging every step with the first one's work), and successive calls read
  successive layers, as a decode step does.

    python benchmark/kernels/batched_decode_bench.py [--rows 4 12 24] [--n-kv 1000 3000]

Prints microseconds per layer call and the speed of each path relative to ``plain``; one thread;
writes ``results/batched_decode_bench.jsonl``. ``--model-path`` (``model_arg``) takes
another model's heads, head_dim and RoPE base (no weights are read); records name the model, and
the default ``--out`` gets ``_<model>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sglang_kvcmas.attention.batched_decode import (
    batched_shift_decode,
    plan_batched_decode,
)
from sglang_kvcmas.attention.deviation_factors import (
    FactorBasis,
    LeafReads,
    TokenFactors,
)
from sglang_kvcmas.attention.rope import ShiftRope, rope_inv_freq
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.spans import KeyShifts
from sglang_kvcmas_bench.kernel_timing import row_shifts, timed
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from torch.nn.functional import scaled_dot_product_attention

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "batched_decode_bench.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 12, 24])
    ap.add_argument("--n-kv", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--owners", type=int, default=2)
    ap.add_argument("--pool", type=int, default=40000,
                    help="KV pool slots the rows are scattered over (the benchmarks' pool)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--leaf-every", type=int, default=8,
                    help="one borrowed token in N read through a factored leaf (``leaves``)")
    ap.add_argument("--leaf-rank", type=int, default=4)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="JSONL (default: results/batched_decode_bench[_<model>].jsonl)")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    torch.set_num_threads(1)
    h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim  # embedded: 9, 3, 64
    rope, scale = ShiftRope.full(rope_inv_freq(d, model.rope_theta)), d**-0.5
    records = []
    print(f"{'rows':>4} {'n_kv':>5} {'plain':>8} {'per_row':>8} {'batched':>8} {'leaves':>8} "
          f"{'plan':>7}  us per layer call")
    for n_rows in args.rows:
        for n in args.n_kv:
            g = torch.Generator().manual_seed(n_rows * 7919 + n)
            lens = [int(n * (0.8 + 0.4 * x)) for x in torch.rand(n_rows, generator=g).tolist()]
            pool = max(args.pool, sum(lens))
            perm = torch.randperm(pool, generator=g)
            starts = [sum(lens[:i]) for i in range(n_rows)]
            slots = [perm[s : s + m] for s, m in zip(starts, lens)]
            shifts = [KeyShifts.of_row(0, row_shifts(m, args.owners, 9)) for m in lens]
            k_cache, v_cache = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
            query = torch.randn(n_rows, h, d)
            grouped = [ks.grouped(m) for ks, m in zip(shifts, lens)]  # cached per forward
            tokens = [sl[order] for sl, (order, _) in zip(slots, grouped)]

            def plain():
                for i, sl in enumerate(slots):
                    k, v = k_cache[sl].movedim(0, 1), v_cache[sl].movedim(0, 1)
                    scaled_dot_product_attention(query[i][:, None][None], k[None], v[None],
                                                 enable_gqa=True)

            def per_row():
                out = torch.empty_like(query)
                for i, tok in enumerate(tokens):
                    k, v = k_cache[tok].movedim(0, 1), v_cache[tok].movedim(0, 1)
                    out[i] = grouped_shift_decode(query[i][:, None], k, v, shifts[i].shifts,
                                                  grouped[i][1], rope, scale)[:, 0]
                return out

            plan = plan_batched_decode(slots, shifts, rope)

            def batched():
                out = torch.empty_like(query)
                batched_shift_decode(query, k_cache, v_cache, plan, rope, scale, out)
                return out

            leaves = [leaf_reads(m, args.leaf_every, args.leaf_rank, model.num_layers, hkv, d, g)
                      for m in lens]
            leaf_plan = plan_batched_decode(slots, shifts, rope, leaves=leaves)
            layer = [0]

            def with_leaves():
                out = torch.empty_like(query)
                batched_shift_decode(query, k_cache, v_cache, leaf_plan, rope, scale, out,
                                     layer=layer[0])
                layer[0] = (layer[0] + 1) % model.num_layers
                return out

            torch.testing.assert_close(batched(), per_row(), atol=3e-6, rtol=1e-5)
            for _ in range(model.num_layers):  # a request's first step expands its leaves
                with_leaves()                  # at every layer; the steps after read them
            t = {name: timed(fn, args.reps) for name, fn in
                 (("plain", plain), ("per_row", per_row), ("batched", batched),
                  ("leaves", with_leaves))}
            t["plan"] = timed(lambda: plan_batched_decode(slots, shifts, rope), args.reps)
            rec = {"model": model.name, "rows": n_rows, "n_kv": n, "owners": args.owners,
                   "leaf_every": args.leaf_every, "leaf_rank": args.leaf_rank,
                   "buckets": len(plan.buckets), **{f"{k}_us": round(v, 1) for k, v in t.items()}}
            records.append(rec)
            print(f"{n_rows:>4} {n:>5} {t['plain']:>8.0f} {t['per_row']:>8.0f} "
                  f"{t['batched']:>8.0f} {t['leaves']:>8.0f} {t['plan']:>7.0f}  plain/per_row "
                  f"{t['plain'] / t['per_row']:.2f}  plain/batched {t['plain'] / t['batched']:.2f}"
                  f"  plain/leaves {t['plain'] / t['leaves']:.2f}")
    ratios = [r["plain_us"] / r["batched_us"] for r in records]
    leafy = [r["plain_us"] / r["leaves_us"] for r in records]
    record(args.out, "".join(json.dumps(r) + "\n" for r in records),
           what=f"a batch of reader rows' decode per layer call ({model.name} heads; rows "
                f"{', '.join(map(str, args.rows))} of {', '.join(map(str, args.n_kv))} keys, "
                f"{args.owners} owners, a leaf every {args.leaf_every} borrowed tokens, rank "
                f"{args.leaf_rank}, 1 thread): plain per-row SDPA (radix), the per-row query "
                f"rotation, the batched read, and the batched read with factored leaves "
                f"(expanded at every layer before timing, as a request's first step does); "
                f"plain/batched {min(ratios):.2f}-{max(ratios):.2f}, plain/leaves "
                f"{min(leafy):.2f}-{max(leafy):.2f}")
    return 0


def leaf_reads(n: int, every: int, rank: int, layers: int, hkv: int, d: int,
               g: torch.Generator) -> LeafReads:
    """A row of ``n`` keys reading one borrowed token in ``every`` (past its own sixth: its
    head) through one fit's factored leaves of rank ``rank``, every layer's."""
    rows = torch.arange(n // 6, n, every, dtype=torch.int64)
    m = rows.numel()
    basis = FactorBasis(torch.linalg.qr(torch.randn(layers, hkv, d, rank, generator=g))[0],
                        torch.linalg.qr(torch.randn(layers, hkv, d, rank, generator=g))[0], m)
    coef = TokenFactors(0.1 * torch.randn(layers, m, hkv, rank, generator=g),
                        0.1 * torch.randn(layers, m, hkv, rank, generator=g), basis)
    return LeafReads([(rows, rows.clone(), coef)])


if __name__ == "__main__":
    raise SystemExit(main())
