"""Accuracy of multi-agent workflows with ground truth: no sharing, radix and sglang-kvcmas.

    .venv/bin/python benchmark/quality/accuracy.py --quick                      # embedded model
    .venv/bin/python benchmark/quality/accuracy.py --model-path qwen2.5-coder-0.5b --items 164

Two tasks (``tasks.py``): a program-aided GSM8K debate (3 agents, 2 rounds, each agent's program
run in the sandbox, final answer by vote) and a HumanEval coder → reviewer → fixer chain (pass@1
by running the problem's tests in the sandbox). Each arm is one server on the same model, booted
alone (one server at a time, same pool), answering the same items with greedy decoding:

    no_cache   SGLang with the radix cache off: every prompt computed whole (the no-sharing
               reference accuracy of the model)
    radix      SGLang's radix cache (exact prefix reuse; what a user runs today)
    kvcmas     sglang-kvcmas with sharing on, default configuration

``--quick`` runs the first 16 items of each task, all in flight at once, on ``radix`` and
``kvcmas`` (``QUICK_ARMS``; ``--arms`` adds ``no_cache``); every arm's server gets two CPU
threads (``--cpu-threads``: one server runs at a time, so it has the machine).

Resumable: every finished item is appended to ``results/accuracy[_quick]_<arm>[_<model>].jsonl``
(committed with the summary, so a full run can accumulate over several sittings; ``--items``
raises the count); a rerun skips items already there. Progress goes to stderr (items done,
running accuracy per arm). The summary goes to ``accuracy[_quick][_<model>].{txt,json,png}``, the
servers' logs to ``results/logs_accuracy[_quick][_<model>]/`` (not committed). ``<model>`` is the
model's name in file names (``model_arg``: ``qwen2-5-coder-0-5b``), none for the embedded one.

The summary pairs the arms per item over the items every arm has done: accuracy per arm and task,
ours − radix in accuracy points with a paired-bootstrap 95% interval and McNemar's exact p, the
same-final-answer rate (GSM8K: the same voted number; HumanEval: the same pass/fail and the same
final code), the judge consistency rate (``jcr``: the deciding agents' decisions — GSM8K's
ballots and vote, HumanEval's fixer keeping or changing the code and its pass / fail — that
match radix's, with an item bootstrap interval), where the first divergent turn lies, and
non-owner TTFT (turns where our server read
another agent's KV) against the same turns under radix. It ends with::

    HEADLINE model=<name> n=<items per task> acc_radix=<x> acc_ours=<x> gsm8k_delta=<x>
             humaneval_delta=<x> ci_low=<x> same_answer=<x> jcr=<x> ttft_speedup_vs_radix=<x>

(accuracies in [0, 1] averaged over the tasks; deltas and ci_low in points, ours − radix; ci_low
the worse task's lower bound.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_kvcmas_bench import accuracy_tasks as tasks
from sglang_kvcmas_bench.model_arg import BenchModel, ModelPathError
from sglang_kvcmas_bench.paired_stats import agreement, paired_diff
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.sandbox import isolation
from sglang_kvcmas_bench.server_arms import ArmServer
from sglang_kvcmas_bench.server_calls import stream_generate
from sglang_kvcmas_bench.workflows import chat_prompt_ids

ARMS = ("no_cache", "radix", "kvcmas")
QUICK_ARMS = ("radix", "kvcmas")
"""The pair the headline compares. Greedy decoding makes stock SGLang's answers the same with
and without its radix cache (every turn's text, 32 of 32 quick items on Qwen2.5-Coder-0.5B), so
the quick mode leaves ``no_cache`` to full runs and fits its time budget."""
TASKS = ("gsm8k", "humaneval")
QUICK_ITEMS = 16
RESULTS = Path(__file__).resolve().parent / "results"


def say(text: str) -> None:
    print(f"[accuracy] {text}", file=sys.stderr, flush=True)


# ----- items --------------------------------------------------------------------------------

def build_flow(task: str, item: int) -> tasks.Flow:
    from sglang_kvcmas_examples.datasets import gsm8k, humaneval

    if task == "gsm8k":
        return tasks.gsm8k_flow(item, gsm8k()[item].question)
    return tasks.humaneval_flow(item, humaneval()[item]["prompt"])


def grade(flow: tasks.Flow) -> tuple[bool, str | None]:
    """Whether the workflow's final answer is right, and that answer (GSM8K: the voted number;
    HumanEval: the fixer's code)."""
    from sglang_kvcmas_examples.datasets import gsm8k, humaneval

    if flow.task == "gsm8k":
        final = tasks.gsm8k_vote(flow)
        return tasks.same_number(final, gsm8k()[flow.item].final), final
    reply = flow.outputs[-1][flow.steps[-1][0]]
    return tasks.humaneval_passes(humaneval()[flow.item], reply), tasks.code_block(reply)


def run_item(url: str, tok, task: str, item: int, max_new: int) -> dict:
    """Run one item's workflow on one server; the record appended to the arm's file."""
    flow = build_flow(task, item)
    turns = []
    t0 = time.perf_counter()
    for step, agents in enumerate(flow.steps):
        prompts = {a: chat_prompt_ids(tok, flow.messages(step, a)) for a in agents}
        with ThreadPoolExecutor(len(agents)) as pool:
            outs = dict(zip(agents, pool.map(
                lambda a: stream_generate(url, prompts[a], max_new), agents)))
        flow.record(step, {a: o["text"] for a, o in outs.items()})
        for a, o in outs.items():
            reuse = of_meta(o["meta"])
            turns.append({"step": step, "agent": a, "text": o["text"], "ttft": o["ttft"],
                          "latency": o["latency"], "prompt_tokens": len(prompts[a]),
                          "completion_tokens": o["meta"].get("completion_tokens"),
                          "cached_tokens": o["meta"].get("cached_tokens", 0),
                          "borrowed": reuse.get("borrowed", 0),
                          "printed": flow.executions[step].get(a)})
    correct, final = grade(flow)
    return {"key": flow.key, "task": task, "item": item, "correct": correct, "final": final,
            "seconds": time.perf_counter() - t0, "turns": turns}


def load(path: Path) -> dict[str, dict]:
    """An arm's finished items by key (a torn last line from an interrupted run is skipped)."""
    done: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            done[rec["key"]] = rec
    return done


def records_path(args, arm: str) -> Path:
    return args.model.named(args.out / f"{args.stem}_{arm}.jsonl")


def run_arm(arm: str, args, tok, wanted: list[tuple[str, int]]) -> None:
    path = records_path(args, arm)
    done = load(path)
    todo = [(t, i) for t, i in wanted if f"{t}/{i}" not in done]
    if not todo:
        say(f"{arm}: all {len(wanted)} items already done")
        return
    say(f"{arm}: {len(todo)} items to run ({len(wanted) - len(todo)} done before)")
    extra = ["--model-path", args.model_path] if args.model_path else []
    if args.max_total_tokens:
        extra += ["--max-total-tokens", str(args.max_total_tokens)]
    lock = threading.Lock()
    t0 = time.perf_counter()
    threads = {"OMP_NUM_THREADS": str(args.cpu_threads)}
    with ArmServer(arm, args.logs / f"server_{arm}.log", extra, env=threads) as server:
        stream_generate(server.url, tok.encode("Warm up."), 4)

        failed: list[str] = []

        def one(ti: tuple[str, int]) -> None:
            try:
                rec = run_item(server.url, tok, *ti, args.max_new_tokens)
            except Exception as e:  # noqa: BLE001 - one item's failure must not end the arm
                failed.append(f"{ti[0]}/{ti[1]}")
                say(f"{arm}: {ti[0]}/{ti[1]} failed ({type(e).__name__}: {e}); not recorded, "
                    f"a rerun retries it")
                return
            with lock:
                done[rec["key"]] = rec
                record(path, json.dumps(rec) + "\n", append=True,
                       what=f"the {arm.replace('_', '-')} arm's per-item records "
                            f"({len(done)} items; appended as items finish, a rerun skips "
                            f"those already there)")
                mine = [r for r in done.values() if (r["task"], r["item"]) in set(wanted)]
                acc = {t: [r["correct"] for r in mine if r["task"] == t] for t in args.tasks}
                running = "  ".join(f"{t} {sum(v)}/{len(v)}" for t, v in acc.items() if v)
                say(f"{arm}: {len(mine)}/{len(wanted)} items, correct {running} "
                    f"({time.perf_counter() - t0:.0f} s)")

        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, todo))
    if failed:
        say(f"{arm}: {len(failed)} items failed: {', '.join(sorted(failed))}")


