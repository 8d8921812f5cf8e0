"""Serving head-to-head: our shared-context backend vs SGLang's radix cache vs no cache.

Same server binary (SGLang 0.5.23 + our launcher), three arms (``sglang_kvcmas_bench.server_arms.ARMS``), the same
workload over HTTP (``/generate`` with token ids, streaming for TTFT): N concurrent 3-agent GSM8K
debates (3 rounds) plus M concurrent reviewer chains, each step's agents sent together. By default
the three arms' servers run side by side (all up, workloads at the same time), so every arm sees
the same load on a shared machine; ``--sequential`` runs one arm at a time instead.

Reports, per arm (``bench_serving`` style): TTFT mean / median / P99 over all agent turns and over
non-owner turns (turns whose agent did not compute the step's new transcript: in the kvcmas arm
the turns that read another agent's KV; the same (workflow, step, agent) turns in every arm),
workflow makespan, token throughput, peak KV bytes (pool slots held: all slots minus
the pool's available slots = ``sglang:kv_used_tokens + sglang:kv_evictable_tokens``, x bytes per
token; + delta bytes), greedy output agreement with the
radix arm. Then fidelity of the kvcmas arm against the radix arm: the radix arm's prompts and
greedy continuations are replayed on the kvcmas server step by step (so non-owners read shared
KV), and teacher-forced top-1 agreement is read from the server's input logprobs.

Output: a summary on stdout, and in ``--out`` (default ``benchmark/serving/results/``)
``head_to_head[_quick][_sequential][_<model>].jsonl`` (one record per arm + one fidelity record)
and ``.png`` (a plot), each with its row in the folder's index (``_<model>`` for a model other
than the embedded one; servers' logs in a folder of that name), and with ``--quick`` a final
``HEADLINE ...`` line. ``--model-path`` (``model_arg``) serves one model in every
arm; every record names it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from sglang_kvcmas_bench import provenance
from sglang_kvcmas_bench.answers import (
    final_answers,
    first_divergent_turn,
    greedy_agreement,
    same_answer,
    same_number,
)
from sglang_kvcmas_bench.figures import pct
from sglang_kvcmas_bench.kv_ideal import KV_BYTES_PER_TOKEN, one_copy_ideal
from sglang_kvcmas_bench.kv_sampler import KvSampler
from sglang_kvcmas_bench.model_arg import add_model_arg, chat_markers, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.scheduler_profile import SchedulerProfile
from sglang_kvcmas_bench.scheduler_profile import report as profile_report
from sglang_kvcmas_bench.server_arms import ArmServer
from sglang_kvcmas_bench.server_calls import post, stream_generate
from sglang_kvcmas_bench.workload_runs import build_workflows, replay_steps, run_workload, turn_key

RESULTS = Path(__file__).resolve().parent / "results"


def owners_of(turns: list[dict]) -> set[tuple]:
    """(kind, wid, step, agent) of owner turns in the kvcmas arm: nothing borrowed."""
    return {turn_key(t) for t in turns if of_meta(t["meta"]).get("borrowed", 0) == 0}


def teacher_forced(url: str, ref_turns: list[dict]) -> list[dict]:
    """Replay the reference arm's prompts + continuations step by step (agents of a step
    together, workflows concurrently); top-1 agreement per turn from input logprobs."""

    def one(t: dict) -> dict:
        cont = list(t["output_ids"] or [])
        if not cont:
            raise RuntimeError("the reference arm returned no output_ids")
        # Logprobs from the last prompt token on: SGLang gives none for the token at
        # logprob_start_len itself, so entry k + 1 is the prediction of cont[k].
        body = {"input_ids": t["prompt_ids"] + cont, "return_logprob": True,
                "logprob_start_len": len(t["prompt_ids"]) - 1, "top_logprobs_num": 1,
                "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        res = post(url + "/generate", body)
        tops = res["meta_info"]["input_top_logprobs"][1:]
        agree = [bool(top) and top[0][1] == tok for top, tok in zip(tops, cont) if top]
        rec = of_meta(res["meta_info"])
        first_div = next((i for i, a in enumerate(agree) if not a), None)
        return {"kind": t["kind"], "wid": t["wid"], "step": t["step"], "agent": t["agent"],
                "top1": sum(agree) / max(1, len(agree)), "n": len(agree),
                "first_divergence": first_div, "non_owner": rec.get("borrowed", 0) > 0}

    return replay_steps(ref_turns, lambda t: (t["kind"], t["wid"]), one)


def leader_runs(turns: list[dict]) -> tuple[int, int]:
    """How often a debate's leader stayed put in the kvcmas arm: (steps whose one exact agent
    also led the step before, steps with one exact agent after one) from the third step on (in
    the first step every agent computes the short question exactly)."""
    owners = owners_of(turns)
    led: dict[tuple, list[str]] = {}
    for kind, wid, step, agent in owners:
        if kind == "debate":
            led.setdefault((wid, step), []).append(agent)
    kept = total = 0
    for (wid, step), agents in led.items():
        before = led.get((wid, step - 1))
        if step >= 2 and len(agents) == 1 and before is not None and len(before) == 1:
            total += 1
            kept += agents == before
    return kept, total


def divergence_detail(url: str, turn: dict, ref_turn: dict) -> dict:
    """Where a turn first left the reference and how close the exact computation was to a tie
    there: the output position of the first differing token, and the exact log-probability gap
    between the reference's token and ours at that position (a fresh ``cache_salt``: nothing
    shared or cached), when both prompts are the same."""
    ours, theirs = list(turn["output_ids"] or []), list(ref_turn["output_ids"] or [])
    pos = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
               min(len(ours), len(theirs)))
    out = {"step": turn["step"], "agent": turn["agent"], "position": pos, "exact_gap": None}
    if turn["prompt_ids"] != ref_turn["prompt_ids"] or pos >= min(len(ours), len(theirs)):
        return out  # an earlier turn changed the prompt, or one output is a prefix of the other
    body = {"input_ids": turn["prompt_ids"] + theirs[:pos + 1], "return_logprob": True,
            "logprob_start_len": len(turn["prompt_ids"]) + pos - 1, "top_logprobs_num": 20,
            "cache_salt": f"exact-{uuid.uuid4()}",
            "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    tops = post(url + "/generate", body)["meta_info"]["input_top_logprobs"]
    top = {t: lp for lp, t, _ in (tops[-1] or [])}
    if theirs[pos] in top and ours[pos] in top:  # else: our token is not among the top 20
        out["exact_gap"] = top[theirs[pos]] - top[ours[pos]]
    return out


def summarize(arm: str, turns: list[dict], makespan: float, peak: int, non_owner: set,
              kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> dict:
    ttft = [t["ttft"] for t in turns]
    no = [t["ttft"] for t in turns if turn_key(t) in non_owner]
    out_tok = sum(t["meta"].get("completion_tokens", 0) for t in turns)
    in_tok = sum(t["meta"].get("prompt_tokens", 0) for t in turns)
    cached = sum(t["meta"].get("cached_tokens", 0) for t in turns)
    return {
        "arm": arm, "turns": len(turns), "makespan_s": makespan,
        "ttft_mean_s": statistics.mean(ttft), "ttft_median_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 0.99),
        "nonowner_turns": len(no),
        "nonowner_ttft_mean_s": statistics.mean(no) if no else None,
        "nonowner_ttft_median_s": statistics.median(no) if no else None,
        "nonowner_ttft_p99_s": pct(no, 0.99) if no else None,
        "input_tokens": in_tok, "output_tokens": out_tok, "cached_tokens": cached,
        "output_throughput_tok_s": out_tok / makespan,
        "total_throughput_tok_s": (in_tok + out_tok) / makespan,
        "peak_kv_tokens": peak, "peak_kv_bytes": peak * kv_bytes_per_token,
    }


def print_arm(s: dict) -> None:
    print(f"{'=' * 18} Serving Benchmark Result ({s['arm']}) {'=' * 18}")
    rows = [("Agent turns:", s["turns"]), ("Workflow makespan (s):", f"{s['makespan_s']:.2f}"),
            ("Total input tokens:", s["input_tokens"]), ("Cached input tokens:", s["cached_tokens"]),
            ("Total generated tokens:", s["output_tokens"]),
            ("Output token throughput (tok/s):", f"{s['output_throughput_tok_s']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_throughput_tok_s']:.2f}"),
            ("KV pool size (tokens):", s.get("kv_pool_tokens")),
            ("Peak KV tokens held:", s["peak_kv_tokens"]),
            ("Peak KV bytes (base + deltas):", s["peak_kv_bytes"])]
    for k, v in rows:
        print(f"{k:<40}{v:>12}")
    print(f"{'-' * 15}Time to First Token (all turns){'-' * 15}")
    for k in ("mean", "median", "p99"):
        print(f"{k.capitalize() + ' TTFT (ms):':<40}{s['ttft_' + k + '_s'] * 1000:>12.2f}")
    print(f"{'-' * 15}Time to First Token (non-owner turns, n={s['nonowner_turns']}){'-' * 3}")
    for k in ("mean", "median", "p99"):
        v = s["nonowner_ttft_" + k + "_s"]
        print(f"{k.capitalize() + ' TTFT (ms):':<40}{(v or float('nan')) * 1000:>12.2f}")


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [s["arm"] for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(arms, [s["nonowner_ttft_median_s"] or 0 for s in summaries], color="C0",
                label="median")
    axes[0].bar(arms, [s["nonowner_ttft_p99_s"] or 0 for s in summaries], color="C0", alpha=0.3,
                label="P99")
    axes[0].set_title("non-owner TTFT (s)")
    axes[0].legend()
    axes[1].bar(arms, [s["peak_kv_bytes"] / 2**20 for s in summaries], color="C1")
    axes[1].set_title("peak KV (MiB)")
    axes[2].bar(arms, [s["makespan_s"] for s in summaries], color="C2")
    axes[2].set_title("workflow makespan (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 debates + 2 chains, 64 tokens")
    ap.add_argument("--debates", type=int, default=8)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--arms", default="radix,no_cache,kvcmas")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool size of every arm (default: the launcher's 16384); make it "
                         "larger than the radix arm's demand to measure peak KV unclipped")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder of head_to_head[_quick][_sequential][_<model>].{jsonl,png} "
                         "(default: results/); servers' logs go to a folder of that name in it")
    add_model_arg(ap)
    ap.add_argument("--profile", action="store_true",
                    help="sample each arm's scheduler with py-spy during its workload and write "
                         "head_to_head[...]_profile_<arm>.txt (where the time goes)")
    ap.add_argument("--sequential", action="store_true",
                    help="one arm at a time (default: all arms side by side, same machine load)")
    args = ap.parse_args()
    if args.quick:
        args.debates, args.chains, args.max_new_tokens = 4, 2, 64
    model = model_from_args(ap, args)
    stem = ("head_to_head" + ("_quick" if args.quick else "")
            + ("_sequential" if args.sequential else ""))
    name = model.named(Path(stem)).name  # the model last: a profile's arm goes before it
    scratch = args.out / name
    pool_args = model.server_args + ([] if args.max_total_tokens is None
                                     else ["--max-total-tokens", str(args.max_total_tokens)])
    scratch.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer()
    commit = provenance.commit()
    machine = provenance.machine()
    arms = args.arms.split(",")
    assert arms[0] == "radix" and "kvcmas" in arms, "radix first (the reference), kvcmas included"
    results: dict[str, tuple] = {}
    pools: dict[str, int | None] = {}
    fidelity = None
    t_start = time.perf_counter()
    def measure(arm: str, server: ArmServer) -> None:
        flows = build_workflows(args.debates, args.chains)
        sampler = KvSampler(server.url)
        sampler.start()
        raw_path = scratch / f"profile_{arm}.raw"
        spy = SchedulerProfile(server.proc.pid, raw_path).start() if args.profile else None
        turns, makespan = run_workload(server.url, flows, tok, args.max_new_tokens)
        results[arm] = (turns, makespan, sampler.stop())
        if spy is not None and (raw := spy.stop()) is not None:
            record(model.named(args.out / f"{stem}_profile_{arm}.txt"), profile_report(raw),
                   what=f"py-spy profile of the {arm} scheduler during that run (inclusive share "
                        f"of scheduler time: SGLang phases, sglang_kvcmas functions)")
        pools[arm] = sampler.pool_tokens
        print(f"[head_to_head] arm {arm} measured at {time.perf_counter() - t_start:.0f} s",
              file=sys.stderr, flush=True)

    divergences: dict[int, dict] = {}

    def fidelity_pass(server: ArmServer) -> list[dict]:
        urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", method="POST"),
                               timeout=60).read()
        forced = teacher_forced(server.url, results["radix"][0])
        ours, ref_turns = results["kvcmas"][0], results["radix"][0]
        ref = {turn_key(t): t for t in ref_turns}
        pairs = zip(final_answers(ours, args.debates), final_answers(ref_turns, args.debates))
        for w, (mine, theirs) in enumerate(pairs):
            if not same_answer(mine, theirs) and (turn := first_divergent_turn(ours, ref, w)):
                divergences[w] = divergence_detail(server.url, turn, ref[turn_key(turn)])
        return forced

    if args.sequential:
        for arm in arms:
            with ArmServer(arm, scratch / f"server_{arm}.log", pool_args) as server:
                stream_generate(server.url, tok.encode("Warm up."), 4)
                measure(arm, server)
                if arm == "kvcmas":
                    fidelity = fidelity_pass(server)
    else:
        # Side by side: every arm's server is up and its workload runs at the same time, so all
        # arms see the same (shared, noisy) machine load.
        with ExitStack() as stack:
            servers = {a: stack.enter_context(ArmServer(a, scratch / f"server_{a}.log",
                                                        pool_args))
                       for a in arms}
            for server in servers.values():
                stream_generate(server.url, tok.encode("Warm up."), 4)
            with ThreadPoolExecutor(len(arms)) as pool:
                list(pool.map(lambda a: measure(a, servers[a]), arms))
            for a in arms:
                if a != "kvcmas":
                    servers[a].stop()
            fidelity = fidelity_pass(servers["kvcmas"])

    non_owner = {turn_key(t) for t in results["kvcmas"][0]}
    non_owner -= owners_of(results["kvcmas"][0])
    summaries = [{**summarize(a, *results[a], non_owner, model.kv_bytes_per_token),
                  "kv_pool_tokens": pools.get(a)}
                 for a in arms]
    ref_turns = results["radix"][0]
    ref = {turn_key(t): t for t in ref_turns}
    for s, arm in zip(summaries, arms):
        s["greedy_agreement"], s["greedy_compared_turns"] = greedy_agreement(results[arm][0], ref)
        print_arm(s)
        print(f"{'Greedy output agreement vs radix:':<40}{s['greedy_agreement']:>12.3f}"
              f"  (n={s['greedy_compared_turns']} turns with identical prompts)")
    ideal = one_copy_ideal(results["kvcmas"][0], chat_markers(tok))
    ours = next(s for s in summaries if s["arm"] == "kvcmas")
    radix = summaries[0]
    deb = [w for w in range(args.debates)]
    answers = {arm: final_answers(results[arm][0], args.debates) for arm in ("radix", "kvcmas")}
    same = {w: same_answer(answers["kvcmas"][w], answers["radix"][w]) for w in deb}
    from sglang_kvcmas_examples.datasets import gsm8k

    truth = [item.final for item in gsm8k()[: args.debates]]
    correct = {arm: sum(same_number(a, t) for a, t in zip(answers[arm], truth))
               for arm in answers}
    tf_no = [f for f in fidelity if f["non_owner"]]
    tf_owner = [f for f in fidelity if not f["non_owner"]]
    fid = {
        "arm": "fidelity_kvcmas_vs_radix",
        "tf_top1_nonowner": sum(f["top1"] * f["n"] for f in tf_no) / max(1, sum(f["n"] for f in tf_no)),
        "tf_top1_owner": sum(f["top1"] * f["n"] for f in tf_owner) / max(1, sum(f["n"] for f in tf_owner)),
        "nonowner_turns": len(tf_no), "owner_turns": len(tf_owner),
        "answer_consistency": sum(same.values()) / max(1, len(same)),
        "inconsistent_debates": [
            {"wid": w, "kvcmas": answers["kvcmas"][w], "radix": answers["radix"][w],
             "first_divergence": divergences.get(w)}
            for w, ok in same.items() if not ok],
        "gsm8k_correct": correct, "debates": len(deb),
        "leader_kept": leader_runs(results["kvcmas"][0]),
        "one_copy_ideal_tokens": ideal,
        "kv_ratio_to_ideal": ours["peak_kv_tokens"] / max(1, ideal),
        "turns": fidelity,
    }
    if ours["nonowner_ttft_median_s"] is None:
        print("[head_to_head] warning: no kvcmas turn read another agent's KV (every borrowed "
              "span was below policy.recompute.MIN_BORROWED?): no non-owner TTFT to compare",
              file=sys.stderr)
        ttft_speedup = float("nan")
    else:
        ttft_speedup = radix["nonowner_ttft_median_s"] / ours["nonowner_ttft_median_s"]
    kv_ratio = radix["peak_kv_bytes"] / max(1, ours["peak_kv_bytes"])
    print(f"{'=' * 18} Fidelity (kvcmas vs radix) {'=' * 18}")
    print(f"teacher-forced top-1, non-owner turns: {fid['tf_top1_nonowner']:.4f} "
          f"(n={len(tf_no)}); owner turns: {fid['tf_top1_owner']:.4f} (n={len(tf_owner)})")
    print(f"debates with the same final answer: {fid['answer_consistency']:.3f}; GSM8K-correct "
          f"final answers: radix {correct['radix']}/{len(deb)}, kvcmas {correct['kvcmas']}/"
          f"{len(deb)}")
    kept, total = fid["leader_kept"]
    print(f"debate steps led by the previous step's leader: {kept} of {total}")
    for d in fid["inconsistent_debates"]:
        div = d["first_divergence"] or {}
        gap = div.get("exact_gap")
        print(f"  debate {d['wid']}: kvcmas {d['kvcmas']} vs radix {d['radix']}; first diverged "
              f"in step {div.get('step')} ({div.get('agent')}) at output token "
              f"{div.get('position')}, where the exact log-prob gap between the two tokens was "
              + ("n/a" if gap is None else f"{gap:.3f}"))
    print(f"peak KV: kvcmas/radix {1 / kv_ratio:.3f}; kvcmas / one-copy ideal "
          f"({ideal} tokens) {fid['kv_ratio_to_ideal']:.3f}")
    meta = {"commit": commit, "machine": machine, "model": model.name, "debates": args.debates, "chains": args.chains,
            "max_new_tokens": args.max_new_tokens, "concurrent_workflows": args.debates + args.chains,
            "arms_side_by_side": not args.sequential}
    headline = (f"HEADLINE ttft_speedup_vs_radix={ttft_speedup:.2f} kv_bytes_ratio_vs_radix="
                f"{kv_ratio:.2f} tf_top1={fid['tf_top1_nonowner']:.4f} "
                f"answer_consistency={fid['answer_consistency']:.2f}")
    about = (f"{args.debates} three-agent debates + {args.chains} reviewer chains "
             f"({args.max_new_tokens}-token answers, {model.name}), arms "
             f"{', '.join(arms)} {'one at a time' if args.sequential else 'side by side'}")
    record(args.out / f"{name}.jsonl",
           "".join(json.dumps({**meta, **s}) + "\n" for s in [*summaries, fid]),
           what=f"{about}: one record per arm and the fidelity record; `{headline}`")
    record(args.out / f"{name}.png", lambda p: plot(summaries, p),
           what=f"its plot: non-owner TTFT, peak KV and makespan per arm ({about})")
    print(f"[head_to_head] {machine}; {meta['concurrent_workflows']} concurrent workflows; "
          f"total {time.perf_counter() - t_start:.0f} s; results in {args.out / name}.*")
    if args.quick:
        print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
