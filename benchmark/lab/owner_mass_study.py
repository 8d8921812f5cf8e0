"""Study: can the owner's own pass tell which shared tokens deviate most for another agent?

At a layer, a shared token's attention output is λ·o_head + (1 − λ)·o_rest,
where λ is its attention mass on the agent head. Changing the head changes the token by an amount
that scales with λ. The owner's pass can record λ for free (it computes the attention anyway), so
a reader could recompute the tokens with the largest owner-side head mass — no reference prefill,
no probe pass. This study measures it the way the serving path would apply it: the reader's
cache is the owner's KV re-positioned, with a recomputed set R of shared tokens computed in the
reader's context (attending to the borrowed KV), then the suffix; KL over a 32-token
teacher-forced continuation against the reader's exact prefill.

Selectors, each at several budgets (share of shared tokens recomputed, boundary included):
``boundary`` (first k tokens only), ``mass`` (boundary + top owner head mass, mean over layers
1-29), ``mass_l0`` (layer 0 only), ``mass_sub`` (7 probe layers), ``random`` (boundary + random), ``oracle`` (boundary + top true deviation energy: the
ceiling of any selector).

    python benchmark/lab/owner_mass_study.py [--cases 6] [--model-path NAME]

``--model-path`` (``model_arg``; Llama or Qwen2 with a ChatML template): the model
studied (``mass_sub`` probes the layers of ``PROBE_LAYERS`` it has); records and the summary
name it, and the default ``--out`` gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.reference import (
    load_lab_model,
    make_reference,
    teacher_forced_logits,
)
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids
from sglang_kvcmas_lab.correction.fidelity import teacher_forced
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama, rotate

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "owner_mass_study"
PROBE_LAYERS = (2, 6, 10, 14, 18, 22, 26)
"""A cheap subset (7 of 30 layers) a serving pass can afford to probe."""


def chat_ids(tok, system: str, user: str) -> list[int]:
    return chat_prompt_ids(tok, [{"role": "system", "content": system},
                                 {"role": "user", "content": user}])


@torch.inference_mode()
def owner_pass(model: RefLlama, ids: torch.Tensor, head_from: int, head_to: int):
    """Exact prefill that also returns, per token and layer, its attention mass on head tokens
    ``[head_from, head_to)`` (mean over query heads). Returns (KVCache, mass [L, T])."""
    s = model.spec
    pos = torch.arange(ids.numel())
    h = model.embed(ids)
    ks, vs, mass = [], [], []
    for layer in range(s.num_layers):
        q, k, v = model.qkv(layer, h)
        ks.append(k)
        vs.append(v)
        qr = rotate(q, pos, s.rope_theta).transpose(0, 1)  # [H, T, d]
        kr = rotate(k, pos, s.rope_theta).transpose(0, 1)
        kr = kr.repeat_interleave(s.num_heads // s.num_kv_heads, dim=0)
        scores = (qr @ kr.transpose(1, 2)) / s.head_dim**0.5
        scores = scores.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
        p = scores.softmax(-1)
        mass.append(p[:, :, head_from:head_to].sum(-1).mean(0))
        out = (p @ vs[-1].transpose(0, 1).repeat_interleave(s.num_heads // s.num_kv_heads, 0))
        h = model.finish_layer(layer, h, out.transpose(0, 1).reshape(ids.numel(), -1))
    return KVCache(ks, vs, pos), torch.stack(mass)


def rerotate(cache: KVCache, idx: torch.Tensor, new_pos: torch.Tensor) -> KVCache:
    """Tokens ``idx`` of a pre-RoPE cache placed at ``new_pos`` (pre-RoPE keys move as is)."""
    return KVCache([k[idx] for k in cache.k], [v[idx] for v in cache.v], new_pos)


@torch.inference_mode()
def reader_cache(model, reader_exact: KVCache, owner: KVCache, h_r: int, h_o: int, n_shared: int,
                 recompute: torch.Tensor, reader_ids: torch.Tensor, prompt_len: int):
    """Reader head exact + owner's shared KV at reader positions, ``recompute`` (shared offsets)
    recomputed in the reader's context, then the suffix. Returns (cache, last logits)."""
    keep = torch.ones(n_shared, dtype=torch.bool)
    keep[recompute] = False
    borrowed = torch.arange(n_shared)[keep]
    head = rerotate(reader_exact, torch.arange(h_r), torch.arange(h_r))
    base = rerotate(owner, h_o + borrowed, h_r + borrowed)
    past = KVCache.concat([head, base])
    new_pos = torch.cat([h_r + recompute, torch.arange(h_r + n_shared, prompt_len)])
    out = model.forward(reader_ids[new_pos], positions=new_pos, past=past)
    return KVCache.concat([past, out.kv]), out.logits[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--budgets", default="0.05,0.1,0.2")
    ap.add_argument("--boundary", type=int, default=16)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="results stem (default: results/owner_mass_study[_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    bench_model = model_from_args(ap, args, lab=True)
    args.out = bench_model.out_or_named(args.out, DEFAULT_OUT)
    torch.manual_seed(0)
    from sglang_kvcmas_examples.datasets import gsm8k

    tok, model = load_lab_model(bench_model)
    probe_layers = [layer for layer in PROBE_LAYERS if layer < model.spec.num_layers]
    items = gsm8k()
    names = list(DEBATERS)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = []
    t0 = time.perf_counter()
    for case in range(args.cases):
        q = items[case]
        answers = "\n".join(f"{n}: {items[case + 10 * (i + 1)].answer}" for i, n in enumerate(names))
        user = f"Question: {q.question}" + (f"\n\nRound 1 answers:\n{answers}\n\nThis is round 2. "
                                            "Considering the answers above, give your updated "
                                            "answer." if case % 2 else "\n\nGive your answer.")
        o_name, r_name = names[case % 3], names[(case + 1) % 3]
        o_ids = torch.tensor(chat_ids(tok, DEBATERS[o_name], user))
        r_ids = torch.tensor(chat_ids(tok, DEBATERS[r_name], user))
        # the head = system turn; shared = user turn (everything until the assistant opener)
        h_o = int((o_ids == tok.convert_tokens_to_ids("<|im_end|>")).nonzero()[0]) + 2
        h_r = int((r_ids == tok.convert_tokens_to_ids("<|im_end|>")).nonzero()[0]) + 2
        n_shared = len(r_ids) - h_r - 3  # '<|im_start|>assistant\n' is the suffix
        assert torch.equal(o_ids[h_o:h_o + n_shared], r_ids[h_r:h_r + n_shared])
        first_diff = int((o_ids[:h_o][: min(h_o, h_r)] != r_ids[: min(h_o, h_r)]).nonzero()[0])
        owner, mass = owner_pass(model, o_ids, first_diff, h_o)
        ref = make_reference(model, r_ids, 32)
        dev = sum(((ref.cache.k[layer][h_r:h_r + n_shared] - owner.k[layer][h_o:h_o + n_shared])
                   .pow(2).sum((1, 2)) + (ref.cache.v[layer][h_r:h_r + n_shared] -
                   owner.v[layer][h_o:h_o + n_shared]).pow(2).sum((1, 2)))
                  for layer in range(1, model.spec.num_layers))
        m_shared = mass[:, h_o:h_o + n_shared]
        scores = {"mass": m_shared[1:].mean(0), "mass_l0": m_shared[0],
                  "mass_sub": m_shared[probe_layers].mean(0),
                  "random": torch.rand(n_shared), "oracle": dev}
        k = min(args.boundary, n_shared)
        bnd = torch.arange(k)

        def run(sel: torch.Tensor) -> float:
            cache, last = reader_cache(model, ref.cache, owner, h_r, h_o, n_shared, sel, r_ids,
                                       len(r_ids))
            tf = teacher_forced(ref.tf_logits, teacher_forced_logits(model, cache, last,
                                                                     ref.cont_ids))
            return tf.mean_kl

        naive = run(torch.empty(0, dtype=torch.long))
        rec = {"model": bench_model.name, "case": case, "shared": n_shared, "naive_kl": naive, "boundary_kl": run(bnd)}
        for name, sc in scores.items():
            sc = sc.clone()
            sc[bnd] = float("inf")
            order = torch.argsort(sc, descending=True)
            for b in budgets:
                n = max(k, int(round(b * n_shared)))
                sel = torch.sort(order[:n]).values
                rec[f"{name}@{b}"] = run(sel)
                cap = dev[sel].sum() / dev.sum()
                rec[f"{name}@{b}_energy"] = float(cap)
        rows.append(rec)
        print(json.dumps({k2: (round(v, 6) if isinstance(v, float) else v)
                          for k2, v in rec.items()}), flush=True)
    keys = [k2 for k2 in rows[0] if k2.endswith("_kl") or "@" in k2 and "energy" not in k2]
    naive = statistics.fmean(r["naive_kl"] for r in rows)
    lines = [f"{'selector':<18}{'mean KL':>10}{'KL recovered':>14}{'dev energy':>12}"]
    for key in keys:
        kl = statistics.fmean(r[key] for r in rows)
        en = (statistics.fmean(r[key + "_energy"] for r in rows) if key + "_energy" in rows[0]
              else float("nan"))
        lines.append(f"{key:<18}{kl:>10.2e}{1 - kl / naive:>14.3f}{en:>12.3f}")
    lines.append(f"model {bench_model.name}; {len(rows)} cases, "
                 f"{time.perf_counter() - t0:.0f} s; command: python "
                 "benchmark/lab/owner_mass_study.py " + " ".join(sys.argv[1:]))
    text = "\n".join(lines)
    print(text)
    about = (f"whether the owner's own head mass picks the shared tokens that deviate most for "
             f"a reader, by selector and budget ({bench_model.name}, {len(rows)} cases)")
    record(args.out.with_suffix(".txt"), text + "\n", what=f"{about}: the summary table")
    record(args.out.with_suffix(".jsonl"), "".join(json.dumps(r) + "\n" for r in rows),
           what=f"its records, one per case ({about})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