# ----- summary --------------------------------------------------------------------------------

def first_divergence(a: dict, b: dict) -> int | None:
    """The index of the first turn whose text differs between two records of one item."""
    for i, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
        if ta["text"] != tb["text"]:
            return i
    return None


def same_final(task: str, a: dict, b: dict) -> bool:
    if task == "gsm8k":
        return tasks.same_number(a["final"], b["final"]) or (a["final"] is b["final"] is None)
    return a["correct"] == b["correct"] and a["final"] == b["final"]


def decisions(task: str, rec: dict) -> list[str]:
    """What an item's deciding agents decided. GSM8K: each debater's last-round printed number
    (the ballots) and the vote; HumanEval: whether the fixer kept the coder's code or changed
    it after the review, and whether the final code passes. (The reviewer's own output is a
    free-text list of bugs with no verdict to compare.)"""
    if task == "gsm8k":
        last = max(t["step"] for t in rec["turns"])
        ballots = [str(t.get("printed")) for t in rec["turns"] if t["step"] == last]
        return [*ballots, str(rec["final"])]
    by_agent = {t["agent"]: t["text"] for t in rec["turns"]}
    kept = tasks.code_block(by_agent.get("Fixer", "")).split() == tasks.code_block(
        by_agent.get("Coder", "")).split()
    return [f"kept={kept}", f"passed={rec['correct']}"]


