"""Decode of one reader row over re-positioned borrowed spans: the ways to compute it, timed.

For one query (SmolLM2's 9 query / 3 KV heads, head_dim 64) over a row of ``n_kv`` keys whose
borrowed spans are cut into many runs by the reader's exact leaves (one leaf token every
``--run`` tokens, two owners), per layer call:

- ``rotate_keys``: the reference: rotate every borrowed key by its shift, then SDPA;
- ``run_loop``: rotate the query per shift and score each run of keys in a Python loop (the
  serving path before the gather);
- ``gather``: rotate the query per shift, score every key against every rotated query in one
  product, keep each key's own shift (``attention/shifted_query.py``, the serving path).

    python benchmark/kernels/shifted_decode_bench.py [--n-kv 300 600 1200] [--run 9]

Prints microseconds per call and the speedup of ``gather`` over the others; one thread.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.rope import rope_cos_sin, rope_inv_freq, rotate_halves
from sglang_kvcmas.attention.shifted_query import key_shift_index, shift_runs, shifted_query_decode
from sglang_kvcmas.attention.span_reads import transform_spans
from sglang_kvcmas.attention.spans import RowSpans, SharedSpan

RESULTS = Path(__file__).resolve().parent / "results"


def run_loop(q, k, v, shifts, runs, inv_freq, scale):
    """The per-run loop the serving path used before (kept here for the comparison)."""
    h, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    g = h // hkv
    cos, sin = rope_cos_sin(-shifts, inv_freq)
    q_s = rotate_halves(q.reshape(hkv, g, d).float(), cos[:, None, None, :],
                        sin[:, None, None, :]) * scale
    scores = torch.empty((hkv, g, k.shape[1]))
    for start, end, i in runs:
        scores[:, :, start:end] = q_s[i] @ k[:, start:end].transpose(1, 2)
    return (torch.softmax(scores, dim=-1) @ v).reshape(h, 1, d)


def timed(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-kv", type=int, nargs="+", default=[300, 600, 1200])
    ap.add_argument("--run", type=int, default=9, help="a leaf token every RUN borrowed tokens")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "shifted_decode_bench.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, hkv, d = 9, 3, 64
    inv = rope_inv_freq(d, 1e5)
    records = []
    print(f"{'n_kv':>5} {'runs':>5} {'rotate_keys':>12} {'run_loop':>9} {'gather':>7}  us/call")
    for n in args.n_kv:
        q, k, v = torch.randn(h, 1, d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
        head = n // 6
        spans = [(s, min(s + args.run - 1, n), -40 if (s // args.run) % 3 else 17)
                 for s in range(head, n - 8, args.run)]
        shifts, runs = shift_runs(n, spans)
        index = key_shift_index(n, runs)
        row = RowSpans("r", tuple(SharedSpan(a, b - a, sh) for a, b, sh in spans if b > a))

        def reference():
            kk = transform_spans(k.movedim(0, 1).clone(), row, inv, {}).movedim(0, 1)
            return scaled_dot_product_attention(q[None], kk[None], v[None], enable_gqa=True)[0]

        t = {"rotate_keys": timed(reference, args.reps),
             "run_loop": timed(lambda: run_loop(q, k, v, shifts, runs, inv, d**-0.5), args.reps),
             "gather": timed(lambda: shifted_query_decode(q, k, v, shifts, index, inv, d**-0.5),
                             args.reps)}
        torch.testing.assert_close(shifted_query_decode(q, k, v, shifts, index, inv, d**-0.5),
                                   reference(), atol=2e-6, rtol=1e-5)
        rec = {"n_kv": n, "runs": len(runs), **{f"{k_}_us": round(v_, 1) for k_, v_ in t.items()}}
        records.append(rec)
        print(f"{n:>5} {len(runs):>5} {t['rotate_keys']:>12.0f} {t['run_loop']:>9.0f} "
              f"{t['gather']:>7.0f}  gather {t['run_loop'] / t['gather']:.1f}x faster than the "
              f"loop, {t['rotate_keys'] / t['gather']:.1f}x than rotating keys")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
