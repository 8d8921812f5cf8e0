"""What chaining buys the low-rank correction: a reader's state carried along a workflow.

A reader that kept low-rank leaves (leaf modes ``lowrank`` and ``lowrank+exact``, no longer
served; the correction is now ``sglang_kvcmas_lab.correction.affine_lowrank``) refitted its
correction each turn from the borrowed tokens it recomputed. Under ``lowrank+exact`` its
earlier picks were exact leaves, so a turn recomputed only the new segment's picks and fitted
on those alone; chained (the removed ``--kvcmas-lowrank-chain``), the fit started from the
agent's stored correction, the earlier turns' evidence weighted by ``α = chain · earlier pairs /
this turn's pairs`` (at most ``MAX_CHAIN_WEIGHT``). Under ``lowrank`` (no exact leaves) every
turn recomputed every segment's picks again: the pooled fit, at the cost of recomputing them.

Here both full computations are known (the lab's reference model: the debate's Ada as owner,
Ben as reader, over ``--segments`` segments of ``--segment`` tokens of a PyPI-shipped essay;
causal, so every prefix is a turn). At turn ``t`` the reader reads the transcript up to segment
``t``: the picks of segments ``<= t`` (the first 16 tokens + ``--mass`` by owner head mass, as
the server picks) exactly, every other token through a correction, and is judged by KL (full
vocabulary, 16 teacher-forced tokens of its exact greedy answer) against its exact prefill:

- ``picks exact``: no correction (what ``exact`` leaves give at these picks);
- ``per turn``: fitted on segment ``t``'s picks only (chain 0);
- ``chained c``: the same pairs, chained from turn ``t-1``'s state with discount ``c``;
- ``pooled``: fitted on every segment's picks (``lowrank``: all picks recomputed each turn);
- ``oracle``: rank-r, fitted in-sample on the corrected tokens themselves.

Also the residual deviation of the corrected tokens (``Σ‖y − map(x)‖² / Σ‖y − x‖²``, K and V).

    python benchmark/lab/lowrank_chain_study.py [--segments 6 --segment 256 --rank 8]

Writes ``results/lowrank_chain_study[_<model>].{txt,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.probes import head_mass, kl, probe_layers
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids

RESULTS = Path(__file__).resolve().parent / "results"
FORCED = 16
BOUNDARY = 16
CHAINS = (0.5, 1.0)


def picks(mass: torch.Tensor, begin: int, end: int, share: float) -> torch.Tensor:
    """Indices in ``[begin, end)`` a reader recomputes: the first :data:`BOUNDARY`, then the
    ``share`` of the segment with the most owner head mass."""
    seg = mass[begin:end].clone()
    seg[:BOUNDARY] = float("inf")
    n = min(end - begin, BOUNDARY + round(share * (end - begin)))
    return begin + torch.topk(seg, n).indices.sort().values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=6)
    ap.add_argument("--segment", type=int, default=256, help="tokens per segment")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--mass", type=float, default=0.1, help="share picked by head mass")
    ap.add_argument("--out", type=Path, default=None,
                    help="results stem (default: results/lowrank_chain_study[_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    bench = model_from_args(ap, args, lab=True)
    args.out = args.out or bench.named(RESULTS / "lowrank_chain_study")
    torch.set_grad_enabled(False)

    from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
    from sglang_kvcmas_examples.datasets import essays
    from sglang_kvcmas_lab.correction.affine_lowrank import Factors, chain_weight, fit_factors
    from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

    t0 = time.perf_counter()
    tok = bench.tokenizer()
    model = RefLlama.from_pretrained(bench.folder)
    spec = model.spec
    text = "\n\n".join(t for _, t in essays()[:4])
    length = args.segments * args.segment
    transcript = tok.encode(text, add_special_tokens=False)[:length]

    def head(system: str) -> list[int]:  # the system turn: the agent's head, as the server splits
        return chat_prompt_ids(tok, [{"role": "system", "content": system}], False)

    a, b = head(DEBATERS["Ada"]), head(DEBATERS["Ben"])
    h_a, h_b = len(a), len(b)
    common = 0
    while a[common] == b[common]:
        common += 1
    owner = model.forward(torch.tensor(a + transcript))
    reader = model.forward(torch.tensor(b + transcript))
    mass = head_mass(model, a + transcript, h_a, length, common, probe_layers(spec.num_layers))
    rope = ShiftRope.full(rope_inv_freq(spec.head_dim, spec.rope_theta))
    pos = torch.arange(h_b, h_b + length)  # the reader's positions: its frame
    layers = range(spec.num_layers)
    # Reader-frame pairs over the whole transcript, per layer: x (owner's, re-positioned), y.
    xk = [apply_rope(owner.kv.k[i][h_a:], pos, rope) for i in layers]
    yk = [apply_rope(reader.kv.k[i][h_b:], pos, rope) for i in layers]
    xv = [owner.kv.v[i][h_a:].float() for i in layers]
    yv = [reader.kv.v[i][h_b:].float() for i in layers]

    def read(end: int, exact: torch.Tensor, maps: list[tuple] | None) -> torch.Tensor:
        """Logits of the reader's forced tokens at turn end ``end`` (transcript tokens): exact
        at ``exact`` and its head, the rest of ``[0, end - 1)`` the owner's through ``maps``
        (per layer (K factors, V factors) or None), its last prompt token its own."""
        n = end - 1
        ks, vs = [], []
        for i in layers:
            k, v = xk[i][:n].clone(), xv[i][:n].clone()
            fk, fv = maps[i] if maps is not None else (None, None)
            if fk is not None:
                k = fk.apply(k)
            if fv is not None:
                v = fv.apply(v)
            e = exact[exact < n]
            k[e], v[e] = yk[i][e], yv[i][e]
            ks.append(apply_rope(k, -pos[:n], rope))  # back to pre-RoPE
            vs.append(v)
        past = KVCache.concat([reader.kv.slice(0, h_b), KVCache(ks, vs, pos[:n])])
        return model.forward(forced[end], positions=torch.arange(h_b + n, h_b + n + FORCED),
                             past=past).logits

    ends = [args.segment * (t + 1) for t in range(args.segments)]
    forced: dict[int, torch.Tensor] = {}
    ref: dict[int, torch.Tensor] = {}
    for end in ends:
        cont = model.greedy(reader.kv.slice(0, h_b + end), reader.logits[h_b + end - 1], FORCED)
        forced[end] = torch.tensor([transcript[end - 1], *cont[:-1]])
        ref[end] = model.forward(forced[end], positions=torch.arange(h_b + end - 1,
                                 h_b + end - 1 + FORCED),
                                 past=reader.kv.slice(0, h_b + end - 1)).logits

    def fit_all(sel: torch.Tensor, prior: list[tuple] | None, alpha: float,
                shrink: bool = True) -> list[tuple]:
        out = []
        for i in layers:
            pk, pv = prior[i] if prior is not None else (None, None)
            out.append((fit_factors(xk[i][sel], yk[i][sel], args.rank, shrink=shrink, prior=pk,
                                    prior_weight=alpha),
                        fit_factors(xv[i][sel], yv[i][sel], args.rank, shrink=shrink, prior=pv,
                                    prior_weight=alpha)))
        return out

    def residual(maps: list[tuple] | None, rest: torch.Tensor) -> tuple[float, float]:
        out = []
        for xs, ys, which in ((xk, yk, 0), (xv, yv, 1)):
            num = den = 0.0
            for i in layers:
                x, y = xs[i][rest], ys[i][rest]
                f: Factors | None = maps[i][which] if maps is not None else None
                pred = f.apply(x) if f is not None else x
                num += float(((y - pred) ** 2).sum())
                den += float(((y - x) ** 2).sum())
            out.append(num / den)
        return out[0], out[1]

    variants = ["picks exact", "per turn", *(f"chained {c:g}" for c in CHAINS), "pooled", "oracle"]
    chained: dict[float, tuple[list[tuple], float] | None] = {c: None for c in CHAINS}
    rows = []
    all_picks = torch.empty(0, dtype=torch.long)
    for t, end in enumerate(ends):
        new = picks(mass, end - args.segment, end, args.mass)
        all_picks = torch.cat([all_picks, new])
        rest = torch.ones(end - 1, dtype=torch.bool)
        rest[all_picks[all_picks < end - 1]] = False
        rest_idx = torch.nonzero(rest).flatten()
        maps: dict[str, list[tuple] | None] = {"picks exact": None,
                                               "per turn": fit_all(new, None, 0.0)}
        for c in CHAINS:
            prev = chained[c]
            alpha = chain_weight(prev[1], new.numel(), c) if prev is not None else 0.0
            maps[f"chained {c:g}"] = fit_all(new, prev[0] if prev else None, alpha)
            chained[c] = (maps[f"chained {c:g}"], new.numel() * (1 + alpha))
        maps["pooled"] = fit_all(all_picks, None, 0.0)
        maps["oracle"] = fit_all(rest_idx, None, 0.0, shrink=False)
        kl_naive = kl(ref[end], read(end, torch.empty(0, dtype=torch.long), None))
        row = {"turn": t + 1, "tokens": end, "picks_new": int(new.numel()),
               "picks_all": int(all_picks.numel()), "kl_naive": kl_naive}
        for name in variants:
            got = kl(ref[end], read(end, all_picks, maps[name]))
            k_res, v_res = residual(maps[name], rest_idx)
            row[name] = {"kl": got, "kl_recovered": 1 - got / kl_naive, "k_residual": k_res,
                         "v_residual": v_res}
        rows.append(row)
        print(json.dumps(row), flush=True)

    head_line = f"{'turn':>4} {'tokens':>6} {'KL naive':>9} " + " ".join(
        f"{v:>13}" for v in variants)
    lines = [f"# python benchmark/lab/lowrank_chain_study.py {' '.join(sys.argv[1:])}",
             f"{bench.name}; Ada's head {h_a} tokens owns, Ben's {h_b} reads; {args.segments} "
             f"segments of {args.segment} essay tokens; picks per segment: {BOUNDARY} + "
             f"{args.mass:g} by owner head mass; rank {args.rank}",
             "KL recovered vs naive re-positioning (K / V residual of the corrected tokens "
             "below each)", head_line]
    for r in rows:
        lines.append(f"{r['turn']:>4} {r['tokens']:>6} {r['kl_naive']:>9.2e} " + " ".join(
            f"{r[v]['kl_recovered']:>13.3f}" for v in variants))
        lines.append(" " * 21 + " ".join(
            f"{r[v]['k_residual']:>6.2f}/{r[v]['v_residual']:<6.2f}" for v in variants))
    mean = {v: sum(r[v]["kl_recovered"] for r in rows[1:]) / max(1, len(rows) - 1)
            for v in variants}
    lines.append("mean over turns 2..: " + ", ".join(f"{v} {x:.3f}" for v, x in mean.items()))
    lines.append(f"run time {time.perf_counter() - t0:.0f} s")
    text_out = "\n".join(lines)
    print(text_out)
    about = (f"a low-rank correction chained along a workflow against one fitted per turn "
             f"({bench.name}): " + ", ".join(f"{v} {x:.3f}" for v, x in mean.items())
             + " KL recovered over turns 2..")
    record(args.out.with_name(args.out.name + ".txt"), text_out + "\n",
           what=f"{about}; per turn KL recovered and K/V residuals")
    record(args.out.with_name(args.out.name + ".json"), json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "mean": mean},
        indent=1), what=f"its rows per turn ({about})")
    record(args.out.with_name(args.out.name + ".png"), lambda p: plot(rows, variants, p),
           what=f"its plot ({about})")
    return 0


def plot(rows: list[dict], variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["turn"] for r in rows]
    for v in variants:
        axes[0].plot(xs, [r[v]["kl_recovered"] for r in rows], marker="o", label=v)
        axes[1].plot(xs, [r[v]["k_residual"] for r in rows], marker="o", label=v)
    axes[0].axhline(0, color="grey", lw=0.8)
    axes[0].set(xlabel="turn (segment)", ylabel="KL recovered vs naive",
                title="reader fidelity per turn")
    axes[1].axhline(1, color="grey", lw=0.8)
    axes[1].set(xlabel="turn (segment)", ylabel="K residual (1: no gain)",
                title="deviation left on corrected keys")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
