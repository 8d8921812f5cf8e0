"""The workload matrix: whole multi-agent workflows, our sharing server against radix, end to end.

Every arm is one server of the same binary, run one at a time (they never compete for cores),
each serving the same workloads through SGLang's OpenAI chat route, streamed, the way a client
library would: answers go back as assistant messages, the agents of a round answer concurrently
and the workflows run concurrently. ``--history shared`` (default): one message list per
workflow, as in LangGraph's shared state, each agent sending its own system prompt before it;
``--history own``: each agent its own history, as in AutoGen (the others' answers in a user
message), where agents' transcripts part after the opening message.

Workloads (``--workloads``; each with ``--flows`` concurrent workflows and ``--answer`` tokens):

- ``panel``: prefill-heavy. ``--agents`` reviewers, each with its own system prompt, review one
  source file of ``--doc-tokens`` tokens (Python's own standard library, one file per workflow);
  round 2 reads every review and gives a ship / fix verdict. Every workflow has its own
  reviewers.
- ``recurring``: the panel with the same reviewers in every workflow (agents that recur across
  concurrent workflows).
- ``debate``: decode-heavy. Three agents answer a GSM8K question over three rounds, each round
  reading the others' previous answers.
- ``chain``: planner -> solver -> critic, three rounds, each step reading the transcript so far.

Arms (``--arms``): ``radix`` (SGLang's radix cache on its own attention backend), ``kvcmas``
(sharing, the defaults), ``kvcmas_exact`` (sharing, ``--kvcmas-leaf-mode exact``) and
``radix_delta`` (SGLang's radix cache on our attention backend: which part of a gain is the
kernel). Per arm and workload: makespan, output tokens/s, median TTFT by round and of non-owner
turns (turns that borrowed in the ``kvcmas`` arm, compared on the same turns), decode tokens/s
of turns that borrowed nothing (``plain``) and of those that did (``reader``), peak KV (pool
slots held, sampled from ``/metrics``, and the tree cache's own peak mark) in MiB including host
memory leaf bytes, and same answer as radix (turn text, and final answers).

    python benchmark/serving/matrix.py --quick      # panel and debate, every arm, one run
    python benchmark/serving/matrix.py --workloads panel,recurring,debate,chain \
        --answer 64 --flows 8 --runs 3

Writes ``results/matrix[_quick][_<model>].json`` and its index row (server logs under
``results/matrix[_quick]/``) and prints one table and a ``HEADLINE`` line
(ratios radix / ours for time, ours / radix for KV, medians over ``--runs``, with each ratio's
spread over the runs). ``--append`` adds its runs to those already in the file (each run keeps
its commit and its arms' order), so three runs can be made in separate sittings. The arms run
in the order given in a file's first, third, ... runs and reversed in the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from sglang_kvcmas_bench.chat_workloads import (
    HISTORIES,
    Turn,
    Workload,
    answer_of,
    build,
    chat,
    run_flow,
)
from sglang_kvcmas_bench.figures import fmt
from sglang_kvcmas_bench.kv_sampler import KvSampler
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import ArmServer, run_header, shared_tree_stats
from sglang_kvcmas_bench.server_calls import flush

RESULTS = Path(__file__).resolve().parent / "results"
ARMS: dict[str, tuple[str, list[str]]] = {
    "radix": ("radix", []),
    "kvcmas": ("kvcmas", []),
    "kvcmas_exact": ("kvcmas", ["--kvcmas-leaf-mode", "exact"]),
    "radix_delta": ("radix", ["--attention-backend", "kvcmas_delta"]),
}
"""Arm -> (server arm of ``server_arms.ARMS``, flags added)."""
def say(text: str) -> None:
    print(f"[matrix] {text}", file=sys.stderr, flush=True)


def leaf_marks(url: str) -> tuple[int, int]:
    """The shared tree's host-memory leaf bytes (factored leaves now, plus the peak of their
    deviations materialized for running readers) and its peak of pool slots held, from
    ``/server_info`` (both 0 for a stock server). The tree's marks are the server's own peaks,
    so a workload after another on one server reports the larger of the two."""
    stats = shared_tree_stats(url)
    leaf = sum(sum(v.values()) for v in (stats.get("leaf_bytes_by_agent") or {}).values())
    exact = int(stats.get("exact_leaf_bytes") or 0)  # pool slots: counted as held tokens
    materialized = int((stats.get("materialized_leaf_bytes") or {}).get("peak") or 0)
    return leaf - exact + materialized, int(stats.get("peak_held_tokens") or 0)


def run_arm(arm: str, model, workloads: list[Workload], pool: int, logs: Path) -> dict:
    """One server (its log under ``logs``); each workload's flows at once, the workloads one
    after another."""
    server_arm, flags = ARMS[arm]
    result: dict = {}
    with ArmServer(server_arm, logs / f"{arm}.log",
                   [*model.server_args, "--max-total-tokens", str(pool), *flags]) as server:
        name = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=60).read())
        served = name["data"][0]["id"]
        chat(server.url, served, [{"role": "user", "content": "Warm up."}], 2, "warmup")
        for w in workloads:
            flush(server.url)  # each workload from an empty cache: its own peak KV
            # SGLang refreshes its KV gauges only when a batch runs: one tiny request, so the
            # sampler's first reads are not the previous workload's
            chat(server.url, served, [{"role": "user", "content": "Warm up."}], 2, "warmup")
            kv = KvSampler(server.url)
            kv.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(w.flows) as pool_:
                flows = list(pool_.map(lambda f, w=w: run_flow(server.url, served, w, f, arm),
                                       range(w.flows)))
            makespan = time.perf_counter() - t0
            held = kv.stop()
            leaf_bytes, marked = leaf_marks(server.url)
            turns = [t for flow in flows for t in flow]
            kv_tokens = max(held, marked)
            result[w.name] = {
                "makespan_s": makespan, "turns": [asdict(t) for t in turns],
                "output_tps": sum(t.completion_tokens for t in turns) / makespan,
                "peak_kv_tokens": kv_tokens, "peak_leaf_bytes": leaf_bytes,
                "peak_kv_mib": (kv_tokens * model.kv_bytes_per_token + leaf_bytes) / 2**20,
                "pool_saturated": kv.pool_tokens is not None and held >= 0.98 * kv.pool_tokens,
                "tree_at_end": shared_tree_stats(server.url),
            }
            say(f"{arm} {w.name}: makespan {makespan:.1f} s, "
                f"{result[w.name]['output_tps']:.1f} tok/s, peak KV "
                f"{result[w.name]['peak_kv_mib']:.1f} MiB")
            for flow in w.agents:  # the next arm starts from the opening messages again
                for agent in flow:
                    del agent.messages[2:]
    return result


# ----- the report -----


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def compare(arms: dict[str, dict], workload: str, ours: str = "kvcmas") -> dict:
    """Ratios of ``ours`` against radix on one workload (time: radix / ours; KV: ours / radix),
    TTFT by round, and same answers.

    Decode: ``plain_decode_ratio`` is the median over turns that borrowed nothing of their
    decode tokens/s over the same turn's under radix; ``reader_decode_ratio`` the same over
    turns that borrowed, whose radix counterpart is a plain row reading the same number of
    tokens (a turn's decode speed depends on the batches it shares, so both compare turns
    of the same workload position). ``same_answer``: last-round turns whose decision
    (:func:`answer_of`) is radix's; ``same_turns``: turns with radix's exact text."""
    radix, mine = arms["radix"][workload], arms[ours][workload]
    key = lambda t: (t["flow"], t["round"], t["agent"])
    rt = {key(t): t for t in radix["turns"]}
    readers = [t for t in mine["turns"] if t["borrowed"]]
    plain = [t for t in mine["turns"] if not t["borrowed"]]
    tps = lambda t: Turn(**t).decode_tps

    def decode_ratio(turns: list[dict]) -> float | None:
        pairs = [(tps(t), tps(rt[key(t)])) for t in turns]
        return _median([a / b for a, b in pairs if a and b])

    rounds = sorted({t["round"] for t in mine["turns"]})
    finals = [t for t in mine["turns"] if t["round"] == max(rounds)]
    nonowner_ours = _median([t["ttft_s"] for t in readers])
    nonowner_radix = _median([rt[key(t)]["ttft_s"] for t in readers])
    return {
        "makespan_ratio": radix["makespan_s"] / mine["makespan_s"],
        "output_tps_ratio": mine["output_tps"] / radix["output_tps"],
        "kv_ratio": mine["peak_kv_mib"] / radix["peak_kv_mib"],
        # radix filled its pool (and evicted): its peak is the pool, not what it needed
        "radix_pool_saturated": bool(radix.get("pool_saturated")),
        "ttft_ratio_nonowner": (nonowner_radix / nonowner_ours
                                if nonowner_ours and nonowner_radix else None),
        "ttft_by_round": {r: [_median([t["ttft_s"] for t in radix["turns"] if t["round"] == r]),
                              _median([t["ttft_s"] for t in mine["turns"] if t["round"] == r])]
                          for r in rounds},
        "plain_decode_ratio": decode_ratio(plain),
        "reader_decode_ratio": decode_ratio(readers),
        "same_turns": sum(t["text"] == rt[key(t)]["text"] for t in mine["turns"]),
        "turns": len(mine["turns"]),
        "same_answer": sum(answer_of(workload, t["text"])
                           == answer_of(workload, rt[key(t)]["text"]) for t in finals),
        "finals": len(finals),
        "readers": len(readers),
    }


def headline(runs: list[dict], names: list[str]) -> dict[str, list[float | None]]:
    """Each ``HEADLINE`` ratio of ``kvcmas`` against radix, one value per run (in run order):
    decode and TTFT the median over the workloads, makespan the worst workload's, KV the
    largest workload's."""
    def one(run: dict) -> dict[str, float | None]:
        c = run["compare"]["kvcmas"]
        of = lambda k: [c[w][k] for w in names]
        return {
            "plain_decode_ratio": _median(of("plain_decode_ratio")),
            "reader_decode_ratio": _median(of("reader_decode_ratio")),
            "min_makespan_ratio": min(of("makespan_ratio")),
            "panel_makespan_ratio": c["panel"]["makespan_ratio"] if "panel" in names else None,
            "debate_makespan_ratio": c["debate"]["makespan_ratio"] if "debate" in names else None,
            "ttft_ratio": _median(of("ttft_ratio_nonowner")),
            "kv_ratio": max((x for x in of("kv_ratio") if x is not None), default=None),
        }
    per_run = [one(r) for r in runs]
    return {k: [h[k] for h in per_run] for k in per_run[0]}


