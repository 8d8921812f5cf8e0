"""Where a factored leaf's basis should live: per fit, carried along an agent's turns, or shared.

The server's leaf mode ``factored`` keeps the tokens a reader recomputes as the truncated SVD of
their deviation from the owner's KV, per layer and KV head: coefficients per token plus one basis
per fit (a turn's picks). At the defaults' picks (a few dozen tokens per reader and turn) the
bases are half the bytes. This lab asks what a basis held longer costs in fidelity. The panel's
agents (``sglang_kvcmas_examples.panel``) read the first ``--length`` tokens of a PyPI-shipped
essay; agent 0 owns it, ``--readers`` others read it. Every full computation runs in the lab's
reference model, so each reader's deviation on its picks (the first 16 tokens and 10% by the
owner's head mass, as served; keys before RoPE) is known exactly. The picks are split in two
"turns" (the earlier half of them by position, then the rest). Per reader and rank r, the picks'
deviation is kept as:

- ``exact``: the picks read exactly (what the factors approximate);
- ``one``: one truncated SVD over all its picks (one fit holding both turns);
- ``turn``: one SVD per turn (two bases: what the server keeps today);
- ``chain``: one basis per agent carried along its turns: turn 1's SVD, then the top r of
  ``[diag(s₁)·B₁ᵀ; D₂]``, turn 1's coefficients re-projected onto it (``C₁·B₁ᵀ·B``);
- ``pooled``: one basis for the segment, the SVD of every reader's picks stacked (its bytes
  shared by the readers), each reader's coefficients its projection;
- ``others``: the same basis fitted on the other readers' picks only (a basis the reader did not
  shape: one fitted before it arrived).

Per variant: KL recovered (``1 − KL / KL_naive`` over 16 teacher-forced tokens of the reader's
exact greedy answer, full vocabulary), the relative residual of the picks' deviation, and the
bytes per reader against the picks' exact leaves (K and V, every layer and KV head: the
coefficients plus the bases it holds, a shared basis divided by the readers).

    python benchmark/lab/shared_basis_study.py --model-path qwen2.5-coder-0.5b

Writes ``results/shared_basis_study[_<model>].{txt,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.probes import FORCED, head_mass, kl, probe_layers
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.workflows import chat_prompt_ids

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (4, 8)
VARIANTS = ("one", "turn", "chain", "pooled", "others")


def svd_basis(d: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(basis [dim, r], singular values [r]) of ``d`` [n, dim]'s top ``r`` right singular
    directions (zero columns past its rank)."""
    _, s, vh = torch.linalg.svd(d.double(), full_matrices=False)
    k = min(r, s.shape[0])
    basis = torch.zeros(d.shape[1], r, dtype=torch.float64)
    sv = torch.zeros(r, dtype=torch.float64)
    basis[:, :k], sv[:k] = vh[:k].T, s[:k]
    return basis, sv