def judge_consistency(task: str, ours: dict, radix: dict, keys: list[str]) -> dict:
    """The share of the deciding agents' decisions (:func:`decisions`) that match radix's
    (exact serving) on the same items, with an item bootstrap 95% interval."""
    per_item = []
    for k in keys:
        a, b = decisions(task, ours[k]), decisions(task, radix[k])
        per_item.append((sum(x == y for x, y in zip(a, b)), max(len(a), len(b))))
    got = agreement(per_item)
    return {"jcr": got.rate, "jcr_ci_low": got.ci_low, "jcr_ci_high": got.ci_high,
            "decisions": got.decisions}


def summarize(args, wanted: list[tuple[str, int]]) -> dict:
    recs = {arm: load(records_path(args, arm)) for arm in args.arms}
    keys = [f"{t}/{i}" for t, i in wanted if all(f"{t}/{i}" in recs[a] for a in args.arms)]
    out: dict = {"model": args.model_name, "arms": list(args.arms), "isolation": isolation(),
                 "tasks": {}}
    ttft_ours, ttft_radix = [], []
    for task in args.tasks:
        tk = [k for k in keys if k.startswith(task + "/")]
        row: dict = {"n": len(tk)}
        for arm in args.arms:
            row[f"acc_{arm}"] = (sum(recs[arm][k]["correct"] for k in tk) / len(tk)) if tk else None
        if "radix" in recs and "kvcmas" in recs and tk:
            radix, ours = recs["radix"], recs["kvcmas"]
            d = paired_diff([int(radix[k]["correct"]) for k in tk],
                            [int(ours[k]["correct"]) for k in tk])
            row.update(delta=d.delta, ci_low=d.ci_low, ci_high=d.ci_high, only_radix=d.only_a,
                       only_ours=d.only_b, mcnemar_p=d.mcnemar_p)
            row["same_answer"] = sum(same_final(task, ours[k], radix[k]) for k in tk) / len(tk)
            row.update(judge_consistency(task, ours, radix, tk))
            firsts = [first_divergence(ours[k], radix[k]) for k in tk]
            row["identical_items"] = sum(f is None for f in firsts)
            row["first_divergent_turn"] = {str(i): firsts.count(i)
                                           for i in sorted({f for f in firsts if f is not None})}
            for k in tk:
                for to, tr in zip(ours[k]["turns"], radix[k]["turns"]):
                    if to["borrowed"] > 0 and to["ttft"] and tr["ttft"]:
                        ttft_ours.append(to["ttft"])
                        ttft_radix.append(tr["ttft"])
        if "no_cache" in recs and "radix" in recs and tk:
            d = paired_diff([int(recs["no_cache"][k]["correct"]) for k in tk],
                            [int(recs["radix"][k]["correct"]) for k in tk])
            row["radix_minus_no_cache"] = d.delta
        out["tasks"][task] = row
    out["nonowner_turns"] = len(ttft_ours)
    out["ttft_speedup_vs_radix"] = (statistics.median(ttft_radix) / statistics.median(ttft_ours)
                                    if ttft_ours else None)
    return out


