"""Behaviour check: per-turn reuse accounting and greedy outputs of one server, replayed exactly.

Runs the quick head-to-head's workflows (4 three-agent GSM8K debates + 2 reviewer chains) against
one sharing server, **one turn at a time** (workflow after workflow, agent after agent), so no
turn's result depends on timing: the same code gives the same record, turn by turn. Each turn
keeps its prompt length, how the prompt was served (tokens reused exactly, borrowed from another
agent, recomputed; the correction label) and its greedy output token ids.

    python benchmark/serving/behaviour_check.py --out A.json          # record
    python benchmark/serving/behaviour_check.py --compare A.json B.json   # identical turn by turn?

``--compare`` exits 1 on the first difference and prints every differing turn. Run it before and
after a change that must not change behaviour (a refactor): both records must match exactly.
The server runs with the spare pass off (``KVCMAS_SPARE_PREFILL=0``): one turn at a time, an
idle server would serve every turn exactly and the read path would go unchecked; ``--compare``
also fails when no turn borrowed.
Accounting fields are read under their current and earlier names (``reuse_records.py``;
``borrowed`` = every token read from another context, re-positioned or corrected).
``--model-path`` (``model_arg``): the served model; the record names it, and the
default ``--out`` gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import normalized, of_meta
from sglang_kvcmas_bench.server_arms import NO_SPARE_PASS, ArmServer
from sglang_kvcmas_bench.workflows import chat_prompt_ids, debate, reviewer_chain

ROOT = Path(__file__).resolve().parents[2]

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "behaviour_check.json"


def generate(url: str, ids: list[int], max_new: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def record_turns(url: str, max_new: int, n_debates: int, n_chains: int,
           model_folder: Path | None = None) -> list[dict]:
    """Every turn's record (``model_folder``: the served model's, default the embedded one)."""
    from sglang_kvcmas.models.resolve import resolve_model_path
    from sglang_kvcmas_examples.datasets import gsm8k
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_folder or resolve_model_path(None)))
    items = gsm8k()
    flows = [debate(i, items[i].question) for i in range(n_debates)]
    flows += [reviewer_chain(100 + i, items[50 + i].question) for i in range(n_chains)]
    turns = []
    for flow in flows:
        for step, agents in enumerate(flow.steps):
            texts = {}
            for agent in agents:
                ids = chat_prompt_ids(tok, flow.messages(step, agent))
                out = generate(url, ids, max_new)
                texts[agent] = out["text"]
                turns.append({"kind": flow.kind, "wid": flow.wid, "step": step, "agent": agent,
                              "prompt_tokens": len(ids), "output_ids": out.get("output_ids"),
                              **of_meta(out["meta_info"])})
                print(f"[behaviour] {flow.kind} {flow.wid} step {step} {agent}: "
                      f"{len(ids)} prompt tokens, {turns[-1].get('borrowed', 0)} borrowed, "
                      f"{turns[-1].get('recomputed', 0)} recomputed", flush=True)
            flow.record(step, texts)
    return turns


def _normalized(turn: dict) -> dict:
    """A recorded turn under the current schema (records made before the accounting rename
    kept the server's ``correction`` label)."""
    if "correction" not in turn:
        return turn
    out = {k: v for k, v in turn.items() if k != "correction"}
    out.update(normalized({"reused_exact": turn["exact"], "reused_factored": turn["borrowed"],
                           "recomputed": turn["recomputed"], "correction": turn["correction"]}))
    return out


def compare(a_path: Path, b_path: Path) -> int:
    a, b = (json.loads(p.read_text()) for p in (a_path, b_path))
    ta, tb = [_normalized(t) for t in a["turns"]], [_normalized(t) for t in b["turns"]]
    bad = 0
    if len(ta) != len(tb):
        print(f"different turn counts: {len(ta)} vs {len(tb)}")
        bad += 1
    for x, y in zip(ta, tb):
        if x != y:
            bad += 1
            diff = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y))
                    if x.get(k) != y.get(k)}
            print(f"turn {x['kind']} {x['wid']} step {x['step']} {x['agent']} differs: "
                  + ", ".join(f"{k}: {u!r} vs {v!r}" for k, (u, v) in diff.items()
                              if k != "output_ids")
                  + (" (output ids differ)" if "output_ids" in diff else ""))
    borrowed = sum(t.get("borrowed", 0) for t in ta)
    recomputed = sum(t.get("recomputed", 0) for t in ta)
    print(f"BEHAVIOUR turns={len(ta)} differing={bad} borrowed_tokens={borrowed} "
          f"recomputed_tokens={recomputed} ({a.get('commit')} vs {b.get('commit')})")
    if not borrowed:
        print("no turn borrowed: these records check only exact serving (the spare pass on?)")
    return 1 if bad or not borrowed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="record path (default: results/behaviour_check[_<model>].json)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--debates", type=int, default=4)
    ap.add_argument("--chains", type=int, default=2)
    add_model_arg(ap)
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log = args.out.parent / args.out.stem / "server.log"  # a folder beside: not a result
    with ArmServer("kvcmas", log, model.server_args, env=NO_SPARE_PASS) as server:
        print(f"[behaviour] server up at {server.url} after {time.perf_counter() - t0:.0f} s",
              flush=True)
        turns = record_turns(server.url, args.max_new_tokens, args.debates, args.chains,
                             model.folder)
    record(args.out, json.dumps({
        "commit": commit, "machine": platform.node(), "model": model.name,
        "max_new_tokens": args.max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "turns": turns}, indent=1),
        what=f"per-turn reuse accounting and greedy output ids of {args.debates} debates + "
             f"{args.chains} chains ({args.max_new_tokens}-token answers, {model.name}), "
             f"replayed one turn at a time: {len(turns)} turns, "
             f"{time.perf_counter() - t0:.0f} s (`--compare A B` diffs two)")
    print(f"[behaviour] {len(turns)} turns in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
