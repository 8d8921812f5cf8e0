"""An owner's extend at a probe layer on CPU: its attention and head mass, the ways to compute
them, timed against the attention alone and against SGLang's torch backend.

For one row of ``n_q`` new tokens over ``n_kv`` keys (SmolLM2's 9 query / 3 KV heads, head_dim 64,
the head's first ``--head`` keys), per layer call:

- ``padded``: SDPA with the query padded to the whole sequence, its last ``n_q`` rows kept
  (SGLang's ``torch_native`` extend: what radix runs, with no mass);
- ``tail``: SDPA over the new queries only (``span_reads.tail_attention``: no mass);
- ``tail_mass``: ``tail`` plus ``span_reads.head_mass``, which scores every key again (what the
  probe cost before);
- ``fused``: ``span_reads.tail_attention_and_mass``, the mass from the flash kernel's log-sum-exp
  (what the backend serves on CPU).

    python benchmark/kernels/probe_mass_bench.py [--shapes 150:600 150:1200 600:600 40:1500]

Prints microseconds per call and the ratios to ``tail``; one thread. ``--model-path``
(``model_arg``) takes another model's heads and head_dim (no weights are read).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sglang_kvcmas.attention.span_reads import (
    head_mass,
    padded_tail_attention,
    tail_attention,
    tail_attention_and_mass,
)
from sglang_kvcmas_bench.kernel_timing import timed
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "probe_mass_bench.jsonl"


def methods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head: int, scale: float) -> dict:
    """The ways to compute one row's probed extend, by name (q [H, n_q, d]; k, v [H_kv, n_kv,
    d]; the head: keys ``0 .. head - 1``)."""
    n_kv = k.shape[-2]
    n_prefix, pos = n_kv - q.shape[-2], torch.arange(n_kv)
    return {
        "padded": lambda: padded_tail_attention(q, k, v, n_prefix, True, scale, True),
        "tail": lambda: tail_attention(q, k, v, n_prefix, True, scale, True),
        "tail_mass": lambda: (tail_attention(q, k, v, n_prefix, True, scale, True),
                              head_mass(q, k, pos[n_prefix:], pos, scale, 0, head)),
        "fused": lambda: tail_attention_and_mass(q, k, v, n_prefix, scale, 0, head),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["150:600", "150:1200", "600:600", "40:1500"],
                    help="n_q:n_kv pairs (n_q new tokens over n_kv keys)")
    ap.add_argument("--head", type=int, default=40, help="keys of the agent's head")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="JSONL (default: results/probe_mass_bench[_<model>].jsonl)")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim  # embedded: 9, 3, 64
    scale = d**-0.5
    records = []
    print(f"{'n_q':>5} {'n_kv':>5} {'padded':>8} {'tail':>7} {'tail_mass':>9} {'fused':>7}"
          "  us/call (served: fused)")
    for shape in args.shapes:
        n_q, n_kv = map(int, shape.split(":"))
        q, k, v = torch.randn(h, n_q, d), torch.randn(hkv, n_kv, d), torch.randn(hkv, n_kv, d)
        head = min(args.head, n_kv)
        fns = methods(q, k, v, head, scale)
        out, mass = fns["fused"]()
        torch.testing.assert_close(out, fns["tail"](), atol=0, rtol=0)
        torch.testing.assert_close(mass, fns["tail_mass"]()[1], atol=1e-6, rtol=1e-4)
        t = {name: timed(fn, args.reps) for name, fn in fns.items()}
        rec = {"model": model.name, "n_q": n_q, "n_kv": n_kv, "head": head,
               **{f"{name}_us": round(us, 1) for name, us in t.items()}}
        records.append(rec)
        print(f"{n_q:>5} {n_kv:>5} {t['padded']:>8.0f} {t['tail']:>7.0f} {t['tail_mass']:>9.0f} "
              f"{t['fused']:>7.0f}  tail_mass/tail {t['tail_mass'] / t['tail']:.2f}  "
              f"fused/tail {t['fused'] / t['tail']:.2f}  padded/fused {t['padded'] / t['fused']:.2f}")
    before = [r["tail_mass_us"] / r["tail_us"] for r in records]
    after = [r["fused_us"] / r["tail_us"] for r in records]
    record(args.out, "".join(json.dumps(r) + "\n" for r in records),
           what=f"a probed owner row's extend per layer call ({model.name} heads, 1 thread; "
                f"{', '.join(args.shapes)} n_q:n_kv): SGLang's padded extend, attention alone, "
                f"attention plus a second scoring for the mass, the fused mass served; "
                f"over attention alone {min(before):.2f}-{max(before):.2f}x before, "
                f"{min(after):.2f}-{max(after):.2f}x fused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
