"""Why the low-rank correction once served did not help: its estimator offline, on every token.

The correction (leaf mode ``lowrank`` until it left the server; now
``sglang_kvcmas_lab.correction.affine_lowrank``) fits, per layer and KV head, an affine
low-rank map ``x + (x·A + c)·Bᵀ`` from a reader's recomputed tokens (pairs: the owner's K/V
re-positioned, the reader's exact K/V) and applies it to every other borrowed token. Here both
full computations are available (the lab's reference model: owner prompt = Ada's head + a
GSM8K debate transcript, reader prompt = Ben's head + the same transcript), so the residual
deviation of the *other* tokens is measured directly:

    residual = Σ‖y − map(x)‖² / Σ‖y − x‖²   over the tokens not recomputed (1: no gain)

for the served pairs (the first ``--boundary`` tokens + the ``--mass`` share with the largest
deviation: a stand-in for the owner head mass the server ranks by, which selects the same kind
of tokens), variants of the estimator on them, the same number of random (unbiased) pairs, and
the in-sample oracle on all the other tokens (what any rank-``r`` affine map could reach).

The served pairs are chosen *because* they deviate most, and no map of ``x`` knows which tokens
those are; a model whose regressor is the selection signal itself is not biased by that
selection. So the study also fits the deviation as the owner's head mass ``m`` (the attention
mass each transcript token puts on the owner's head, mean over layers and query heads: what the
server ranks by) times one vector per layer and KV head, ``x + m·u``, on the served pairs and,
as its oracle, on every other token.

    python benchmark/lab/lowrank_estimator_study.py [--rank 8] [--layer-step 3] [--select mass]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.probes import head_mass
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids

RESULTS = Path(__file__).resolve().parent / "results"


def bias_only(x: torch.Tensor, y: torch.Tensor):
    """The mean deviation as rank-1 factors (A = 0): ``x + c·bᵀ``."""
    from sglang_kvcmas_lab.correction.affine_lowrank import Factors

    d = (y - x).mean(0)  # [H, d]
    norm = d.norm(dim=1).clamp_min(1e-12)
    return Factors(torch.zeros(d.shape[0], d.shape[1], 1), (d / norm[:, None])[..., None],
                   norm[:, None])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def mass_offset(x: torch.Tensor, y: torch.Tensor, mass: torch.Tensor, fit_on: torch.Tensor):
    """``x ↦ x + m·u`` with ``u`` [H, d] the least-squares vector on ``fit_on`` (a map taking
    ``(x, m)``)."""
    w = mass[fit_on][:, None, None]
    u = (w * (y - x)[fit_on]).sum(0) / (w * w).sum(0).clamp_min(1e-12)
    return lambda xr, mr: xr + mr[:, None, None] * u


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--boundary", type=int, default=16)
    ap.add_argument("--mass", type=float, default=0.1)
    ap.add_argument("--layer-step", type=int, default=3, help="every n-th layer (from layer 1)")
    ap.add_argument("--select", choices=("deviation", "mass"), default="deviation",
                    help="the recomputed pairs beyond the boundary: largest true deviation (a "
                         "stand-in) or largest owner head mass (what the server ranks by)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/lowrank_estimator_study[_mass].txt")
    args = ap.parse_args()
    args.out = args.out or RESULTS / ("lowrank_estimator_study"
                                      + ("_mass" if args.select == "mass" else "") + ".txt")
    torch.set_grad_enabled(False)

    from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
    from sglang_kvcmas.models.resolve import resolve_model_path
    from sglang_kvcmas_examples.datasets import gsm8k
    from sglang_kvcmas_lab.correction.affine_lowrank import fit_factors
    from sglang_kvcmas_lab.models.reference_llama import RefLlama
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    folder = resolve_model_path(None)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = RefLlama.from_pretrained(folder)
    spec = model.spec
    q = gsm8k()[0]
    transcript = (f"Question: {q.question}\n\nRound 1 answers:\nAda: {q.answer}\nBen: "
                  f"{gsm8k()[1].answer}\n\nThis is round 2. Give your updated answer.")

    def ids(system: str) -> list[int]:
        return chat_prompt_ids(tok, [{"role": "system", "content": system},
                                     {"role": "user", "content": transcript}])

    a, b = ids(DEBATERS["Ada"]), ids(DEBATERS["Ben"])
    n = 0
    while a[-1 - n] == b[-1 - n]:
        n += 1
    length, h_a, h_b = n, len(a) - n, len(b) - n
    owner, reader = model.forward(torch.tensor(a)).kv, model.forward(torch.tensor(b)).kv
    rope = ShiftRope.full(rope_inv_freq(spec.head_dim, spec.rope_theta))
    pos = torch.arange(h_b, h_b + length)  # the reader's positions: the reader's frame
    mass = head_mass(model, a, h_a, length, common_prefix(a, b))

    def pairs(layer: int):
        return (apply_rope(owner.k[layer][h_a:h_a + length], pos, rope),
                apply_rope(reader.k[layer][h_b:h_b + length], pos, rope),
                owner.v[layer][h_a:h_a + length].float(), reader.v[layer][h_b:h_b + length].float())

    _, _, x2, y2 = pairs(2)
    score = (y2 - x2).flatten(1).norm(dim=1) if args.select == "deviation" else mass.clone()
    score[: args.boundary] = -1
    extra = torch.topk(score, round(args.mass * length)).indices
    sel = torch.cat([torch.arange(args.boundary), extra]).unique()
    rest = torch.ones(length, dtype=torch.bool)
    rest[sel] = False
    interior = sel[sel >= args.boundary]
    others = torch.nonzero(rest).flatten()
    rnd = others[torch.randperm(others.numel(), generator=torch.Generator().manual_seed(0))[
        : sel.numel()]]
    layers = list(range(1, spec.num_layers, args.layer_step))
    r = args.rank

    def residual(fit) -> tuple[float, float]:
        num, den = {"k": 0.0, "v": 0.0}, {"k": 0.0, "v": 0.0}
        for layer in layers:
            xk, yk, xv, yv = pairs(layer)
            for name, x, y in (("k", xk, yk), ("v", xv, yv)):
                f = fit(x, y)
                xr, yr = x[rest], y[rest]
                pred = (f(xr, mass[rest]) if callable(f) else f.apply(xr) if f is not None
                        else xr)
                num[name] += float(((yr - pred) ** 2).sum())
                den[name] += float(((yr - xr) ** 2).sum())
        return num["k"] / den["k"], num["v"] / den["v"]

    variants = {
        f"served: rank {r}, ridge 0.05, held-out shrink": lambda x, y: fit_factors(
            x[sel], y[sel], r),
        "served pairs, interior only (no boundary)": lambda x, y: fit_factors(
            x[interior], y[interior], r),
        "served pairs, ridge 1.0": lambda x, y: fit_factors(x[sel], y[sel], r, ridge=1.0),
        "served pairs, no shrink": lambda x, y: fit_factors(x[sel], y[sel], r, shrink=False),
        "served pairs, mean deviation only": lambda x, y: bias_only(x[sel], y[sel]),
        "random pairs (same count, unbiased)": lambda x, y: fit_factors(x[rnd], y[rnd], r),
        "random pairs, mean deviation only": lambda x, y: bias_only(x[rnd], y[rnd]),
        f"oracle: rank {r} fitted on every other token (in-sample)": lambda x, y: fit_factors(
            x[rest], y[rest], r, shrink=False),
        "served pairs, head mass x one vector": lambda x, y: mass_offset(x, y, mass, sel),
        "oracle: head mass x one vector, every other token": lambda x, y: mass_offset(
            x, y, mass, rest),
    }
    lines = [f"# python benchmark/lab/lowrank_estimator_study.py {' '.join(sys.argv[1:])}",
             f"embedded model; transcript {length} tokens; heads {h_a} / {h_b} tokens; "
             f"{sel.numel()} recomputed pairs ({args.boundary} boundary + top {args.mass:g} by "
             f"{'owner head mass' if args.select == 'mass' else 'deviation'}); residual over "
             f"the other {int(rest.sum())} tokens, layers {layers}",
             f"{'estimator':>58} {'K residual':>10} {'V residual':>10}"]
    for name, fit in variants.items():
        k, v = residual(fit)
        lines.append(f"{name:>58} {k:>10.3f} {v:>10.3f}")
        print(lines[-1], flush=True)
    lines.append(f"run time {time.perf_counter() - t0:.0f} s")
    text = "\n".join(lines)
    print(text)
    record(args.out, text + "\n",
           what="the affine low-rank estimator once served, offline on every token: residual "
                "deviation of the tokens not recomputed, by estimator and selection")
    return 0


if __name__ == "__main__":
    sys.exit(main())
