"""How a reader's deviation, and the leaf rank it needs, grow with the shared transcript.

Two agents (the debate's Ada and Ben heads) read the same transcript: the first ``L`` tokens of
a PyPI-shipped essay, for each ``L`` of ``--lengths``. Both full computations run in the lab's
reference model (``--model-path``, default the embedded SmolLM2-135M), so for every layer and KV head the reader's
deviation from the owner's transcript KV, ``D = KV_reader − KV_owner`` (pre-RoPE: a
re-positioned read changes no stored value), is known exactly. Per ``L``:

- the deviation's energy relative to the reader's KV, and the **leaf rank needed**: the smallest
  rank whose truncated SVD of ``D`` holds 80% / 90% of its energy (median over layers and KV
  heads; the best any rank-r delta leaf ``U·Cᵀ`` of that span can do);
- **KL recovered** (``1 − KL / KL_naive``, full-vocabulary KL of the reader's next-token
  distributions over 16 teacher-forced tokens of its exact greedy answer) of: the oracle rank-r
  delta leaves (the SVD truncation of ``D`` per layer and KV head, r = 4 / 8 / 16), and the
  served selection's tokens read exactly (the first 16 + 10% by owner head mass on the probe
  layers, the rest re-positioned: an upper bound on recomputing them, which reads them in the
  reader's context over the re-positioned rest), and those tokens kept as **factored leaves**:
  their deviation cut to rank r = 4 / 8 / 16 per layer and KV head (``cR``: before RoPE;
  ``cpR``: in the reader's frame, after RoPE at the reader's positions, as the server's leaf mode
  ``factored`` keeps them), with the bytes that saves against their exact leaves
  (``picks_bytes_ratio_rank<r>``: ``p·d / (r·(p + d))`` for ``p`` tokens).

    python benchmark/lab/delta_growth_study.py [--lengths 256,512,1024,2048,4096]

Writes ``results/delta_growth_study.{txt,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.probes import FORCED, head_mass, kl, probe_layers
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (4, 8, 16)
PICK_RANKS = (4, 8, 16)
FLOOR = -1.5
"""The plot draws KL recovered below this on it, its value beside it."""


def rank_needed(d: torch.Tensor, share: float) -> int:
    """Smallest r whose rank-r SVD truncation of ``d`` [n, dim] holds ``share`` of its energy."""
    s2 = torch.linalg.svdvals(d.double()) ** 2
    cum = torch.cumsum(s2, 0) / s2.sum().clamp_min(1e-30)
    return int((cum < share).sum()) + 1


def truncated(d: torch.Tensor, r: int) -> torch.Tensor:
    """[n, H, dim] deviation with each head's matrix cut to its top ``r`` singular directions."""
    out = torch.empty_like(d)
    for h in range(d.shape[1]):
        u, s, vh = torch.linalg.svd(d[:, h].double(), full_matrices=False)
        out[:, h] = (u[:, :r] * s[:r] @ vh[:r]).to(d.dtype)
    return out