def spread(xs: list[float | None]) -> str:
    """``min–max`` of a ratio's runs (empty for one run)."""
    xs = [x for x in xs if x is not None]
    return f"{fmt(min(xs), 2)}–{fmt(max(xs), 2)}" if len(xs) > 1 else ""


def report(runs: list[dict], arms: list[str], names: list[str]) -> None:
    """Print the table (medians over ``runs``; answers of the last run) and the ``HEADLINE``:
    each ratio the median of its per-run values (:func:`headline`), then their spreads."""
    med = lambda arm, w, k: _median([r["compare"][arm][w][k] for r in runs])
    print(f"{'arm':<13} {'workload':<10} {'makespan':>9} {'out tok/s':>9} {'TTFT':>6} "
          f"{'KV':>6} {'plain dec':>9} {'rd dec':>8} {'same text':>9} {'answer':>7}")
    for arm in arms:
        if arm == "radix":
            continue
        for w in names:
            c = runs[-1]["compare"][arm][w]
            print(f"{arm:<13} {w:<10} {fmt(med(arm, w, 'makespan_ratio'), 2):>8}x "
                  f"{fmt(med(arm, w, 'output_tps_ratio'), 2):>8}x "
                  f"{fmt(med(arm, w, 'ttft_ratio_nonowner'), 2):>5}x "
                  f"{fmt(med(arm, w, 'kv_ratio'), 2):>5}{'*' if c['radix_pool_saturated'] else 'x'} "
                  f"{fmt(med(arm, w, 'plain_decode_ratio'), 2):>8}x "
                  f"{fmt(med(arm, w, 'reader_decode_ratio'), 2):>7}x "
                  f"{c['same_turns']:>4}/{c['turns']:<4} {c['same_answer']:>3}/{c['finals']:<3}")
    if any(runs[-1]["compare"][a][w].get("radix_pool_saturated") for a in arms
           if a != "radix" for w in names):
        print("*: radix filled its pool (--pool) and evicted: its peak KV is the pool's size, "
              "less than it needed; rerun with a larger --pool for a KV ratio")
    if "kvcmas" in arms:
        head = headline(runs, names)
        if len(runs) > 1:
            commits = ", ".join(r.get("commit", "?") for r in runs)
            first = ", ".join((r.get("order") or list(r["arms"]))[0] for r in runs)
            print(f"{len(runs)} runs (commits {commits}; first arm {first}); "
                  "spread (min–max) of each ratio: "
                  + " ".join(f"{k}={spread(v)}" for k, v in head.items() if spread(v)))
        print("HEADLINE " + " ".join(f"{k}={fmt(_median(v), 2)}" for k, v in head.items()))


