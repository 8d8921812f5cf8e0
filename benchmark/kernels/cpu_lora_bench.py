"""LoRA deltas of one forward on CPU: SGLang's ``torch_native`` ops against the grouped ops.

SGLang's ``torch_native`` LoRA ops walk a batch segment by segment (one per request when their
adapters alternate); ``lora/grouped_ops.py`` groups the batch's tokens by adapter once per
forward and runs one matmul per adapter present. Both compute every LoRA projection of a
SmolLM2-135M forward (30 layers; qkv, o, gate_up, down; ranks 8, and 24 for the centroid of the
retired ``rebase`` mode, SGLang's LoRA buffers sized to the largest rank) for the batches a LoRA
panel serves:

- ``decode 9``: 9 requests, one token each, 3 adapters alternating (stock's decode step);
- ``decode 12``: the same plus 3 centroid requests (``rebase``);
- ``prefill 9x200``: 9 requests of 200 tokens (stock's prefill of a round);
- ``prefill 9x30+3x200``: 3 centroid prefills of 200 tokens and 9 readers' 30 recomputed tokens.

    python benchmark/kernels/cpu_lora_bench.py [--reps 7] [--threads 2]

Prints milliseconds per forward (LoRA deltas only, the base projections excluded) and the
speedup; writes ``results/cpu_lora_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from sglang_kvcmas.lora.grouped_ops import AdapterGroups, lora_a, lora_b
from sglang_kvcmas_bench.results import record

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30
RANKS = [8, 8, 8, 24]  # planner, solver, critic, the centroid (their summed rank)
SCALINGS = [2.0, 2.0, 2.0, 2.0]
MAX_RANK = max(RANKS)
BATCHES = {
    "decode 9": ([1] * 9, [0, 1, 2] * 3),
    "decode 12": ([1] * 12, [3, 0, 1, 2] * 3),
    "prefill 9x200": ([200] * 9, [0, 1, 2] * 3),
    "prefill 9x30+3x200": ([200] * 3 + [30] * 9, [3] * 3 + [0, 1, 2] * 3),
}


def projections(gen: torch.Generator) -> list[tuple]:
    """(A, B, slices, offsets, d_in) per LoRA projection of a layer, in SGLang's buffer shapes."""
    def pair(slices: int, d_in: int, offsets: list[int]) -> tuple:
        return (torch.randn(len(RANKS), slices * MAX_RANK, d_in, generator=gen) * 0.02,
                torch.randn(len(RANKS), offsets[-1], MAX_RANK, generator=gen) * 0.02,
                slices, offsets, d_in)
    return [pair(3, HIDDEN, [0, HIDDEN, HIDDEN + KV, HIDDEN + 2 * KV]),
            pair(1, HIDDEN, [0, HIDDEN]),
            pair(2, HIDDEN, [0, INTERMEDIATE, 2 * INTERMEDIATE]),
            pair(1, INTERMEDIATE, [0, HIDDEN])]


def forward_sglang(ops, projs, xs, seg_lens, slots) -> None:
    meta = (torch.tensor(slots, dtype=torch.int32), torch.tensor(seg_lens, dtype=torch.int32),
            torch.tensor(RANKS, dtype=torch.int32))
    scalings = torch.tensor(SCALINGS)
    for _ in range(LAYERS):
        for a, b, slices, offsets, d_in in projs:
            base = torch.zeros(xs[d_in].shape[0], offsets[-1])
            ops.sgemm_lora_b_fwd(ops.sgemm_lora_a_fwd(xs[d_in], a, *meta, scalings, slices), b,
                                 *meta, torch.tensor(offsets, dtype=torch.int32), base)


def forward_grouped(projs, xs, seg_lens, slots) -> None:
    groups = AdapterGroups.build(seg_lens, slots, RANKS, SCALINGS)  # once per forward
    for _ in range(LAYERS):
        for a, b, slices, offsets, d_in in projs:
            base = torch.zeros(xs[d_in].shape[0], offsets[-1])
            lora_b(lora_a(xs[d_in], a, groups, slices), b, groups, offsets, base)


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "cpu_lora_bench.jsonl")
    args = ap.parse_args()
    from sglang.srt.lora.torch_ops import lora_ops
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    projs = projections(gen)
    records = []
    print(f"{'batch':22s} {'sglang ms':>10s} {'grouped ms':>11s} {'speedup':>8s}")
    for name, (seg_lens, slots) in BATCHES.items():
        tokens = sum(seg_lens)
        xs = {d: torch.randn(tokens, d, generator=gen) for d in (HIDDEN, INTERMEDIATE)}
        stock = best_ms(lambda: forward_sglang(lora_ops, projs, xs, seg_lens, slots), args.reps)
        ours = best_ms(lambda: forward_grouped(projs, xs, seg_lens, slots), args.reps)
        print(f"{name:22s} {stock:10.1f} {ours:11.1f} {stock / ours:7.2f}x")
        records.append({"batch": name, "tokens": tokens, "requests": len(seg_lens),
                        "sglang_ms": round(stock, 2), "grouped_ms": round(ours, 2),
                        "speedup": round(stock / ours, 3), "threads": args.threads,
                        "reps": args.reps})
    record(args.out, "".join(json.dumps(r) + "\n" for r in records),
           what=f"LoRA deltas of one SmolLM2-135M forward on CPU ({args.threads} threads): "
                f"SGLang's torch_native ops against the grouped ops, per batch: "
                + ", ".join(f"{r['batch']} {r['speedup']:.2f}x" for r in records))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
