"""Fidelity of the served low-rank correction against exact tokens, inside SGLang's server.

One kvcmas server (sharing on). GSM8K debates (3 agents, 2 rounds): at every step the first agent
computes the new transcript exactly (it owns it); each other agent reads it and is
teacher-forced over the continuation an exact computation of its own prompt generates. The
reference is the same request under a fresh ``cache_salt`` (an exact prefill on the same server).
Every configuration reads the same owner KV (per-request knobs: no leaves of earlier turns):

- ``naive``: nothing recomputed, every borrowed token re-positioned only;
- ``exact``: the deployment's recompute (``--boundary`` first tokens of every borrowed span and
  the ``--mass`` share with the largest owner head mass) exact, the rest re-positioned: what
  leaf mode ``exact`` reads (its leaves are those exact tokens);
- ``lowrank<r>``: the same recomputed tokens, and every other foreign borrowed token read through
  the rank-``r`` correction the request fits from them, layer by layer, in the same forward
  (leaf mode ``lowrank``).

Per configuration: top-1 agreement, KL20 (KL on the exact computation's top-20 tokens, both
renormalized there), KL recovered vs naive (``1 − KL/KL_naive``), |Δ log p| of the forced token,
tokens read corrected, and the leaf bytes per agent the mode keeps: exact leaves = the
recomputed tokens' KV; low-rank = the factors (``2·L·H_kv·(2·d·r + r)`` float32).

    python benchmark/serving/lowrank_fidelity.py [--quick] [--questions 4] [--ranks 4,8,16]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.model_arg import add_model_arg, model_from_args  # noqa: E402
from benchmark.serving.recompute_fidelity import compare, forced, generate, prompt_ids  # noqa: E402
from benchmark.serving.server_arms import ArmServer  # noqa: E402
from benchmark.serving.workflows import DEBATERS, debate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "lowrank_fidelity"


def configs(boundary: int, mass: float, ranks: list[int]) -> dict[str, dict]:
    """Configuration name -> the reader request's ``custom_params``."""
    recompute = {"kvcmas_recompute_boundary": boundary, "kvcmas_recompute_mass_fraction": mass}
    out = {"naive": {"kvcmas_recompute_boundary": 0, "kvcmas_recompute_mass_fraction": 0.0},
           "exact": dict(recompute)}
    for r in ranks:
        out[f"lowrank{r}"] = {**recompute, "kvcmas_leaf_mode": "lowrank",
                              "kvcmas_lowrank_rank": r}
    return out