def arm_order(arms: list[str], done: int) -> list[str]:
    """The order the arms of a result file's next run go in, ``done`` runs being in it already:
    as given, reversed when ``done`` is odd, so a machine whose speed drifts through a sitting
    (this one's does) favours no arm in the median."""
    return list(arms) if done % 2 == 0 else list(arms)[::-1]


def earlier_runs(path: Path, arms: list[str], names: list[str]) -> list[dict]:
    """``--append``: the runs already in ``path`` (none if it does not exist), each tagged with
    its commit and its arms' order (a run written before runs carried them: the file's commit,
    the arms as listed).

    Raises:
        SystemExit: the file's runs have other arms or workloads than this invocation's.
    """
    if not path.exists():
        return []
    result = json.loads(path.read_text())
    runs = result.get("runs") or []
    for run in runs:
        got_arms, got_names = list(run["arms"]), list(run["arms"]["radix"])
        if sorted(got_arms) != sorted(arms) or got_names != names:
            raise SystemExit(
                f"--append: {path} holds arms {','.join(got_arms)} over {','.join(got_names)}; "
                f"this run has arms {','.join(arms)} over {','.join(names)} (use another --out)")
        run.setdefault("commit", result.get("commit", "?"))
        run.setdefault("order", got_arms)  # written before the order alternated: as listed
    return runs


