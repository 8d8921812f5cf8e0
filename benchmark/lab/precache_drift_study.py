"""Study: how much of PReCache's remaining error does a first-order hidden-state drift remove?

Fidelity only (teacher-forced top-1 and KL against no sharing, the lab's readers and points):
each reader's view of the transcript is built by ``correction.precache_drift.drift_pass`` over
the whole transcript at once (views are causal, so the view of a point is a prefix), for every
(attention, mlp) drift mode and for both shared bases (base weights / centroid). ``naive`` and
``rebase_mean`` come from the lab's own methods for the KL-recovered scale.

    python benchmark/lab/precache_drift_study.py --config attn_mlp --questions 1 --max-message 64

``--model-path``: as in ``precache_lab.py`` (the role adapters are the embedded model's: any
other model is refused). Records name the model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from sglang_kvcmas.adapters import ROLES
from sglang_kvcmas.adapters.role_data import TURN_OPENER
from sglang_kvcmas_bench.lab.precache_setup import (
    ADAPTERS_ARE_EMBEDDED,
    build_transcript,
    cached_transcript,
    fidelity,
    load,
)
from sglang_kvcmas_bench.lab.records import JsonlWriter
from sglang_kvcmas_bench.lab.reference import encode, make_reference
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_examples.datasets import gsm8k
from sglang_kvcmas_lab.correction.lora_baselines import FIRST_READER
from sglang_kvcmas_lab.correction.lora_forward import AgentModel
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT
from sglang_kvcmas_lab.correction.precache_base import create_lora_method
from sglang_kvcmas_lab.correction.precache_drift import drift_pass

MODES = [("shared", "shared"), ("values", "shared"), ("own", "shared"), ("values", "adapters"),
         ("own", "adapters"), ("own", "own")]


def oracle_views(lora, segs, ranks) -> dict[str, list]:
    """Oracle corrections of a reader's view, fitted on its TRUE deviation (its own pass).

    Over the centroid store's view (``oracle_mean``): truncated SVD per segment, per head (h)
    or all heads jointly (j); one basis per head over the whole transcript (g) or from the first
    segment (f). Over the naive view, the first writer's KV as ``lora_share=borrow`` serves it
    (``oracle_naive``): per-token truncated SVD per segment and head (s), or the affine low-rank
    map once served (``correction.affine_lowrank.fit_factors``, what a reader's low-rank leaf
    held) fitted on every token, per segment (m) or once over the transcript (M).
    """
    from sglang_kvcmas_lab.correction.affine_lowrank import fit_factors
    from sglang_kvcmas_lab.delta.leaf import LowRankFactors, svd_factors
    from sglang_kvcmas_lab.models.reference_llama import KVCache

    m = create_lora_method("rebase_mean")
    m.reset(lora)
    naive = create_lora_method("naive")
    naive.reset(lora)
    for seg in segs:
        m.append(seg)
        naive.append(seg)
    ids = torch.cat([s.ids for s in segs])
    lens = [s.ids.numel() for s in segs]
    out = {}
    for agent in range(len(ROLES)):
        exact = lora.forward(ids, agent=agent).kv
        for spec in ranks:
            kind, r = spec[0], int(spec[1:])
            base = naive.view(agent) if kind in "mMs" else m.view(agent)
            ks, vs = [], []
            for layer in range(exact.num_layers):
                for src, b, dst in ((exact.k, base.k, ks), (exact.v, base.v, vs)):
                    parts, start = [], 0
                    if kind in "mM":  # the served affine map, fitted on every token
                        spans = [(0, sum(lens))] if kind == "M" else [
                            (sum(lens[:i]), sum(lens[:i + 1])) for i in range(len(lens))]
                        for a, e in spans:
                            f = fit_factors(b[layer][a:e], src[layer][a:e], r)
                            parts.append(b[layer][a:e] if f is None else f.apply(b[layer][a:e]))
                        dst.append(torch.cat(parts))
                        continue
                    if kind in "gf":  # one basis per head: whole transcript / first segment
                        fit = src[layer] - b[layer]
                        fit = fit if kind == "g" else fit[:lens[0]]
                        basis = torch.linalg.svd(fit.transpose(0, 1), full_matrices=False)[2][
                            :, :r]  # [H, r, d]
                        dev = (src[layer] - b[layer]).transpose(0, 1)  # [H, T, d]
                        rec = (dev @ basis.transpose(1, 2)) @ basis
                        dst.append(b[layer] + rec.transpose(0, 1))
                        continue
                    for n in lens:
                        dev = src[layer][start:start + n] - b[layer][start:start + n]
                        if kind in "hs":
                            f = svd_factors(dev, r)
                        else:
                            u, sv, vh = torch.linalg.svd(dev.flatten(1), full_matrices=False)
                            rr = min(r, sv.numel())
                            f = LowRankFactors((u[:, :rr] * sv[:rr])[None],
                                               vh[:rr].view(rr, dev.shape[1], -1).transpose(0, 1))
                        parts.append(b[layer][start:start + n] + f.dense())
                        start += n
                    dst.append(torch.cat(parts))
            name = "oracle_naive" if kind in "mMs" else "oracle_mean"
            out.setdefault(f"{name}[{spec}]", [None] * len(ROLES))[agent] = KVCache(
                ks, vs, base.positions)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="attn_mlp", choices=["attn", "attn_mlp"])
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--first-question", type=int, default=0)
    ap.add_argument("--max-message", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--cont-tokens", type=int, default=32)
    ap.add_argument("--bases", nargs="+", default=["mean", "neutral"])
    ap.add_argument("--oracle", nargs="*", default=[],
                    help="kind + rank, e.g. h8 j32 s8 m16 (see oracle_views)")
    ap.add_argument("--modes", nargs="*", default=None, help="att,mlp pairs; default all")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="folder of precache_drift_study_<config>.jsonl (default: results/); the "
                         "no-sharing transcript is kept in its precache_drift_study/")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args, embedded_only=ADAPTERS_ARE_EMBEDDED)
    torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = JsonlWriter(out_dir / f"precache_drift_study_{args.config}.jsonl", model=model.name)
    lora, tok = load(args.config, model)
    items = gsm8k()[args.first_question: args.first_question + args.questions]
    segs = cached_transcript(out_dir / "precache_drift_study", args, lambda: build_transcript(
        lora, tok, [it.question for it in items], args.max_message, args.max_tokens))
    ids = torch.cat([s.ids for s in segs])
    pos = torch.arange(ids.numel())
    suffix = encode(tok, TURN_OPENER)
    print(f"transcript {len(segs)} segments, {ids.numel()} tokens", flush=True)

    views = {}
    for base in args.bases:
        shared = MEAN_AGENT if base == "mean" else None
        for att, mlp in ([tuple(x.split(",")) for x in args.modes] if args.modes is not None
                         else MODES):
            t0 = time.perf_counter()
            views[f"drift_{base}[{att},{mlp}]"] = drift_pass(
                lora, ids, pos, None, None, shared=shared, attention=att, mlp=mlp).views
            print(f"  pass {base} {att},{mlp}: {time.perf_counter() - t0:.1f} s", flush=True)
    methods = {k: create_lora_method(k) for k in ("naive", "rebase_mean")}
    for m in methods.values():
        m.reset(lora)
    if args.oracle:
        views.update(oracle_views(lora, segs, args.oracle))

    rows: dict[str, list[dict]] = {}
    first_reader_of = []
    for t, seg in enumerate(segs):
        first_reader_of.append(FIRST_READER if seg.writer is None else seg.writer)
        for m in methods.values():
            m.append(seg)
        n = sum(s.ids.numel() for s in segs[: t + 1])
        for reader in range(len(ROLES)):
            if set(first_reader_of) == {reader}:
                continue
            ref = make_reference(AgentModel(lora, reader), torch.cat([ids[:n], suffix]),
                                 args.cont_tokens)
            cands = {k: m.view(reader) for k, m in methods.items()}
            cands.update({k: v[reader].slice(0, n) for k, v in views.items()})
            for k, view in cands.items():
                f = fidelity(lora, view, reader, suffix, ref)
                rows.setdefault(k, []).append(f)
                writer.write({**vars(args), "kind": "turn", "point": t, "reader": reader,
                              "method": k}, f)
        print(f"point {t + 1}/{len(segs)} done", flush=True)

    naive_kl = statistics.mean(r["mean_kl"] for r in rows["naive"])
    print(f"{'method':34s}{'n':>4s}{'top1':>8s}{'mean_kl':>10s}{'kl_rec':>8s}{'kv_err_v':>10s}")
    for k, rs in rows.items():
        kl = statistics.mean(r["mean_kl"] for r in rs)
        top1 = statistics.mean(r["top1"] for r in rs)
        errv = statistics.mean(statistics.mean(r["kv_rel_err_v"][1:]) for r in rs)
        print(f"{k:34s}{len(rs):4d}{top1:8.3f}{kl:10.4g}{1 - kl / naive_kl:8.3f}{errv:10.4f}")
        writer.write({**vars(args), "kind": "summary", "method": k},
                     {"top1": top1, "mean_kl": kl, "kl_recovered": 1 - kl / naive_kl,
                      "kv_err_v": errv})
    record(writer.path, None,
           what=f"PReCache drift corrections ({args.config} adapters, {len(segs)} segments, "
                f"bases {', '.join(args.bases)}"
                + (f", oracles {' '.join(args.oracle)}" if args.oracle else "")
                + "): one record per read and method, then a summary per method")


if __name__ == "__main__":
    main()