def lowrank_bytes(model, rank: int) -> int:
    """Bytes of one agent's factors: K and V, every layer and KV head, float32."""
    return 2 * model.num_layers * model.num_kv_heads * (2 * model.head_dim * rank + rank) * 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one question (about 5-10 minutes)")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--boundary", type=int, default=16)
    ap.add_argument("--mass", type=float, default=0.1)
    ap.add_argument("--continuation", type=int, default=32, help="teacher-forced tokens")
    ap.add_argument("--answer-tokens", type=int, default=64, help="tokens per debate answer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="results stem (default: results/lowrank_fidelity[_quick][_<model>])")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args)
    if args.quick:
        args.questions = 1
    default = DEFAULT_OUT.with_name(DEFAULT_OUT.name + ("_quick" if args.quick else ""))
    out = model.named(default) if args.out == DEFAULT_OUT else args.out
    ranks = [int(r) for r in args.ranks.split(",") if r]
    confs = configs(args.boundary, args.mass, ranks)

    from sglang_kvcmas.datasets import gsm8k

    tok = model.tokenizer()
    questions = [q.question for q in gsm8k()[: args.questions]]
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    t_start = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="kvcmas-lowrank-")) / "server.log"
    print(f"[lowrank_fidelity] server log: {log}", file=sys.stderr, flush=True)
    with ArmServer("kvcmas", log, model.server_args) as server:
        url = server.url
        for head in DEBATERS.values():  # every agent's head cached, as in a running service
            generate(url, prompt_ids(tok, [{"role": "system", "content": head},
                                           {"role": "user", "content": "Say hello."}]), 1)
        for qi, question in enumerate(questions):
            flow = debate(qi, question, rounds=args.rounds)
            for step in range(args.rounds):
                agents = flow.steps[step]
                prompts = {a: prompt_ids(tok, flow.messages(step, a)) for a in agents}
                answers = {a: generate(url, prompts[a], args.answer_tokens,
                                       f"ref-{uuid.uuid4()}")["text"] for a in agents}
                owner, readers = agents[0], agents[1:]
                generate(url, prompts[owner], 1)  # the owner computes the new transcript exactly
                for a in readers:
                    ids = prompts[a]
                    cont = tok.encode(answers[a], add_special_tokens=False)[: args.continuation]
                    ref = forced(url, ids, cont, salt=f"ref-{uuid.uuid4()}")
                    for name, custom in confs.items():
                        got = forced(url, ids, cont, custom=custom)
                        reuse = got["record"]
                        rec = {"model": model.name, "question": qi, "round": step + 1,
                               "agent": a, "config": name, "prompt_tokens": len(ids),
                               **compare(ref, got, cont), "wall_s": got["wall_s"],
                               "ref_wall_s": ref["wall_s"], "reuse": reuse}
                        records.append(rec)
                        print(f"q{qi} r{step + 1} {a:5s} {name:10s} top1={rec['top1']:.3f} "
                              f"kl20={rec['kl20']:.3e} dlogp={rec['dlogp']:.4f} "
                              f"corrected={reuse.get('reused_corrected')} "
                              f"repositioned={reuse.get('reused_repositioned')} "
                              f"recomputed_borrowed={reuse.get('recomputed_borrowed')}",
                              flush=True)
                flow.record(step, answers)
    run_s = time.perf_counter() - t_start

    with out.with_suffix(".jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if k not in ("gaps", "gap_moves")})
                   + "\n")
    lines = summary(records, list(confs), model)
    lines.append(f"model {model.name}; run time {run_s:.0f} s; command: python "
                 "benchmark/serving/lowrank_fidelity.py " + " ".join(sys.argv[1:]))
    text = "\n".join(lines)
    print(text)
    out.with_suffix(".txt").write_text(text + "\n")
    return 0


def summary(records: list[dict], names: list[str], model) -> list[str]:
    """One row per configuration over the reader turns that borrowed (the same turns in all)."""
    turns = {(r["question"], r["round"], r["agent"]) for r in records
             if r["config"] == "naive" and r["reuse"].get("reused_repositioned")}
    rows = {n: [r for r in records if r["config"] == n
                and (r["question"], r["round"], r["agent"]) in turns] for n in names}
    naive = statistics.fmean(r["kl20"] for r in rows["naive"]) if rows.get("naive") else None
    lines = [f"reader turns: {len(turns)}; KV bytes per token {model.kv_bytes_per_token}",
             f"{'config':>10} {'n':>3} {'top1':>6} {'kl20':>9} {'kl_recov':>8} {'dlogp':>7} "
             f"{'rec_borrowed':>12} {'corrected':>9} {'repos':>6} {'leaf_KB/agent':>13}"]
    for n in names:
        rs = rows[n]
        if not rs:
            continue
        kl = statistics.fmean(r["kl20"] for r in rs)
        rec_b = statistics.fmean(r["reuse"].get("recomputed_borrowed", 0) for r in rs)
        if n == "naive":
            leaf = 0.0
        elif n == "exact":
            leaf = rec_b * model.kv_bytes_per_token
        else:
            leaf = lowrank_bytes(model, int(n.removeprefix("lowrank")))
        lines.append(
            f"{n:>10} {len(rs):>3} {statistics.fmean(r['top1'] for r in rs):>6.3f} {kl:>9.3e} "
            f"{(1 - kl / naive) if naive else float('nan'):>8.3f} "
            f"{statistics.fmean(r['dlogp'] for r in rs):>7.4f} {rec_b:>12.1f} "
            f"{statistics.fmean(r['reuse'].get('reused_corrected', 0) for r in rs):>9.1f} "
            f"{statistics.fmean(r['reuse'].get('reused_repositioned', 0) for r in rs):>6.1f} "
            f"{leaf / 1024:>13.1f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