def rereport(path: Path) -> int:
    """``--report``: the comparisons of ``path``'s runs recomputed from their turns."""
    result = json.loads(path.read_text())
    for run in result["runs"]:
        run.setdefault("commit", result.get("commit", "?"))
        arms = list(run["arms"])
        names = list(run["arms"]["radix"])
        run["compare"] = {arm: {w: compare(run["arms"], w, arm) for w in names}
                          for arm in arms if arm != "radix"}
    path.write_text(json.dumps(result, indent=1))
    report(result["runs"], arms, names)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="panel (4 flows x 4 reviewers, 1.7k-token file, 96-token answers) and "
                        "debate (8 flows, 256-token answers), every arm, one run")
    p.add_argument("--workloads", default="panel,debate")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--flows", type=int, default=4)
    p.add_argument("--agents", type=int, default=4, help="reviewers per panel (2..16)")
    p.add_argument("--doc-tokens", type=int, default=1700)
    p.add_argument("--answer", type=int, default=96,
                   help="answer tokens of every workload (--quick: 96, the debate's 256)")
    p.add_argument("--pool", type=int, default=100000,
                   help="--max-total-tokens of every arm: large enough that radix keeps the "
                        "quick debate without evicting; with a smaller pool "
                        "radix evicts, and its peak KV is the pool's size (flagged *)")
    p.add_argument("--history", choices=sorted(HISTORIES), default="shared",
                   help="; ".join(f"{k}: {v}" for k, v in HISTORIES.items()))
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--append", action="store_true",
                   help="add this invocation's runs to those already in the result file "
                        "(same workloads and arms); the headline is the median over all")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="recompute the comparisons and the summary of a written result, and "
                        "rewrite it; runs nothing")
    add_model_arg(p)
    args = p.parse_args(argv)
    if args.report is not None:
        return rereport(args.report)
    model = model_from_args(p, args)
    tok = model.tokenizer()
    arms = [a for a in args.arms.split(",") if a]
    if "radix" not in arms or any(a not in ARMS for a in arms):
        p.error(f"--arms must include radix and name only {', '.join(ARMS)}")
    names = [w for w in args.workloads.split(",") if w]
    if args.quick:
        names, args.flows, args.agents, args.doc_tokens, args.answer = (
            ["panel", "debate"], 4, 4, 1700, 96)

    def workloads() -> list[Workload]:
        out = []
        for n in names:
            flows = 8 if args.quick and n == "debate" else args.flows
            answer = 256 if args.quick and n == "debate" else args.answer
            out.append(build(n, tok, flows, answer, args.agents, args.doc_tokens,
                             args.history))
        return out

    variant = ("_quick" if args.quick else "") + ("_own" if args.history == "own" else "")
    out = args.out or model.named(RESULTS / f"matrix{variant}.json")
    logs = out.parent / out.stem  # ignored by git: server logs
    logs.mkdir(parents=True, exist_ok=True)
    header = run_header("benchmark/serving/matrix.py", argv, model)
    runs = earlier_runs(out, arms, names) if args.append else []
    if runs:
        say(f"appending to the {len(runs)} run(s) in {out}")
    for run in range(args.runs):
        order = arm_order(arms, len(runs))
        ran = {}
        for arm in order:
            say(f"run {run + 1}/{args.runs}: arm {arm}")
            ran[arm] = run_arm(arm, model, workloads(), args.pool, logs)
        per_arm = {arm: ran[arm] for arm in arms}
        runs.append({"commit": header["commit"], "order": order, "arms": per_arm, "compare": {
            arm: {w: compare(per_arm, w, arm) for w in names} for arm in arms if arm != "radix"}})
        record(out, json.dumps({**header, "runs": runs}, indent=1),
               what=f"workload matrix ({', '.join(names)}): makespan, TTFT, decode, peak KV "
                    f"with host leaves, same answers, each arm against radix ({len(runs)} "
                    "run(s))")
    report(runs, arms, names)
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
