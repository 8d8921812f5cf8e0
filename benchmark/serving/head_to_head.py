"""Serving head-to-head: our shared-context backend vs SGLang's radix cache vs no cache.

Same server binary (SGLang 0.5.23 + our launcher), three arms (``server_arms.ARMS``), the same
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

Output: a summary on stdout, ``head_to_head.jsonl`` (one record per arm + one fidelity record)
and a plot under ``--out`` (default ``benchmark/serving/results/head_to_head/``, with
``_<model>`` for a model other than the embedded one), and with ``--quick`` a final
``HEADLINE ...`` line. ``--model-path`` (``benchmark/model_arg.py``) serves one model in every
arm; every record names it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.model_arg import add_model_arg, chat_markers, model_from_args  # noqa: E402
from benchmark.serving.reuse_records import of_meta  # noqa: E402
from benchmark.serving.scheduler_profile import SchedulerProfile  # noqa: E402
from benchmark.serving.scheduler_profile import report as profile_report  # noqa: E402
from benchmark.serving.server_arms import ArmServer  # noqa: E402
from benchmark.serving.workflows import Workflow, debate, reviewer_chain  # noqa: E402

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # the embedded model's (BenchModel.kv_bytes_per_token)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "head_to_head"


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream_generate(url: str, ids: list[int], max_new: int, extra: dict | None = None) -> dict:
    """One streamed /generate; returns ttft, latency, output ids/text and meta_info. ``extra``:
    more request fields (e.g. ``lora_path``)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new}, **(extra or {})}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "text": last["text"],
            "output_ids": last.get("output_ids"), "meta": last["meta_info"]}


class KvSampler(threading.Thread):
    """Polls /metrics and keeps the peak of pool slots held (and the pool's size)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.peak, self._halt = url, 0, threading.Event()
        self.pool_tokens: int | None = None

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                    vals = {}
                    for line in r.read().decode().splitlines():
                        for name in ("sglang:kv_used_tokens", "sglang:kv_evictable_tokens"):
                            if line.startswith(name):
                                vals[name] = int(float(line.rsplit(" ", 1)[1]))
                        if line.startswith("sglang:max_total_num_tokens{"):
                            self.pool_tokens = int(float(line.rsplit(" ", 1)[1]))
                    if len(vals) == 2:  # slots held = in use by requests + cached (evictable)
                        self.peak = max(self.peak, sum(vals.values()))
            except OSError:
                pass
            self._halt.wait(0.5)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def build_workflows(n_debates: int, n_chains: int) -> list[Workflow]:
    from sglang_kvcmas_examples.datasets import gsm8k

    items = gsm8k()
    flows = [debate(i, items[i].question) for i in range(n_debates)]
    flows += [reviewer_chain(100 + i, items[50 + i].question) for i in range(n_chains)]
    return flows


def run_workload(url: str, flows: list[Workflow], tok, max_new: int) -> tuple[list[dict], float]:
    """Run every workflow concurrently; returns one record per agent turn and the makespan."""
    turns: list[dict] = []
    lock = threading.Lock()

    def one_flow(flow: Workflow) -> float:
        t0 = time.perf_counter()
        for step, agents in enumerate(flow.steps):
            prompts = {a: tok.apply_chat_template(flow.messages(step, a), add_generation_prompt=True,
                                                  tokenize=True) for a in agents}
            prompts = {a: list(p if isinstance(p, list) else p["input_ids"]) for a, p in prompts.items()}
            with ThreadPoolExecutor(len(agents)) as pool:
                outs = dict(zip(agents, pool.map(
                    lambda a: stream_generate(url, prompts[a], max_new), agents)))
            for a in agents:
                rec = {"kind": flow.kind, "wid": flow.wid, "step": step, "agent": a,
                       "prompt_ids": prompts[a], **outs[a]}
                with lock:
                    turns.append(rec)
            flow.record(step, {a: outs[a]["text"] for a in agents})
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(flows)) as pool:
        spans = list(pool.map(one_flow, flows))
    return turns, max(spans)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def owners_of(turns: list[dict]) -> set[tuple]:
    """(kind, wid, step, agent) of owner turns in the kvcmas arm: nothing borrowed."""
    return {turn_key(t) for t in turns if of_meta(t["meta"]).get("borrowed", 0) == 0}


def turn_key(t: dict) -> tuple:
    """(kind, wid, step, agent): one agent turn, the same in every arm."""
    return (t["kind"], t["wid"], t["step"], t["agent"])


def final_answers(turns: list[dict], n_debates: int) -> list[str | None]:
    """The final answer of debates ``0 .. n_debates - 1`` (``final_answer``)."""
    return [final_answer(turns, "debate", w) for w in range(n_debates)]


def final_answer(turns: list[dict], kind: str, wid: int) -> str | None:
    """The majority of the last step's answers (each reply's last number); a tie goes to the
    agent first by name, so the vote is the same in every process (a vote over a ``set`` broke
    ties by string hash order, which changes from one Python process to the next)."""
    from sglang_kvcmas_examples.datasets import last_number

    last = max(t["step"] for t in turns if t["wid"] == wid)
    answers = [last_number(t["text"]) for t in sorted(turns, key=lambda t: t["agent"])
               if t["wid"] == wid and t["step"] == last]
    answers = [a for a in answers if a is not None]
    return max(answers, key=answers.count) if answers else None  # first of the most common


def replay_steps(turns: list[dict], flow_of, one) -> list[dict]:
    """``one(turn)`` for every turn, as the workflows ran: each workflow's steps in order, the
    turns of a step together, workflows concurrently (``flow_of(turn)``: its workflow key)."""
    by_flow: dict[Any, list[dict]] = {}
    for t in turns:
        by_flow.setdefault(flow_of(t), []).append(t)
    out: list[dict] = []
    lock = threading.Lock()

    def flow(ts: list[dict]) -> None:
        for step in sorted({t["step"] for t in ts}):
            group = [t for t in ts if t["step"] == step]
            with ThreadPoolExecutor(len(group)) as pool:
                res = list(pool.map(one, group))
            with lock:
                out.extend(res)

    with ThreadPoolExecutor(len(by_flow)) as pool:
        list(pool.map(flow, by_flow.values()))
    return out


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


def same_number(a: str | None, b: str | None) -> bool:
    """Whether two extracted answers are the same number (``"18"`` == ``"18.0"``)."""
    try:
        return a is not None and b is not None and float(a) == float(b)
    except ValueError:
        return a == b


def same_answer(a: str | None, b: str | None) -> bool:
    """Whether two debates' final answers agree: the same number, or no number in both."""
    return (a is None and b is None) or same_number(a, b)


