"""Sharing over SGLang's own attention backends gives the answers of ``kvcmas_delta``.

One server at a time per ``--attention-backend`` (sharing on, same pool): two agents with
different heads compute a GSM8K question each (owners), the first extends the transcript with an
essay passage (owner), the second then reads that passage borrowed (reader). Every turn returns
its greedy tokens and top-4 logprobs; each backend is compared with the first one.

On CPU SGLang's ``triton`` backend runs in Triton's interpreter (``TRITON_INTERPRET=1`` is given
to that server only; slow: seconds per decode step), which is how its dispatcher is exercised end
to end without a GPU; on GPU pass ``--backends kvcmas_delta,triton,flashinfer`` with
``KVCMAS_BENCH_SERVER_ARGS='--device cuda'``.

    python benchmark/serving/backend_parity.py [--backends kvcmas_delta,triton] [--new-tokens 8]

Ends with ``PARITY backends=<b,...> same_tokens=<turns>/<turns> max_logprob_diff=<x>
reader_reused_repositioned=<n>``; writes ``results/backend_parity[_<model>].json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from sglang_kvcmas.envs import KVCMAS_BENCH_SERVER_ARGS
from sglang_kvcmas.server.options import parse_launcher_args
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import ArmServer, run_header
from sglang_kvcmas_bench.server_calls import generate
from sglang_kvcmas_bench.workflows import chat_prompt_ids
from sglang_kvcmas_examples import datasets

OUT = Path(__file__).resolve().parent / "results"
HEADS = ("You are Ada, a careful mathematician who checks every step and states the final "
         "answer as a number.",
         "You are Ben, a skeptical reviewer who looks for the one most likely mistake before "
         "agreeing.")


def turns(tokenizer) -> list[tuple[str, list[int]]]:
    """(name, prompt ids) of the exchange: both heads on the question, then on the longer
    transcript (the first agent owns it, the second reads it)."""
    question = datasets.gsm8k()[0].question
    passage = datasets.essays()[0][1][:1500]
    longer = f"{question}\n\nBackground reading:\n{passage}\n\nAnswer the question."

    def ids(head, user):
        return chat_prompt_ids(tokenizer, [{"role": "system", "content": head},
                                           {"role": "user", "content": user}])

    return [("owner_a1", ids(HEADS[0], question)), ("owner_b1", ids(HEADS[1], question)),
            ("owner_a2", ids(HEADS[0], longer)), ("reader_b2", ids(HEADS[1], longer))]


def run_backend(backend: str, prompts, new_tokens: int, model, log: Path) -> dict:
    on_cpu = parse_launcher_args(shlex.split(KVCMAS_BENCH_SERVER_ARGS.get())).on_cpu
    env = {"TRITON_INTERPRET": "1"} if backend == "triton" and on_cpu else {}
    out = {}
    with ArmServer("kvcmas", log,
                   extra_args=["--attention-backend", backend, *model.server_args],
                   env=env, boot_timeout_s=900) as server:
        for name, ids in prompts:
            t0 = time.perf_counter()
            meta = generate(server.url, ids, new_tokens, return_logprob=True,
                            top_logprobs_num=4)["meta_info"]
            reuse = (meta.get("kvcmas_reuse") or [{}])[0]
            out[name] = {"seconds": round(time.perf_counter() - t0, 2),
                         "tokens": [x[1] for x in meta["output_token_logprobs"]],
                         "logprobs": [x[0] for x in meta["output_token_logprobs"]],
                         "top": meta["output_top_logprobs"], "reuse": reuse}
            print(f"  {backend} {name}: {out[name]['seconds']} s, tokens {out[name]['tokens']}, "
                  f"re-positioned {reuse.get('reused_repositioned')}", flush=True)
    return out


def compare(ref: dict, got: dict) -> dict:
    """Per turn: same greedy tokens, and the largest logprob difference (over the chosen
    tokens and the top-4 alternatives of each step, where both name the same token)."""
    rows = {}
    for name, r in ref.items():
        g = got[name]
        diffs = [abs(a - b) for a, b in zip(r["logprobs"], g["logprobs"])]
        for ta, tb in zip(r["top"], g["top"]):
            lb = {t: lp for lp, t, *_ in tb}
            diffs += [abs(lp - lb[t]) for lp, t, *_ in ta if t in lb]
        rows[name] = {"same_tokens": r["tokens"] == g["tokens"], "max_logprob_diff": max(diffs)}
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="kvcmas_delta,triton",
                    help="attention backends, the first is the reference")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    backends = args.backends.split(",")
    prompts = turns(model.tokenizer())
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = {b: run_backend(b, prompts, args.new_tokens, model, logs / f"parity_{b}.log")
               for b in backends}
    comparison = {b: compare(results[backends[0]], results[b]) for b in backends[1:]}
    n = sum(len(c) for c in comparison.values())
    same = sum(row["same_tokens"] for c in comparison.values() for row in c.values())
    worst = max((row["max_logprob_diff"] for c in comparison.values() for row in c.values()),
                default=0.0)
    reader = min(results[b]["reader_b2"]["reuse"].get("reused_repositioned", 0)
                 for b in backends)
    headline = (f"PARITY backends={','.join(backends)} same_tokens={same}/{n} "
                f"max_logprob_diff={worst:.2e} reader_reused_repositioned={reader}")
    path = model.out_or_named(args.out, OUT / "backend_parity.json")
    record(path, json.dumps({**run_header("benchmark/serving/backend_parity.py", argv, model),
                             "results": results, "comparison": comparison,
                             "headline": headline}, indent=1),
           what=f"sharing over SGLang's attention backends against the first, one server at a "
                f"time, {len(prompts)} turns ({model.name}): `{headline}`")
    print(json.dumps(comparison, indent=1))
    print(headline)


if __name__ == "__main__":
    main()
