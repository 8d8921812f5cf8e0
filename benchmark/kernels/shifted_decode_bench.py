"""Decode of one reader row over re-positioned borrowed keys: the ways to compute it, timed
against plain attention over the same number of keys (what radix decodes).

For one query (SmolLM2's 9 query / 3 KV heads, head_dim 64) over a row of ``n_kv`` keys whose
borrowed part (all but a sixth) has ``--owners`` owners (distinct shifts) and is cut into many
runs by the reader's exact leaves (one leaf token every ``--run`` tokens), per layer call:

- ``plain``: SDPA over the gathered keys, no shift (radix's decode; the target);
- ``reference``: rotate every borrowed key span by span (``span_reads.transform_spans``), SDPA;
- ``key_rot``: rotate every key by its own shift in one gather (``span_reads.rotate_keys``), SDPA;
- ``grouped``: gather the keys grouped by shift, rotate the query once per shift, one product per
  group (``attention/shifted_query.py``: what the backend serves).

Every path gathers the row from the pool first, as the backend does. The query-rotation-and-
gather path served before scored every key against every rotated query (S times the products):
at 8k keys and 16 owners it took over 100 ms a call.

    python benchmark/kernels/shifted_decode_bench.py [--n-kv 2048 8192] [--owners 1 3 15]

Prints microseconds per call and each path's speed relative to ``plain``; one thread.
``--model-path`` (``model_arg``) takes another model's heads, head_dim and RoPE base
(no weights are read); records name the model, and the default ``--out`` gets ``_<model>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sglang_kvcmas.attention.rope import rope_inv_freq
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.span_reads import rotate_keys, transform_spans
from sglang_kvcmas.attention.spans import KeyShifts, RowSpans
from sglang_kvcmas_bench.kernel_timing import row_shifts, timed
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from torch.nn.functional import scaled_dot_product_attention

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "shifted_decode_bench.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-kv", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--owners", type=int, nargs="+", default=[1, 3, 15])
    ap.add_argument("--run", type=int, default=9, help="a leaf token every RUN borrowed tokens")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="JSONL (default: results/shifted_decode_bench[_<model>].jsonl)")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim  # embedded: 9, 3, 64
    inv, scale = rope_inv_freq(d, model.rope_theta), d**-0.5
    records = []
    print(f"{'n_kv':>5} {'shifts':>6} {'runs':>5} {'plain':>7} {'reference':>9} "
          f"{'key_rot':>8} {'grouped':>8}  us/call (served: grouped)")
    for n in args.n_kv:
        for owners in args.owners:
            q, k, v = torch.randn(h, 1, d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
            ks = KeyShifts.of_row(0, row_shifts(n, owners, args.run))
            row = RowSpans("r", ks)
            reads = row.reads
            rows = torch.arange(n)  # the backend gathers every row from the pool first (a copy)

            def plain():
                kk, vv = k[:, rows], v[:, rows]
                return scaled_dot_product_attention(q[None], kk[None], vv[None], enable_gqa=True)[0]

            def reference():
                kk = transform_spans(k.movedim(0, 1).clone(), row, inv, {}).movedim(0, 1)
                return scaled_dot_product_attention(q[None], kk[None], v[None], enable_gqa=True)[0]

            order, groups = ks.grouped(n)

            def grouped():
                kk, vv = k[:, order], v[:, order]  # the backend gathers in this order
                return grouped_shift_decode(q, kk, vv, ks.shifts, groups, inv, scale)

            def key_rot():
                kk, vv = k[:, rows], v[:, rows]
                kk = rotate_keys(kk.movedim(0, 1), ks, inv).movedim(0, 1)
                return scaled_dot_product_attention(q[None], kk[None], vv[None], enable_gqa=True)[0]

            ref = reference()
            for fn in (key_rot, grouped):  # same keys (gathered in another order)
                torch.testing.assert_close(fn(), ref, atol=2e-6, rtol=1e-5)
            t = {name: timed(fn, args.reps) for name, fn in
                 (("plain", plain), ("reference", reference), ("key_rot", key_rot),
                  ("grouped", grouped))}
            rec = {"model": model.name, "n_kv": n, "shifts": int(ks.shifts.numel()), "runs": len(reads),
                   **{f"{k_}_us": round(v_, 1) for k_, v_ in t.items()}}
            records.append(rec)
            print(f"{n:>5} {rec['shifts']:>6} {len(reads):>5} {t['plain']:>7.0f} "
                  f"{t['reference']:>9.0f} {t['key_rot']:>8.0f} "
                  f"{t['grouped']:>8.0f}  "
                  f"plain/key_rot {t['plain'] / t['key_rot']:.2f}  "
                  f"plain/grouped {t['plain'] / t['grouped']:.2f}")
    ratios = [r["plain_us"] / r["grouped_us"] for r in records]
    record(args.out, "".join(json.dumps(r) + "\n" for r in records),
           what=f"one reader row's decode per layer call ({model.name} heads, 1 thread; a leaf "
                f"every {args.run} borrowed tokens; {', '.join(map(str, args.owners))} owners; "
                f"{', '.join(map(str, args.n_kv))} keys): plain SDPA (radix), the span-by-span "
                f"reference, keys rotated in one gather, the grouped decode served; "
                f"plain/grouped {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
