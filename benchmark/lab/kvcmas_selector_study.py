"""Why selective recompute is weak on short debate segments: a per-turn selector study.

Each non-owner turn of one debate is isolated: the reader holds its exact prefix (from the dense
reference) and reads the other agents' segments from their owners' exact caches, so only this
turn's correction is measured (no chain). Per turn it prints:

- how concentrated the true deviation is: energy (K and V, layers >= 1) in the truly worst 15%
  of tokens, in the 15% CacheBlend picks by layer-1 value deviation, and their overlap;
- KL recovered vs naive reuse (ratio of means over turns at the end) of: exact K/V on the truly
  worst 15% (a bound for any 15% selector), CacheBlend-15% (the real one-pass recompute), and
  KVCMAS's selectors at the same recompute budget ("v", "impact", deep-layer "attn").

    python benchmark/lab/kvcmas_selector_study.py --answer-tokens 40 --rounds 2
    python benchmark/lab/kvcmas_selector_study.py --answer-tokens 128 --rounds 2
    python benchmark/lab/kvcmas_selector_study.py --workload chain --answer-tokens 40

``--model-path`` (``model_arg``; Llama or Qwen2 with a ChatML template): the model
studied; the output's first line names it.
"""

from __future__ import annotations

import argparse

import torch
from sglang_kvcmas_bench.lab.reference import load_lab_model, teacher_forced_logits
from sglang_kvcmas_bench.lab.transcripts import make_transcript
from sglang_kvcmas_bench.lab.workloads import debate, reviewer_chain
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_lab.correction import ReadRequest, SharedRead, create_builder
from sglang_kvcmas_lab.correction.fidelity import teacher_forced
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

METHODS = {
    "cacheblend_15": ("cacheblend", {"rho": 0.15}),
    "kvcmas_v_15": ("kvcmas", {"score": "v", "rho": 0.15, "num_first": 0}),
    "kvcmas_impact_15": ("kvcmas", {"score": "impact", "rho": 0.15, "num_first": 0}),
    "kvcmas_attn_15": ("kvcmas", {"score": "attn", "rho": 0.15, "num_first": 0}),
    "kvcmas_attn_25_f4": ("kvcmas", {"score": "attn", "rho": 0.25, "num_first": 4}),
}


def owner_bases(model: RefLlama, tr) -> dict[int, tuple[str, KVCache]]:
    """Segment j -> (owner, the owner's exact cache of it): task = turn 0's, answer j = turn j-1's."""
    out = {}
    for j in range(len(tr.turns) + 1):
        turn = tr.turns[max(0, j - 1)]
        seg = turn.seg_ids[0] if j == 0 else turn.answer_seg
        ids = torch.cat([tr.heads[turn.agent], *(turn.seg_ids[:1] if j == 0 else turn.seg_ids),
                         *([] if j == 0 else [seg])])
        kv = model.forward(ids).kv
        out[j] = (turn.agent, kv.slice(len(kv) - seg.numel(), len(kv)))
    return out