def headline(s: dict) -> str:
    rows = [r for r in s["tasks"].values() if r["n"]]

    def mean(field: str) -> float | None:
        vals = [r[field] for r in rows if r.get(field) is not None]
        return sum(vals) / len(vals) if vals else None

    def fmt(x: float | None, nd: int = 3) -> str:
        return "nan" if x is None else f"{x:.{nd}f}"

    n = min((r["n"] for r in rows), default=0)
    deltas = {t: r.get("delta") for t, r in s["tasks"].items()}
    lows = [r["ci_low"] for r in rows if r.get("ci_low") is not None]
    decided = sum(r.get("decisions", 0) for r in rows)
    jcr = (sum(r["jcr"] * r["decisions"] for r in rows if r.get("decisions")) / decided
           if decided else None)
    return (f"HEADLINE model={s['model']} n={n} acc_radix={fmt(mean('acc_radix'))} "
            f"acc_ours={fmt(mean('acc_kvcmas'))} gsm8k_delta={fmt(deltas.get('gsm8k'), 1)} "
            f"humaneval_delta={fmt(deltas.get('humaneval'), 1)} "
            f"ci_low={fmt(min(lows) if lows else None, 1)} "
            f"same_answer={fmt(mean('same_answer'))} jcr={fmt(jcr)} "
            f"ttft_speedup_vs_radix={fmt(s['ttft_speedup_vs_radix'], 2)}")