def greedy_agreement(turns: list[dict], ref: dict[tuple, dict]) -> tuple[float, int]:
    """Share of turns whose greedy output is the reference arm's, over the turns whose prompts
    are the reference's (``ref``: ``turn_key`` -> reference turn); and how many those are."""
    same_prompt = [(t, ref[k]) for t in turns
                   if (k := turn_key(t)) in ref and ref[k]["prompt_ids"] == t["prompt_ids"]]
    return (sum(t["text"] == r["text"] for t, r in same_prompt) / max(1, len(same_prompt)),
            len(same_prompt))


def first_divergent_turn(turns: list[dict], ref: dict[tuple, dict], wid: int) -> dict | None:
    """The earliest turn of debate ``wid`` whose text differs from the reference arm's."""
    return next((t for t in sorted(turns, key=lambda t: (t["step"], t["agent"]))
                 if t["wid"] == wid and t["kind"] == "debate"
                 and t["text"] != ref[turn_key(t)]["text"]), None)


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


def one_copy_ideal(turns: list[dict], chat=None) -> int:
    """Tokens if each shared transcript were held once, plus agent heads, plus the live suffix
    and output of the largest concurrent step of each workflow. ``chat``: the model's template
    markers (``model_arg.chat_markers``; default: the embedded model's ChatML ids)."""
    from sglang_kvcmas.tree.agent_split import detect_template_split
    from sglang_kvcmas.tree.template_markers import TemplateMarkers

    chat = chat or TemplateMarkers.chatml(1, 2, 198, system=(9690,), user=(4093,),
                                          assistant=(520, 9531))
    heads: dict[str, int] = {}
    shared: dict[tuple, int] = {}
    live: dict[tuple, int] = {}
    for t in turns:
        sp = detect_template_split(t["prompt_ids"], chat)
        heads[t["agent"]] = sp.head_len
        key = (t["kind"], t["wid"])
        shared[key] = max(shared.get(key, 0), sp.shared_len)
        step_live = sum(len(u["prompt_ids"]) - sp.shared_end + u["meta"]["completion_tokens"]
                        for u in turns if (u["kind"], u["wid"], u["step"]) == (*key, t["step"]))
        live[key] = max(live.get(key, 0), step_live)
    return sum(heads.values()) + sum(shared.values()) + sum(live.values())


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
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="results folder (default: results/head_to_head[_<model>])")
    add_model_arg(ap)
    ap.add_argument("--profile", action="store_true",
                    help="sample each arm's scheduler with py-spy during its workload and write "
                         "profile_<arm>.txt (where the time goes)")
    ap.add_argument("--sequential", action="store_true",
                    help="one arm at a time (default: all arms side by side, same machine load)")
    args = ap.parse_args()
    if args.quick:
        args.debates, args.chains, args.max_new_tokens = 4, 2, 64
    model = model_from_args(ap, args)
    args.out = model.out_or_named(args.out, DEFAULT_OUT)
    pool_args = model.server_args + ([] if args.max_total_tokens is None
                                     else ["--max-total-tokens", str(args.max_total_tokens)])
    args.out.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"
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
        raw_path = args.out / f"head_to_head_profile_{arm}.raw"
        spy = SchedulerProfile(server.proc.pid, raw_path).start() if args.profile else None
        turns, makespan = run_workload(server.url, flows, tok, args.max_new_tokens)
        results[arm] = (turns, makespan, sampler.stop())
        if spy is not None and (raw := spy.stop()) is not None:
            (args.out / f"head_to_head_profile_{arm}.txt").write_text(profile_report(raw))
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
            with ArmServer(arm, args.out / f"server_{arm}.log", pool_args) as server:
                stream_generate(server.url, tok.encode("Warm up."), 4)
                measure(arm, server)
                if arm == "kvcmas":
                    fidelity = fidelity_pass(server)
    else:
        # Side by side: every arm's server is up and its workload runs at the same time, so all
        # arms see the same (shared, noisy) machine load.
        with ExitStack() as stack:
            servers = {a: stack.enter_context(ArmServer(a, args.out / f"server_{a}.log",
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
    with open(args.out / "head_to_head.jsonl", "a") as f:
        for s in summaries:
            f.write(json.dumps({**meta, **s}) + "\n")
        f.write(json.dumps({**meta, **fid}) + "\n")
    plot(summaries, args.out / "head_to_head.png")
    print(f"[head_to_head] {machine}; {meta['concurrent_workflows']} concurrent workflows; "
          f"total {time.perf_counter() - t_start:.0f} s; results in {args.out}")
    if args.quick:
        print(f"HEADLINE ttft_speedup_vs_radix={ttft_speedup:.2f} kv_bytes_ratio_vs_radix="
              f"{kv_ratio:.2f} tf_top1={fid['tf_top1_nonowner']:.4f} "
              f"answer_consistency={fid['answer_consistency']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
