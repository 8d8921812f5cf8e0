"""Fidelity of a reader agent's reuse inside SGLang's server, by what the reader recomputes.

One kvcmas server (sharing on). For GSM8K debates (3 agents, 2 rounds), at every step the first
agent computes the shared transcript exactly (it owns it); each other agent then reads it and is
teacher-forced over the continuation that an exact computation of its own prompt generates. The
reference for every number is the same request under a fresh ``cache_salt`` (nothing shared,
nothing cached: an exact prefill on the same server binary). What the reader recomputes is set per
request — ``custom_params["kvcmas_recompute_boundary"]`` (first tokens of each borrowed span) and
``["kvcmas_recompute_mass_fraction"]`` (share of borrowed tokens with the largest owner head mass)
and ``["kvcmas_recompute_tail"]`` (the last borrowed tokens before the reader's suffix) — so every
configuration reads the same owner KV (explicit knobs bypass the agent's exact leaves). The
spare pass is off (``KVCMAS_SPARE_PREFILL=0``): one request at a time, it would serve every
reader exactly and each configuration would match the reference.

Per configuration it reports, over reader turns: teacher-forced top-1 agreement with the exact
computation, mean KL on the exact computation's top-20 tokens (KL20: both distributions
renormalized there), mean |Δ log p| of the forced token, the server-side time to first token of the reader
request, and the tokens recomputed.

    python benchmark/serving/recompute_fidelity.py [--questions 4] [--configs 0:0,16:0,16:0.1:32] \
        [--model-path NAME]

``--model-path`` (``model_arg``): the served model; records and the summary name
it, and the default ``--out`` gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sglang_kvcmas_bench.figures import pct
from sglang_kvcmas_bench.forced_reads import compare, config_name, forced, parse_config
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import NO_SPARE_PASS, ArmServer
from sglang_kvcmas_bench.server_calls import generate
from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids, debate

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "recompute_fidelity"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="0:0,16:0,16:0.05,16:0.1,16:0.2",
                    help="boundary:mass_fraction pairs")
    ap.add_argument("--continuation", type=int, default=32, help="teacher-forced tokens")
    ap.add_argument("--answer-tokens", type=int, default=64, help="tokens per debate answer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="results stem (default: results/recompute_fidelity[_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    configs = [parse_config(c) for c in args.configs.split(",")]

    from sglang_kvcmas_examples.datasets import gsm8k

    tok = model.tokenizer()
    questions = [q.question for q in gsm8k()[: args.questions]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    t_start = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="kvcmas-fidelity-")) / "server.log"
    print(f"[recompute_fidelity] server log: {log}", file=sys.stderr, flush=True)
    with ArmServer("kvcmas", log, model.server_args, env=NO_SPARE_PASS) as server:
        url = server.url
        for name, head in DEBATERS.items():  # every agent's head cached, as in a running service
            generate(url, chat_prompt_ids(tok, [{"role": "system", "content": head},
                                           {"role": "user", "content": "Say hello."}]), 1)
        for qi, question in enumerate(questions):
            flow = debate(qi, question, rounds=args.rounds)
            for step in range(args.rounds):
                agents = flow.steps[step]
                prompts = {a: chat_prompt_ids(tok, flow.messages(step, a)) for a in agents}
                answers = {}
                for a in agents:  # exact answers: what the reference deployment would say
                    out = generate(url, prompts[a], args.answer_tokens, f"ref-{uuid.uuid4()}")
                    answers[a] = out["text"]
                owner, readers = agents[0], agents[1:]
                generate(url, prompts[owner], 1)  # the owner computes the new transcript exactly
                for a in readers:
                    ids = prompts[a]
                    cont = tok.encode(answers[a], add_special_tokens=False)[: args.continuation]
                    ref = forced(url, ids, cont, salt=f"ref-{uuid.uuid4()}")
                    for b, m, t in configs:
                        got = forced(url, ids, cont, config=(b, m, t))
                        rec = {"model": model.name, "question": qi, "round": step + 1, "agent": a, "boundary": b,
                               "mass_fraction": m, "tail": t, "config": config_name(b, m, t),
                               "prompt_tokens": len(ids), **compare(ref, got, cont),
                               "ttft_s": got["ttft_s"], "wall_s": got["wall_s"],
                               "ref_wall_s": ref["wall_s"], "reuse": got["reuse"]}
                        records.append(rec)
                        flips = " ".join(f"@{f['pos']}(gap {f['gap']:.3f}, moved {f['move']:+.3f})"
                                         for f in rec["flips"])
                        print(f"q{qi} r{step + 1} {a:5s} config={rec['config']} "
                              f"top1={rec['top1']:.3f} kl20={rec['kl20']:.2e} "
                              f"dlogp={rec['dlogp']:.4f} "
                              f"recomputed={rec['reuse'].get('recomputed')} "
                              f"borrowed={rec['reuse'].get('borrowed')}"
                              + (f" flips {flips}" if flips else ""), flush=True)
                flow.record(step, answers)
    run_s = time.perf_counter() - t_start

    rows = []
    naive = [r["kl20"] for r in records if r["config"] == "0:0.0"]
    naive_kl = statistics.fmean(naive) if naive else None
    for b, m, t in configs:
        name = config_name(b, m, t)
        rs = [r for r in records if r["config"] == name and r["reuse"].get("borrowed")]
        if not rs:
            continue
        kl = statistics.fmean(r["kl20"] for r in rs)
        rows.append({
            "config": name, "boundary": b, "mass_fraction": m, "tail": t, "n": len(rs),
            "top1": statistics.fmean(r["top1"] for r in rs),
            "kl20": kl, "kl_recovered": (1 - kl / naive_kl) if naive_kl else float("nan"),
            "dlogp": statistics.fmean(r["dlogp"] for r in rs),
            "recomputed": statistics.fmean(r["reuse"]["recomputed"] for r in rs),
            "wall_ratio_vs_exact": statistics.median(r["wall_s"] / r["ref_wall_s"] for r in rs),
            "flips": sum(len(r["flips"]) for r in rs),
            "positions": sum(len(r["gaps"]) for r in rs),
            "gap_move_p50": pct([m for r in rs for m in r["gap_moves"]], 0.5),
            "gap_move_p99": pct([m for r in rs for m in r["gap_moves"]], 0.99),
        })
    lines = [f"{'boundary:mass':>13} {'n':>3} {'top1':>6} {'kl20':>9} {'kl_recov':>8} "
             f"{'dlogp':>7} {'recomputed':>10} {'wall/exact':>10} {'flips':>9} "
             f"{'gap_move50':>10} {'gap_move99':>10}"]
    for r in rows:
        lines.append(f"{r['config']:>13} {r['n']:>3} {r['top1']:>6.3f} {r['kl20']:>9.2e} "
                     f"{r['kl_recovered']:>8.3f} {r['dlogp']:>7.4f} {r['recomputed']:>10.1f} "
                     f"{r['wall_ratio_vs_exact']:>10.3f} {r['flips']:>4}/{r['positions']:<4} "
                     f"{r['gap_move_p50']:>10.4f} {r['gap_move_p99']:>10.4f}")
    per_turn = {(r["question"], r["round"], r["agent"]): r["gaps"] for r in records
                if r["reuse"].get("borrowed")}  # the exact gaps: the same in every config
    gaps = [g for gs in per_turn.values() for g in gs]
    if gaps:
        lines.append("exact top-2 gap (log p1 - log p2) over the forced positions: "
                     + ", ".join(f"< {t}: {sum(g < t for g in gaps) / len(gaps):.3f}"
                                 for t in (0.02, 0.05, 0.1, 0.2, 0.5))
                     + f" (n={len(gaps)}); a flip needs the reader to move the gap past it")
    lines.append(f"model {model.name}; run time {run_s:.0f} s; command: python benchmark/serving/recompute_fidelity.py "
                 + " ".join(sys.argv[1:]))
    summary = "\n".join(lines)
    print(summary)
    about = (f"reader turns inside the server against an exact prefill ({args.questions} "
             f"debates x {args.rounds} rounds, {model.name}) by what the reader recomputes "
             f"(boundary:mass[:tail] {', '.join(r['config'] for r in rows)})")
    record(args.out.with_suffix(".jsonl"), "".join(json.dumps(r) + "\n" for r in records),
           what=f"{about}: one record per reader turn and configuration")
    record(args.out.with_suffix(".txt"), summary + "\n",
           what=f"{about}: the table (top-1, KL20, KL recovered, recomputed tokens, flips)")
    record(args.out.with_suffix(".png"), lambda p: plot(rows, p), what=f"its plot ({about})")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    xs = [r["recomputed"] for r in rows]
    for x, r in zip(xs, rows):
        marker = "o" if r["mass_fraction"] == 0 else "s"
        a.scatter(x, r["kl20"], marker=marker, color="C0" if marker == "o" else "C2")
        a.annotate(r["config"], (x, r["kl20"]), fontsize=7, xytext=(3, 3),
                   textcoords="offset points")
        b.scatter(x, r["wall_ratio_vs_exact"], marker=marker, color="C1")
    a.set_xlabel("prompt tokens recomputed per reader turn (mean)")
    a.set_ylabel("KL20 vs exact (reader turns)")
    a.set_yscale("log")
    b.set_xlabel("prompt tokens recomputed per reader turn (mean)")
    b.set_ylabel("reader request time / exact (median)")
    fig.suptitle("Reader reuse inside SGLang (boundary:mass_fraction): circles boundary only, "
                 "squares + owner head mass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