def project(d: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``d`` [n, dim] read back through ``basis`` [dim, r]: ``d·B·Bᵀ``."""
    return (d.double() @ basis @ basis.T).to(d.dtype)


def kept(dev: torch.Tensor, first: torch.Tensor, r: int, variant: str,
         shared: torch.Tensor | None = None) -> torch.Tensor:
    """One layer and KV head of a reader's picks' deviation as a variant keeps it.

    Args:
        dev: [p, dim] the picks' deviation (picks in transcript order).
        first: [p] bool, the picks of turn 1.
        shared: [dim, r] the segment's basis (``pooled``, ``others``).
    """
    if variant == "one":
        return project(dev, svd_basis(dev, r)[0])
    if variant in ("pooled", "others"):
        return project(dev, shared)
    out = torch.empty_like(dev)
    b1, s1 = svd_basis(dev[first], r)
    if variant == "turn":
        out[first] = project(dev[first], b1)
        out[~first] = project(dev[~first], svd_basis(dev[~first], r)[0])
        return out
    # chain: one basis, updated by turn 2 from turn 1's singular directions and its deviation
    b, _ = svd_basis(torch.cat([(s1[:, None] * b1.T).to(dev.dtype), dev[~first]]), r)
    out[first] = (project(dev[first], b1).double() @ b @ b.T).to(dev.dtype)
    out[~first] = project(dev[~first], b)
    return out


def leaf_bytes(variant: str, picks: int, dim: int, r: int, readers: int) -> float:
    """A reader's factored bytes over its picks' exact ones, per layer, KV head, K or V."""
    bases = {"one": 1.0, "turn": 2.0, "chain": 1.0, "pooled": 1.0 / readers,
             "others": 1.0 / readers}[variant]
    return (picks * r + bases * dim * r) / (picks * dim)


def study(model, tok, text: str, length: int, readers: int) -> dict:
    from sglang_kvcmas_examples.panel import PERSONAS, system_prompt
    from sglang_kvcmas_lab.models.reference_llama import KVCache

    essay = tok.decode(tok.encode(text, add_special_tokens=False)[:length])

    def ids(system: str) -> list[int]:
        return chat_prompt_ids(tok, [{"role": "system", "content": system},
                                     {"role": "user", "content": essay}])

    def head_len(system: str) -> int:
        return len(chat_prompt_ids(tok, [{"role": "system", "content": system}], False))

    heads = [system_prompt(p) for p in PERSONAS[: readers + 1]]
    prompts, hl = [ids(h) for h in heads], [head_len(h) for h in heads]
    a, h_a = prompts[0], hl[0]
    shared = len(a) - h_a - 1
    owner = model.forward(torch.tensor(a))
    layers = range(model.spec.num_layers)
    ko = [owner.kv.k[i][h_a:h_a + shared] for i in layers]
    vo = [owner.kv.v[i][h_a:h_a + shared] for i in layers]
    common = 0
    while a[common] == prompts[1][common]:
        common += 1
    mass = head_mass(model, a, h_a, shared, common, probe_layers(model.spec.num_layers))
    mass[:16] = float("inf")
    sel = torch.sort(torch.topk(mass, min(shared, 16 + round(0.1 * shared))).indices).values
    first = torch.arange(sel.numel()) < sel.numel() // 2  # the earlier half of the picks
    dim = ko[0].shape[-1]
    per: list[dict] = []
    devs = []
    for i in range(1, readers + 1):
        b, h_b = prompts[i], hl[i]
        if b[h_b:] != a[h_a:]:
            raise RuntimeError("the prompts differ after their system turns")
        reader = model.forward(torch.tensor(b))
        kr = [reader.kv.k[j][h_b:h_b + shared] for j in layers]
        vr = [reader.kv.v[j][h_b:h_b + shared] for j in layers]
        cont = model.greedy(reader.kv, reader.logits[-1], FORCED)
        forced = torch.tensor([b[-1], *cont[:-1]])
        at = torch.arange(len(b) - 1, len(b) - 1 + FORCED)
        devs.append(([(k - o)[sel] for o, k in zip(ko, kr)],
                     [(v - o)[sel] for o, v in zip(vo, vr)]))
        per.append({"reader": i, "kv": (kr, vr), "forced": forced, "at": at, "head": h_b,
                    "past": reader.kv.slice(0, h_b)})

    def logits_with(p: dict, k_mid, v_mid) -> torch.Tensor:
        mid = KVCache(k_mid, v_mid, torch.arange(p["head"], p["head"] + shared))
        return model.forward(p["forced"], positions=p["at"],
                             past=KVCache.concat([p["past"], mid])).logits

    rows = []
    heads_kv = ko[0].shape[1]
    for n, p in enumerate(per):
        kr, vr = p["kv"]
        ref = logits_with(p, kr, vr)
        kl_naive = kl(ref, logits_with(p, ko, vo))
        mk, mv = [o.clone() for o in ko], [o.clone() for o in vo]
        for j in layers:
            mk[j][sel], mv[j][sel] = kr[j][sel], vr[j][sel]
        row = {"reader": p["reader"], "kl_naive": kl_naive,
               "exact": 1 - kl(ref, logits_with(p, mk, mv)) / kl_naive}
        dk, dv = devs[n]
        for r in RANKS:
            for variant in VARIANTS:
                ck, cv = [o.clone() for o in ko], [o.clone() for o in vo]
                num = den = 0.0
                for j in layers:
                    for (c, d, which) in ((ck, dk, 0), (cv, dv, 1)):
                        got = torch.empty_like(d[j])
                        for h in range(heads_kv):
                            basis = None
                            if variant in ("pooled", "others"):
                                stack = [devs[m][which][j][:, h] for m in range(len(per))
                                         if variant == "pooled" or m != n]
                                basis = svd_basis(torch.cat(stack), r)[0]
                            got[:, h] = kept(d[j][:, h], first, r, variant, basis)
                        c[j][sel] += got
                        num += float(((d[j] - got) ** 2).sum())
                        den += float((d[j] ** 2).sum())
                row[f"{variant}{r}"] = 1 - kl(ref, logits_with(p, ck, cv)) / kl_naive
                row[f"{variant}{r}_residual"] = num / den
        rows.append(row)
        print(json.dumps(row), flush=True)
    picks = int(sel.numel())
    return {"length": length, "shared_tokens": shared, "picks": picks,
            "picks_turn1": int(first.sum()), "readers": readers, "rows": rows,
            "bytes": {f"{v}{r}": leaf_bytes(v, picks, dim, r, readers)
                      for r in RANKS for v in VARIANTS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="transcript tokens")
    ap.add_argument("--readers", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None,
                    help="results stem (default: results/shared_basis_study[_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    bench = model_from_args(ap, args, lab=True)
    args.out = args.out or bench.named(RESULTS / "shared_basis_study")
    torch.set_grad_enabled(False)

    from sglang_kvcmas_examples.datasets import essays
    from sglang_kvcmas_lab.models.reference_llama import RefLlama

    t0 = time.perf_counter()
    model = RefLlama.from_pretrained(bench.folder)
    text = "\n\n".join(t for _, t in essays()[:4])
    result = study(model, bench.tokenizer(), text, args.length, args.readers)
    rows = result["rows"]
    names = ["exact", *[f"{v}{r}" for r in RANKS for v in VARIANTS]]
    mean = {k: statistics.fmean(row[k] for row in rows) for k in names}
    resid = {k: statistics.fmean(row[f"{k}_residual"] for row in rows) for k in names[1:]}
    lines = [f"# python benchmark/lab/shared_basis_study.py {' '.join(sys.argv[1:])}",
             f"{bench.name} (lab reference forward); {args.readers} panel readers over the first "
             f"{args.length} essay tokens (agent 0 owns them); {result['picks']} picks each (16 + "
             f"10% by owner head mass; the first {result['picks_turn1']} in turn 1); KL over "
             f"{FORCED} teacher-forced tokens of each reader's exact answer",
             f"{'variant':>9} {'KL_rec':>7} {'min':>7} {'max':>7} {'resid':>6} {'bytes/exact':>11}"]
    for k in names:
        ys = [row[k] for row in rows]
        lines.append(f"{k:>9} {mean[k]:>7.3f} {min(ys):>7.3f} {max(ys):>7.3f} "
                     f"{resid.get(k, 0.0):>6.3f} "
                     f"{result['bytes'].get(k, 1.0):>11.3f}")
    lines.append(f"naive KL mean {statistics.fmean(r['kl_naive'] for r in rows):.3e}; "
                 f"run time {time.perf_counter() - t0:.0f} s")
    text_out = "\n".join(lines)
    print(text_out)
    about = (f"where a factored leaf's basis should live: per fit, carried along an agent's "
             f"turns, or shared ({bench.name}): KL recovered, residual and bytes by variant "
             f"and rank")
    record(args.out.with_suffix(".txt"), text_out + "\n", what=f"{about}: the table")
    result |= {"mean": mean, "residual": resid, "seconds": round(time.perf_counter() - t0, 1)}
    record(args.out.with_suffix(".json"), json.dumps(result, indent=1) + "\n",
           what=f"its rows ({about})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