def isolated_request(tr, ti: int, bases) -> ReadRequest | None:
    """Turn ti with an exact prefix and exact owner bases; None for owner turns."""
    turn = tr.turns[ti]
    prev = [i for i in range(ti) if tr.turns[i].agent == turn.agent]
    held = len(tr.turns[prev[-1]].seg_ids) + 1 if prev else 0
    if held == len(turn.seg_ids) or any(bases[j][0] == turn.agent
                                        for j in range(held, len(turn.seg_ids))):
        return None
    P = tr.heads[turn.agent].numel() + sum(s.numel() for s in turn.seg_ids[:held])
    reads, refs, pos = [], [], P
    for j in range(held, len(turn.seg_ids)):
        ids = turn.seg_ids[j]
        reads.append(SharedRead(j, bases[j][0], ids, bases[j][1],
                                torch.arange(pos, pos + ids.numel()), f"a{j}"))
        refs.append(turn.ref.cache.slice(pos, pos + ids.numel()))
        pos += ids.numel()
    prefix_ids = torch.cat([tr.heads[turn.agent], *turn.seg_ids[:held]])
    return ReadRequest(turn.agent, turn.ref.cache.slice(0, P), prefix_ids, tuple(reads),
                       turn.suffix_ids, tuple(refs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("debate", "chain"), default="debate",
                    help="chain: one long essay read first")
    ap.add_argument("--essay-chars", type=int, default=2000)
    ap.add_argument("--instance", type=int, default=2)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, default=128)
    add_model_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bench_model = model_from_args(ap, args, lab=True)
    tok, model = load_lab_model(bench_model, torch.float32)
    wl = (debate(args.instance, args.agents, args.rounds) if args.workload == "debate"
          else reviewer_chain(args.instance, args.essay_chars))
    tr = make_transcript(model, tok, wl, args.answer_tokens, 32, lambda m: None)
    bases = owner_bases(model, tr)
    L = model.spec.num_layers
    kls: dict[str, list[float]] = {}

    def kl(turn, cache, last):
        tf = teacher_forced_logits(model, cache, last, turn.ref.cont_ids)
        return teacher_forced(turn.ref.tf_logits, tf).mean_kl

    shape = (f"{args.agents} agents x {args.rounds} rounds" if args.workload == "debate"
             else f"writer -> 2 reviewers -> editor, essay {args.essay_chars} chars")
    print(f"model {bench_model.name}: {wl.name} #{args.instance}: {shape}, "
          f"{args.answer_tokens}-token answers "
          "(isolated turns: exact prefix, exact owner bases)")
    for ti, turn in enumerate(tr.turns):
        req = isolated_request(tr, ti, bases)
        if req is None:
            continue
        base = KVCache.concat([r.rebased() for r in req.reads])
        ref = KVCache.concat(list(req.reference))
        T = len(base)
        energy = sum(((ref.k[i] - base.k[i]) ** 2 + (ref.v[i] - base.v[i]) ** 2).flatten(1).sum(1)
                     for i in range(1, L))
        n = round(0.15 * T)
        worst = torch.topk(energy, n).indices
        picked = torch.topk((ref.v[1] - base.v[1]).flatten(1).norm(dim=1), n).indices
        overlap = len(set(worst.tolist()) & set(picked.tolist())) / n
        row = {"naive": kl(turn, *naive_on(model, req, base))}
        exact = [x.clone() for x in base.k], [x.clone() for x in base.v]
        for i in range(L):
            exact[0][i][worst], exact[1][i][worst] = ref.k[i][worst], ref.v[i][worst]
        row["exact_worst_15"] = kl(turn, *naive_on(model, req, KVCache(*exact, base.positions)))
        for label, (reg, kw) in METHODS.items():
            res = create_builder(reg, **kw).build(model, req)
            row[label] = kl(turn, res.cache, res.last_logits)
        for k, v in row.items():
            kls.setdefault(k, []).append(v)
        rec = " ".join(f"{k}={1 - v / row['naive']:.2f}" for k, v in row.items() if k != "naive")
        print(f"turn {ti} {turn.agent:8s} T={T:4d} naive KL {row['naive']:.5f} | energy in worst "
              f"15% {float(energy[worst].sum() / energy.sum()):.2f}, in CacheBlend's 15% "
              f"{float(energy[picked].sum() / energy.sum()):.2f}, overlap {overlap:.2f} | "
              f"KL recovered: {rec}", flush=True)
    nv = sum(kls["naive"])
    print("KL recovered, ratio of means over turns: " + "  ".join(
        f"{k} {1 - sum(v) / nv:.3f}" for k, v in kls.items() if k != "naive"))
    return 0


def naive_on(model: RefLlama, req: ReadRequest, view: KVCache):
    """Prefix + view (at reader positions) + the suffix prefilled on it: (cache, last logits)."""
    past = KVCache.concat([req.prefix, view])
    out = model.forward(req.suffix_ids, positions=req.suffix_positions(), past=past)
    return KVCache.concat([past, out.kv]), out.logits[-1]


if __name__ == "__main__":
    raise SystemExit(main())