def print_summary(s: dict) -> None:
    print(f"model {s['model']}; sandbox isolation: {s['isolation']}; arms one at a time")
    for task, r in s["tasks"].items():
        accs = "  ".join(f"{a} {r[f'acc_{a}']:.3f}" for a in s["arms"]
                         if r.get(f"acc_{a}") is not None)
        print(f"{task:<10} n={r['n']:<4} accuracy: {accs}")
        if "delta" in r:
            print(f"{'':<10} ours − radix {r['delta']:+.1f} points "
                  f"[{r['ci_low']:+.1f}, {r['ci_high']:+.1f}] (paired bootstrap 95%), "
                  f"McNemar p={r['mcnemar_p']:.3f} ({r['only_ours']} only ours, "
                  f"{r['only_radix']} only radix); same final answer {r['same_answer']:.3f}; "
                  f"identical items {r['identical_items']}; first divergent turn "
                  f"{r['first_divergent_turn']}; deciding agents' decisions as radix's "
                  f"{r['jcr']:.3f} [{r['jcr_ci_low']:.3f}, {r['jcr_ci_high']:.3f}] over "
                  f"{r['decisions']}")
    if s["ttft_speedup_vs_radix"] is not None:
        print(f"non-owner TTFT: radix / ours = {s['ttft_speedup_vs_radix']:.2f}x "
              f"over {s['nonowner_turns']} turns")


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    width = 0.8 / len(s["arms"])
    for j, arm in enumerate(s["arms"]):
        xs = [i + j * width for i in range(len(s["tasks"]))]
        ax.bar(xs, [r.get(f"acc_{arm}") or 0 for r in s["tasks"].values()], width, label=arm)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(s["tasks"]))])
    ax.set_xticklabels([f"{t} (n={r['n']})" for t, r in s["tasks"].items()])
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"accuracy per arm, {s['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None,
                    help="anything the launcher accepts (default: the embedded model)")
    ap.add_argument("--quick", action="store_true",
                    help=f"the first {QUICK_ITEMS} items of each task, all in flight at once, "
                    f"arms {','.join(QUICK_ARMS)} unless --arms says otherwise")
    ap.add_argument("--items", type=int, default=164, help="items per task (the first N)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--arms", default=None, help=f"default: {','.join(ARMS)}")
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="items in flight per arm (default 32; --quick: every item)")
    ap.add_argument("--cpu-threads", type=int, default=2,
                    help="CPU threads of each arm's server (arms run one at a time)")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="every arm's KV pool")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--summary-only", action="store_true", help="run nothing; summarize")
    args = ap.parse_args(argv)
    args.tasks = tuple(args.tasks.split(","))
    args.arms = tuple((args.arms or ",".join(QUICK_ARMS if args.quick else ARMS)).split(","))
    for t in args.tasks:
        if t not in TASKS:
            ap.error(f"unknown task {t!r} (known: {', '.join(TASKS)})")
    for a in args.arms:
        if a not in ARMS:
            ap.error(f"unknown arm {a!r} (known: {', '.join(ARMS)})")
    if args.quick:
        args.items = QUICK_ITEMS
    if args.concurrency is None:
        args.concurrency = args.items * len(args.tasks) if args.quick else 32

    from transformers import AutoTokenizer

    try:
        args.model = BenchModel.resolve(args.model_path)
    except ModelPathError as e:
        try:  # a summary of recorded runs needs only the model's name
            args.model = BenchModel.by_name(args.model_path or "") if args.summary_only \
                else None
        except ModelPathError:
            args.model = None
        if args.model is None:
            ap.error(f"--model-path: {e}")
    folder, args.model_name = args.model.folder, args.model.name
    args.stem = "accuracy" + ("_quick" if args.quick else "")
    args.prefix = args.model.named(Path(args.stem)).name  # accuracy[_quick][_<model>]
    args.logs = args.out / f"logs_{args.prefix}"
    args.logs.mkdir(parents=True, exist_ok=True)
    tok = None if args.summary_only else AutoTokenizer.from_pretrained(str(folder))
    wanted = [(t, i) for t in args.tasks for i in range(args.items)]
    say(f"model {args.model_name}, {args.items} items per task, arms {', '.join(args.arms)}, "
        f"sandbox isolation {isolation()}, results in {args.out}")
    if not args.summary_only:
        for arm in args.arms:  # one server at a time
            run_arm(arm, args, tok, wanted)
    s = summarize(args, wanted)
    s["command"] = " ".join(["python", *sys.argv])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print(f"# {s['command']}")
        print_summary(s)
        print(headline(s))
    about = (f"{args.model_name}, {args.items} items per task ({', '.join(args.tasks)}), arms "
             f"{', '.join(args.arms)}")
    record(args.model.named(args.out / f"{args.stem}.txt"), buf.getvalue(),
           what=f"{about}: accuracy per arm and task, the paired difference with its 95% "
                f"interval, same final answer, non-owner TTFT: `{headline(s)}`")
    record(args.model.named(args.out / f"{args.stem}.json"), json.dumps(s, indent=1) + "\n",
           what=f"its summary, machine-readable ({about})")
    record(args.model.named(args.out / f"{args.stem}.png"), lambda p: plot(s, p),
           what=f"its plot: accuracy per arm and task ({about})")
    print(buf.getvalue(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
