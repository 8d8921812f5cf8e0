"""Sharing at scale: host work at a 32k transcript, reader decode vs radix, 16 agents over a long
transcript, and (from ``router_scale.py``) sharing behind SGLang's router.

Parts (each one server at a time, same binary, same KV pool):

- ``host``: ``host_path.py`` in process: median host ms per reader admission at a 32k-token
  transcript (16 agents) and turn-order hook ms per scheduler pass with 16 agents waiting.
- ``decode``: reader decode tokens/s against radix at the same batch and context: an owner
  computes an essay transcript of ``C`` tokens, ``--readers`` agents with other system prompts
  then decode ``--decode-tokens`` tokens each, all at once (after one warm turn each, so radix
  decodes from its own exact copies and ours from the owner's, re-positioned, plus each reader's
  leaves). Decode rate = tokens after the first / time from first to last token, over the batch.
  The spare pass is off here (``KVCMAS_SPARE_PREFILL=0``, every arm): one warm turn at a time,
  it would serve each reader exactly, and the part would time radix's path twice.
  ``--decode-variants`` adds kvcmas arms with other flags (e.g. exact leaves).
- ``panel``: 16 agents with their own system prompts introduce themselves in one short round,
  then review one essay document (≥ 7k tokens) in two rounds (the second reads the first's
  answers): makespan, non-owner TTFT (document rounds), peak KV held vs the one-copy ideal. The
  short first round is where each agent's system prompt gets cached: an agent's first request
  computes its whole prompt exactly under sharing too (a reader borrows only after its head).
- router: ``router_scale.py`` measures it (it boots four server fleets); this script reads its
  latest JSON (``--router-json``) and names it.

    python benchmark/serving/scale.py --quick      # host + decode at 2k and 8k, < 15 min
    python benchmark/serving/scale.py              # + the 16-agent panel
    python benchmark/serving/scale.py --parts panel \
        --panel-variants 'exact=--kvcmas-leaf-mode exact'  # + a kvcmas variant

Ends with ``HEADLINE host_ms_per_admission_32k=<x> hook_ms_per_iter_16agents=<x>
decode_ratio_vs_radix=<x> router_sharing_ratio=<x>``; writes ``results/scale[_quick].json``
(``_<model>`` added for a model other than the embedded one: ``--model-path``, served in every
arm, ``model_arg``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_kvcmas_bench import host_sim
from sglang_kvcmas_bench.figures import fmt
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.review_panel import (
    chat_ids,
    essay_ids,
    leaf_bytes_per_agent,
    nonowner_ttft,
    panel_arm,
    same_answers,
    stream,
)
from sglang_kvcmas_bench.server_arms import NO_SPARE_PASS, ArmServer, run_header
from sglang_kvcmas_examples.panel import PERSONAS, system_prompt

RESULTS = Path(__file__).resolve().parent / "results"


def say(text: str) -> None:
    print(f"[scale] {text}", file=sys.stderr, flush=True)


def decode_arm(arm: str, tok, contexts: list[int], readers: int, new: int, pool: int,
               out: Path, model_args: list[str] | None = None,
               flags: list[str] | None = None, server_arm: str | None = None) -> dict:
    """Decode tokens/s of ``readers`` agents at once over each context, one server
    (``model_args``: the launcher's ``--model-path``, default the embedded model; the server is
    ``server_arm``, default ``arm``, with ``flags`` added), the spare pass off."""
    heads = [system_prompt(p) for p in PERSONAS[: readers + 1]]
    rows = {}
    with ArmServer(server_arm or arm, out / f"scale_decode_{arm}.log",
                   [*(model_args or []), "--max-total-tokens", str(pool), *(flags or [])],
                   env=NO_SPARE_PASS) as server:
        for c in contexts:
            stream(server.url, tok.encode("Warm up."), 2)
            doc = essay_ids(tok, c)
            for h in heads:  # every head cached (a reader can only borrow after its head)
                stream(server.url, chat_ids(tok, h, doc[:16]), 1)
            stream(server.url, chat_ids(tok, heads[0], doc), 1)  # the owner
            prompts = [chat_ids(tok, h, doc) for h in heads[1:]]
            for p in prompts:  # one warm turn each: radix computes its copy, ours borrows
                stream(server.url, p, 1)
            with ThreadPoolExecutor(readers) as pool_:
                runs = list(pool_.map(lambda p: stream(server.url, p, new), prompts))
            window = max(r["last"] for r in runs) - min(r["first"] for r in runs)
            tokens = sum(r["tokens"] - 1 for r in runs)
            each = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in runs]
            borrowed = sum(of_meta(r["meta"]).get("borrowed", 0) for r in runs)
            rows[c] = {"context": len(prompts[0]), "decode_tok_s": tokens / window,
                       "per_request_tok_s_median": statistics.median(each),
                       "borrowed_tokens": borrowed}
            say(f"decode {arm} context {len(prompts[0])}: {tokens / window:.1f} tok/s over "
                f"{readers} readers (per request median {statistics.median(each):.1f}; "
                f"borrowed {borrowed})")
            urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache",
                                                          method="POST"), timeout=60).read()
    return rows


def parse_variants(text: str, flag: str = "--panel-variants") -> dict[str, list[str]]:
    """``name=flags;name=flags`` (flags split on spaces) -> name -> flags of a kvcmas arm."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, flags = part.partition("=")
        if not sep or not name.strip() or name.strip() in ("radix", "kvcmas"):
            raise SystemExit(f"{flag}: expected NAME=FLAGS (NAME not radix or "
                             f"kvcmas), got {part!r}")
        out[name.strip()] = flags.split()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="host + decode only (< 15 min)")
    ap.add_argument("--parts", default="host,decode,panel",
                    help="comma-separated parts to run (--quick: host,decode)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--readers", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-variants", default="",
                    help="more kvcmas decode arms, 'NAME=FLAGS;...', e.g. "
                         "'exact=--kvcmas-leaf-mode exact'")
    ap.add_argument("--panel-agents", type=int, default=16)
    ap.add_argument("--panel-doc", type=int, default=7000, help="document tokens")
    ap.add_argument("--panel-tokens", type=int, default=24, help="answer tokens per turn")
    ap.add_argument("--panel-variants", default="",
                    help="more kvcmas panel arms, 'NAME=FLAGS;...', e.g. "
                         "'exact=--kvcmas-leaf-mode exact'")
    ap.add_argument("--panel-probe", type=int, default=0,
                    help="after each sharing arm's workload, measure this many round-2 reader "
                         "turns against an exact prefill (KL recovered, top-1)")
    ap.add_argument("--panel-arms", default="radix",
                    help="stock arms of the panel besides the sharing ones ('' : none; the "
                         "radix comparisons then read n/a)")
    ap.add_argument("--pool", type=int, default=40000, help="KV pool tokens of every arm")
    ap.add_argument("--router-json", type=Path, default=None,
                    help="router_scale.py's JSON (default: the first of router_scale.json, "
                         "router_scale_quick.json, router_scale_quick_busy.json in results/)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default: results/scale[_quick][_<model>].json)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    out = args.out or model.named(RESULTS / ("scale_quick.json" if args.quick else "scale.json"))
    logs = model.named(RESULTS / "scale")
    logs.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer()
    t_start = time.monotonic()
    result: dict = {
        **run_header("benchmark/serving/scale.py", argv, model),
        "pool_tokens": args.pool,
    }
    parts = {"host", "decode"} if args.quick else set(args.parts.split(","))
    host, ratios = None, {}
    if "host" in parts:
        say("host path: 16 agents, 32k-token transcript (no model)")
        host = host_sim.run()
        result["host"] = {k: host[k] for k in ("host_ms_per_admission", "hook_ms_per_iter",
                                               "hook_waiting", "hook_held")}
    if "decode" in parts:
        arms = {"radix": ("radix", []), "kvcmas": ("kvcmas", []),
                **{n: ("kvcmas", f) for n, f in parse_variants(args.decode_variants, "--decode-variants").items()}}
        decode = {name: decode_arm(name, tok, args.contexts, args.readers, args.decode_tokens,
                                   args.pool, logs, model.server_args, flags, server_arm)
                  for name, (server_arm, flags) in arms.items()}
        ratios = {c: decode["kvcmas"][c]["decode_tok_s"] / decode["radix"][c]["decode_tok_s"]
                  for c in args.contexts}
        result["decode"] = {"arms": decode, "ratio_by_context": ratios, "variant_ratios": {
            name: {c: decode[name][c]["decode_tok_s"] / decode["radix"][c]["decode_tok_s"]
                   for c in args.contexts} for name in arms if name not in ("radix", "kvcmas")}}
    if "panel" in parts:
        variants = {"kvcmas": [], **parse_variants(args.panel_variants)}
        stock = [a for a in args.panel_arms.split(",") if a]
        panel = {a: panel_arm(a, tok, args.panel_agents, args.panel_doc, args.panel_tokens,
                              args.pool, logs, model.server_args) for a in stock}
        for name, flags in variants.items():
            panel[name] = panel_arm(name, tok, args.panel_agents, args.panel_doc,
                                    args.panel_tokens, args.pool, logs, model.server_args,
                                    server_arm="kvcmas", flags=flags, probe=args.panel_probe)
        has_radix = "radix" in panel
        no = nonowner_ttft(panel) if has_radix else {}
        result["panel"] = {
            "arms": panel, "nonowner_ttft_median_s": no,
            "nonowner_ttft_speedup": no["radix"] / no["kvcmas"] if no else None,
            "makespan_speedup": panel["radix"]["makespan_s"] / panel["kvcmas"]["makespan_s"]
            if has_radix else None,
            "peak_kv_vs_ideal": {a: p["peak_kv_tokens"] / p["one_copy_ideal_tokens"]
                                 for a, p in panel.items()},
            "by_arm": {},
        }
        for name in variants:
            no = nonowner_ttft(panel, name) if has_radix else {}
            leaf = leaf_bytes_per_agent(panel[name].get("leaf_bytes_by_agent"))
            fid = panel[name].get("fidelity") or {}
            result["panel"]["by_arm"][name] = {
                "flags": variants[name],
                "makespan_s": panel[name]["makespan_s"],
                "makespan_speedup": panel["radix"]["makespan_s"] / panel[name]["makespan_s"]
                if has_radix else None,
                "nonowner_ttft_speedup": no["radix"] / no[name] if no else None,
                "peak_kv_vs_ideal": panel[name]["peak_kv_tokens"]
                / panel[name]["one_copy_ideal_tokens"],
                "same_answer_as_radix": same_answers(panel, name) if has_radix else None,
                "leaf_bytes_per_agent_median": statistics.median(leaf) if leaf else None,
                "kl_recovered": fid.get("kl_recovered"), "top1": fid.get("top1"),
                "top1_naive": fid.get("top1_naive"), "probed": len(fid.get("agents") or []),
            }
    router = None
    if args.router_json is None:
        names = ("router_scale.json", "router_scale_quick.json", "router_scale_quick_busy.json")
        paths = [model.named(RESULTS / n) for n in names]
        args.router_json = next((p for p in paths if p.exists()), paths[0])
    if args.router_json.exists():
        data = json.loads(args.router_json.read_text())
        router = data.get("router_sharing_ratio")
        result["router"] = {"from": str(args.router_json),
                            "commit": data.get("commit"), "router_sharing_ratio": router}
    result["seconds"] = round(time.monotonic() - t_start, 1)
    for c, r in ratios.items():
        print(f"decode at {result['decode']['arms']['radix'][c]['context']} tokens, {args.readers} readers: "
              f"kvcmas {result['decode']['arms']['kvcmas'][c]['decode_tok_s']:.1f} tok/s vs "
              f"radix {result['decode']['arms']['radix'][c]['decode_tok_s']:.1f} ({r:.2f}x)")
        for name, by in result["decode"]["variant_ratios"].items():
            print(f"  variant {name}: {by[c]:.2f}x radix")
    if "panel" in result:
        p = result["panel"]
        print(f"panel ({args.panel_agents} agents, {args.panel_doc}-token document), peak KV / "
              f"one-copy ideal: " + ", ".join(f"{a} {r:.2f}" for a, r in
                                               p["peak_kv_vs_ideal"].items()))
        for name, b in p["by_arm"].items():
            same = b["same_answer_as_radix"]
            leaf = b["leaf_bytes_per_agent_median"]
            print(f"  {name:>10} {' '.join(b['flags']) or '(defaults)'}: makespan "
                  f"{b['makespan_s']:.1f} s ({fmt(b['makespan_speedup'], 2)}x radix), "
                  f"non-owner TTFT {fmt(b['nonowner_ttft_speedup'], 2)}x radix, peak KV / "
                  f"ideal {b['peak_kv_vs_ideal']:.3f}, leaf KiB per agent "
                  f"{'n/a' if leaf is None else f'{leaf / 1024:.0f}'}, same answer as radix "
                  f"round 1 / 2 {fmt(same and same['round1'], 2)} / "
                  f"{fmt(same and same['round2'], 2)}, KL recovered "
                  f"{fmt(b['kl_recovered'], 3)} top-1 {fmt(b['top1'], 4)} (naive "
                  f"{fmt(b['top1_naive'], 4)}; {b['probed']} readers)")
    router_txt = f"{router:.2f}" if isinstance(router, (int, float)) else "n/a"
    headline = (f"HEADLINE host_ms_per_admission_32k="
                f"{fmt(host and host['host_ms_per_admission'], 2)} "
                f"hook_ms_per_iter_16agents={fmt(host and host['hook_ms_per_iter'], 3)} "
                f"decode_ratio_vs_radix={fmt(min(ratios.values()) if ratios else None, 2)} "
                f"router_sharing_ratio={router_txt}")
    variants = "".join(
        f"; decode {name} {', '.join(f'{r:.2f}x' for r in by.values())}"
        for name, by in result.get("decode", {}).get("variant_ratios", {}).items())
    record(out, json.dumps(result, indent=1) + "\n", command=result["command"],
           what=f"sharing at scale ({model.name}, pool {args.pool}), parts "
                f"{', '.join(sorted(parts))}: `{headline}`{variants}; "
                f"{result['seconds']:.0f} s")
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