def study_length(model, tok, text: str, length: int) -> dict:
    from sglang_kvcmas_lab.models.reference_llama import KVCache

    essay = tok.decode(tok.encode(text, add_special_tokens=False)[:length])

    def ids(system: str) -> list[int]:
        return chat_prompt_ids(tok, [{"role": "system", "content": system},
                                     {"role": "user", "content": essay}])

    def head_len(system: str) -> int:  # the system turn: the agent's head, as the server splits
        return len(chat_prompt_ids(tok, [{"role": "system", "content": system}], False))

    a, b = ids(DEBATERS["Ada"]), ids(DEBATERS["Ben"])
    h_a, h_b = head_len(DEBATERS["Ada"]), head_len(DEBATERS["Ben"])
    if a[h_a:] != b[h_b:]:
        raise RuntimeError("the two prompts differ after their system turns")
    shared = len(a) - h_a - 1  # the reader computes its last prompt token itself (its logits)
    owner, reader = model.forward(torch.tensor(a)), model.forward(torch.tensor(b))
    cont = model.greedy(reader.kv, reader.logits[-1], FORCED)
    forced = torch.tensor([b[-1], *cont[:-1]])
    at = torch.arange(len(b) - 1, len(b) - 1 + FORCED)

    def logits_with(k_mid: list[torch.Tensor], v_mid: list[torch.Tensor]) -> torch.Tensor:
        head = reader.kv.slice(0, h_b)
        mid = KVCache(k_mid, v_mid, torch.arange(h_b, h_b + shared))
        return model.forward(forced, positions=at, past=KVCache.concat([head, mid])).logits

    layers = range(model.spec.num_layers)
    ko = [owner.kv.k[i][h_a:h_a + shared] for i in layers]
    vo = [owner.kv.v[i][h_a:h_a + shared] for i in layers]
    kr = [reader.kv.k[i][h_b:h_b + shared] for i in layers]
    vr = [reader.kv.v[i][h_b:h_b + shared] for i in layers]
    ref = logits_with(kr, vr)
    kl_naive = kl(ref, logits_with(ko, vo))
    row: dict = {"length": length, "shared_tokens": shared, "kl_naive": kl_naive}
    for name, own, theirs in (("k", ko, kr), ("v", vo, vr)):
        dev = [t - o for o, t in zip(own, theirs)]
        row[f"{name}_deviation_energy"] = float(sum((d ** 2).sum() for d in dev)
                                                / sum((t ** 2).sum() for t in theirs))
        for share in (0.8, 0.9):
            ranks = sorted(rank_needed(d[:, h], share) for d in dev for h in range(d.shape[1]))
            row[f"{name}_rank{int(share * 100)}"] = ranks[len(ranks) // 2]
    dk = [t - o for o, t in zip(ko, kr)]
    dv = [t - o for o, t in zip(vo, vr)]
    for r in RANKS:
        got = logits_with([o + truncated(d, r) for o, d in zip(ko, dk)],
                          [o + truncated(d, r) for o, d in zip(vo, dv)])
        row[f"kl_recovered_rank{r}"] = 1 - kl(ref, got) / kl_naive
    # The served selection: 16 boundary tokens + 10% by owner head mass (probe layers 2, 6, ...).
    common = 0
    while a[common] == b[common]:
        common += 1
    mass = head_mass(model, a, h_a, shared, common, probe_layers(model.spec.num_layers))
    mass[:16] = float("inf")
    sel = torch.topk(mass, min(shared, 16 + round(0.1 * shared))).indices
    mk = [o.clone() for o in ko]
    mv = [o.clone() for o in vo]
    for i in layers:
        mk[i][sel], mv[i][sel] = kr[i][sel], vr[i][sel]
    row["kl_recovered_served_tokens_exact"] = 1 - kl(ref, logits_with(mk, mv)) / kl_naive
    # The same picks, their deviation cut to rank r per layer and KV head (compressed leaves).
    row["picks"] = n = int(sel.numel())
    dim = ko[0].shape[-1]
    for r in PICK_RANKS:  # a token's K and V as d floats each, or r coefficients + the basis
        row[f"picks_bytes_ratio_rank{r}"] = n * dim / (r * (n + dim))
    for r in PICK_RANKS:
        ck = [o.clone() for o in ko]
        cv = [o.clone() for o in vo]
        for i in layers:
            ck[i][sel] += truncated(dk[i][sel], r)
            cv[i][sel] += truncated(dv[i][sel], r)
        row[f"kl_recovered_picks_rank{r}"] = 1 - kl(ref, logits_with(ck, cv)) / kl_naive
    # The same in the reader's frame (after RoPE at the reader's positions), as the server holds
    # keys: the key deviation rotated to each token's position before the cut, and back.
    from sglang_kvcmas_lab.models.reference_llama import rotate
    pos = torch.arange(h_b, h_b + shared)[sel]
    theta = model.spec.rope_theta
    for r in PICK_RANKS:
        ck = [o.clone() for o in ko]
        cv = [o.clone() for o in vo]
        for i in layers:
            post = truncated(rotate(dk[i][sel], pos, theta), r)
            ck[i][sel] += rotate(post, -pos, theta)
            cv[i][sel] += truncated(dv[i][sel], r)
        row[f"kl_recovered_picks_post_rank{r}"] = 1 - kl(ref, logits_with(ck, cv)) / kl_naive
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["length"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    series = {f"oracle rank-{r} delta leaves": f"kl_recovered_rank{r}" for r in RANKS}
    series["served tokens read exactly"] = "kl_recovered_served_tokens_exact"
    series["served tokens, deviation at rank 8"] = "kl_recovered_picks_rank8"
    for label, key in series.items():
        ys = [row[key] for row in rows]
        axes[0].plot(xs, [max(y, FLOOR) for y in ys], marker="o", label=label)
        for x, y in zip(xs, ys):
            if y < FLOOR:  # off the scale: on the floor, its value beside it
                axes[0].annotate(f"{y:.1f}", (x, FLOOR), fontsize=7)
    axes[0].set(xscale="log", xlabel="transcript tokens (L)", ylim=(FLOOR - 0.1, 1.0),
                ylabel=f"KL recovered vs naive (floor {FLOOR})", title="what a correction recovers")
    for name in ("k", "v"):
        for share in (80, 90):
            axes[1].plot(xs, [row[f"{name}_rank{share}"] for row in rows], marker="o",
                         label=f"{name.upper()}: {share}% of the deviation")
    axes[1].set(xscale="log", xlabel="transcript tokens (L)",
                ylabel="rank of 64 (median over layers, KV heads)", title="leaf rank needed")
    for ax in axes:
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--out", type=Path, default=None,
                    help="results stem (default: results/delta_growth_study[_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    bench = model_from_args(ap, args, lab=True)
    args.out = args.out or bench.named(RESULTS / "delta_growth_study")
    torch.set_grad_enabled(False)

    from sglang_kvcmas_examples.datasets import essays
    from sglang_kvcmas_lab.models.reference_llama import RefLlama

    t0 = time.perf_counter()
    tok = bench.tokenizer()
    model = RefLlama.from_pretrained(bench.folder)
    text = "\n\n".join(t for _, t in essays()[:4])
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        rows.append(study_length(model, tok, text, length))
        print(json.dumps(rows[-1]), flush=True)
    head = (f"{'tokens':>7} {'KL naive':>9} " + " ".join(f"{'r' + str(r):>6}" for r in RANKS)
            + f" {'served':>7} "
            + " ".join(f"{'c' + str(r):>6}" for r in PICK_RANKS) + " "
            + " ".join(f"{'cp' + str(r):>6}" for r in PICK_RANKS)
            + f" {'K energy':>8} {'V energy':>8} {'K r80':>5} {'K r90':>5} "
            f"{'V r80':>5} {'V r90':>5}")
    lines = [f"# python benchmark/lab/delta_growth_study.py {' '.join(sys.argv[1:])}",
             f"{bench.name} (lab reference forward); Ada / Ben heads over the first L tokens of "
             f"PyPI-shipped essays; KL over {FORCED} teacher-forced tokens of the reader's exact "
             "answer; KL recovered by oracle rank-r delta leaves (SVD of the deviation per layer "
             "and KV head), by the served selection's tokens read exactly (served) and by those "
             "tokens' deviation cut to rank r (cR: before RoPE, cpR: in the reader's frame, "
             "after RoPE; the same for V); the rank holding "
             "80% / 90% of the deviation (median over layers and KV heads)", head]
    for r in rows:
        lines.append(f"{r['length']:>7} {r['kl_naive']:>9.2e} "
                     + " ".join(f"{r[f'kl_recovered_rank{k}']:>6.3f}" for k in RANKS)
                     + f" {r['kl_recovered_served_tokens_exact']:>7.3f} "
                     + " ".join(f"{r[f'kl_recovered_picks_rank{k}']:>6.3f}" for k in PICK_RANKS)
                     + " "
                     + " ".join(f"{r[f'kl_recovered_picks_post_rank{k}']:>6.3f}"
                                for k in PICK_RANKS)
                     + f" {r['k_deviation_energy']:>8.4f} {r['v_deviation_energy']:>8.4f}"
                     f" {r['k_rank80']:>5} {r['k_rank90']:>5} {r['v_rank80']:>5}"
                     f" {r['v_rank90']:>5}")
    lines.append(f"run time {time.perf_counter() - t0:.0f} s")
    text_out = "\n".join(lines)
    print(text_out)
    about = (f"a reader's deviation and the leaf rank it needs as the shared transcript grows "
             f"({bench.name}, lengths {args.lengths})")
    record(args.out.with_suffix(".txt"), text_out + "\n",
           what=f"{about}: KL recovered by oracle delta leaves, the served picks read exactly and "
                f"as factored leaves; the rank holding 80% / 90% of the deviation")
    record(args.out.with_suffix(".json"), json.dumps(rows, indent=1) + "\n",
           what=f"its rows per length ({about})")
    record(args.out.with_suffix(".png"), lambda p: plot(rows, p),
           what=f"its plot: KL recovered and leaf rank needed against the length ({about})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
