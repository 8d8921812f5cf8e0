"""What exactness costs: TTFT, KV and same-answer rate of our backend by what readers recompute.

The head-to-head's debate workload (``head_to_head.run_workload``: N concurrent 3-agent GSM8K
debates, 3 rounds, one server at a time) runs once on SGLang's radix cache (the reference), then
once per recompute configuration on a kvcmas server whose readers recompute ``boundary`` tokens
at the start of every borrowed span plus the ``mass`` share of borrowed tokens with the largest
owner head mass (``policy/recompute.py``; set through ``KVCMAS_RECOMPUTE_*``; the recompute cap
rises to the mass share where it is above the default 0.5).
``100000:1.0`` recomputes every borrowed token: a reader then reads nothing approximate, which is
the exact end of the curve (the control of ``recompute_fidelity_all_recomputed.txt``).

Per configuration: non-owner median TTFT (radix / ours, on the turns that read through the
shared tree in that run: borrowed tokens, recomputed or not), makespan, peak KV (vs radix and vs
the one-copy ideal), the share of those turns' borrowed tokens they recomputed, greedy
agreement with radix on turns whose prompts were identical, and the share of debates whose
final (majority) answer is radix's, with the first divergent turn of each other debate. One
table, ``consistency_frontier.jsonl`` and a plot of same-answer rate against TTFT speedup and
KV, with the issue's targets drawn in. Every run's turns are kept under ``--turns`` (default a
temporary folder), and ``--from-turns`` recomputes the table from them without a server
(several folders, comma-separated: their debates are pooled).

    python benchmark/serving/consistency_frontier.py [--debates 16] [--max-new-tokens 64] \
        [--configs 16:0.1,16:0.2,16:0.5,100000:1.0] [--model-path NAME]

``--model-path`` serves one model in every run (``model_arg``); rows name it, and
the default ``--out`` gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_kvcmas_bench import provenance
from sglang_kvcmas_bench.answers import (
    final_answers,
    first_divergent_turn,
    greedy_agreement,
    same_answer,
)
from sglang_kvcmas_bench.forced_reads import config_name, parse_config
from sglang_kvcmas_bench.kv_ideal import KV_BYTES_PER_TOKEN, one_copy_ideal
from sglang_kvcmas_bench.kv_sampler import KvSampler
from sglang_kvcmas_bench.model_arg import add_model_arg, chat_markers, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_arms import ArmServer
from sglang_kvcmas_bench.server_calls import stream_generate
from sglang_kvcmas_bench.workload_runs import build_workflows, run_workload, turn_key

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "consistency_frontier"
TTFT_TARGET, KV_IDEAL_TARGET, SAME_TARGET = 2.0, 1.25, 0.9


def config_env(boundary: int, mass: float, tail: int) -> dict[str, str]:
    """The kvcmas server's environment for one recompute configuration."""
    return {"KVCMAS_RECOMPUTE_BOUNDARY": str(boundary),
            "KVCMAS_RECOMPUTE_MASS_FRACTION": str(mass),
            "KVCMAS_RECOMPUTE_TAIL": str(tail)}


def run_arm(arm: str, env: dict[str, str], args, tok, name: str) -> dict:
    """One server, one workload: its turns, makespan and peak KV slots (also written to
    ``args.turns / f"{name}.json"``)."""
    log = args.turns / f"server_{name}.log"
    flags = [*args.model.server_args, "--max-total-tokens", str(args.max_total_tokens)]
    with ArmServer(arm, log, flags, env) as server:
        stream_generate(server.url, tok.encode("Warm up."), 4)
        sampler = KvSampler(server.url)
        sampler.start()
        turns, makespan = run_workload(server.url, build_workflows(args.debates, 0), tok,
                                       args.max_new_tokens)
        out = {"turns": turns, "makespan_s": makespan, "peak_kv_tokens": sampler.stop()}
    (args.turns / f"{name}.json").write_text(json.dumps(out))
    return out


def load_arm(folder: Path, name: str) -> dict:
    path = folder / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"--from-turns: no {path} (run the frontier with --turns first)")
    return json.loads(path.read_text())


def reuse_of(turn: dict) -> dict:
    return of_meta(turn["meta"])


def recomputed_borrowed(turn: dict) -> int:
    """Borrowed tokens the turn recomputed in its own context."""
    return reuse_of(turn).get("recomputed_borrowed", 0)


def readers_of(turns: list[dict]) -> set[tuple]:
    """Turns that read through the shared tree: they borrowed tokens, read from their exact
    leaves or recomputed borrowed ones (with every borrowed token recomputed a reader reads
    nothing borrowed, so ``head_to_head.owners_of`` would count it an owner)."""
    return {turn_key(t) for t in turns
            if any(reuse_of(t).get(k, 0) for k in ("borrowed", "recomputed_borrowed",
                                                     "exact_from_leaves"))}


def compare(name: str, ours: dict, radix: dict, n_debates: int,
            kv_bytes_per_token: int = KV_BYTES_PER_TOKEN, chat=None) -> dict:
    """One configuration's row against the radix run (``kv_bytes_per_token`` and the template
    markers ``chat``: the model's, default the embedded one's)."""
    non_owner = readers_of(ours["turns"])
    ref = {turn_key(t): t for t in radix["turns"]}

    def median_ttft(turns: list[dict]) -> float | None:
        xs = [t["ttft"] for t in turns if turn_key(t) in non_owner]
        return statistics.median(xs) if xs else None

    mine, theirs = median_ttft(ours["turns"]), median_ttft(radix["turns"])
    readers = [t for t in ours["turns"] if turn_key(t) in non_owner]
    corrected = sum(reuse_of(t).get("borrowed", 0) for t in readers)
    recomputed = sum(recomputed_borrowed(t) for t in readers)
    greedy, compared = greedy_agreement(ours["turns"], ref)
    a_ours = final_answers(ours["turns"], n_debates)
    a_ref = final_answers(radix["turns"], n_debates)
    diverged = []
    for w in range(n_debates):
        if not same_answer(a_ours[w], a_ref[w]):
            t = first_divergent_turn(ours["turns"], ref, w) or {"step": None, "agent": None}
            diverged.append({"wid": w, "kvcmas": a_ours[w], "radix": a_ref[w],
                             "step": t["step"], "agent": t["agent"]})
    ideal = one_copy_ideal(ours["turns"], chat)
    return {
        "config": name, "nonowner_turns": len(non_owner),
        "nonowner_ttft_median_s": mine, "radix_nonowner_ttft_median_s": theirs,
        "ttft_speedup_vs_radix": (theirs / mine) if mine and theirs else None,
        "makespan_s": ours["makespan_s"], "radix_makespan_s": radix["makespan_s"],
        "peak_kv_tokens": ours["peak_kv_tokens"], "radix_peak_kv_tokens": radix["peak_kv_tokens"],
        "peak_kv_bytes": ours["peak_kv_tokens"] * kv_bytes_per_token,
        "kv_ratio_vs_radix": ours["peak_kv_tokens"] / max(1, radix["peak_kv_tokens"]),
        "one_copy_ideal_tokens": ideal, "kv_ratio_to_ideal": ours["peak_kv_tokens"] / max(1, ideal),
        "recomputed_share": recomputed / max(1, recomputed + corrected),
        "greedy_agreement": greedy, "greedy_compared_turns": compared,
        "answer_consistency": 1 - len(diverged) / max(1, n_debates),
        "inconsistent_debates": diverged,
    }


def print_table(rows: list[dict]) -> None:
    head = (f"{'config':>12} {'recomp':>7} {'TTFT no (s)':>11} {'x radix':>8} {'makespan':>9} "
            f"{'KV/radix':>9} {'KV/ideal':>9} {'greedy':>7} {'same ans':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        sp = r["ttft_speedup_vs_radix"]
        print(f"{r['config']:>12} {r['recomputed_share']:>7.2f} "
              f"{r['nonowner_ttft_median_s'] or float('nan'):>11.2f} "
              f"{sp if sp is not None else float('nan'):>8.2f} {r['makespan_s']:>9.1f} "
              f"{r['kv_ratio_vs_radix']:>9.2f} {r['kv_ratio_to_ideal']:>9.2f} "
              f"{r['greedy_agreement']:>7.3f} {r['answer_consistency']:>9.3f}")
    for r in rows:
        steps = [d["step"] for d in r["inconsistent_debates"]]
        print(f"  {r['config']}: {len(steps)} debates differ; first divergent step (0-based) of "
              f"each: {steps}")


def plot(rows: list[dict], path: Path) -> None:
    """Same-answer rate against TTFT speedup and against KV / ideal; radix is the star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    radix_kv = rows[0]["radix_peak_kv_tokens"] / max(1, rows[0]["one_copy_ideal_tokens"])
    for ax, key, target, label, ref in (
        (a, "ttft_speedup_vs_radix", TTFT_TARGET, "non-owner median TTFT, radix / ours", 1.0),
        (b, "kv_ratio_to_ideal", KV_IDEAL_TARGET, "peak KV / one-copy ideal", radix_kv),
    ):
        pts = [(r[key], r["answer_consistency"], r) for r in rows if r[key] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="C0", label="kvcmas")
        for i, (x, y, r) in enumerate(pts):
            ax.annotate(f"{r['config']} ({r['recomputed_share']:.0%})", (x, y), fontsize=8,
                        textcoords="offset points", xytext=(4, 6 if i % 2 else -12))
        ax.plot([ref], [1.0], "*", color="C2", markersize=12, label="radix (the reference)")
        ax.axvline(target, color="C3", ls="--", lw=1)
        ax.axhline(SAME_TARGET, color="C3", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("debates with radix's final answer")
        ax.set_ylim(0, 1.08)
        ax.legend(loc="lower left", fontsize=8)
    a.set_title("same answer vs TTFT (target: above and right of the dashes)", fontsize=10)
    b.set_title("same answer vs memory (target: above and left of the dashes)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pooled(runs: list[list[dict]]) -> list[dict]:
    """Rows of several runs of the same configurations, one per configuration: same-answer
    rate and greedy agreement over all their debates / turns, the other ratios averaged."""
    out = []
    for rows in zip(*runs):
        n = sum(r["debates"] for r in rows)

        def mean(key: str) -> float | None:
            xs = [r[key] for r in rows if r[key] is not None]
            return statistics.fmean(xs) if xs else None

        compared = sum(r["greedy_compared_turns"] for r in rows)
        out.append({
            **{k: mean(k) for k in ("nonowner_ttft_median_s", "radix_nonowner_ttft_median_s",
                                    "ttft_speedup_vs_radix", "makespan_s", "radix_makespan_s",
                                    "kv_ratio_vs_radix", "kv_ratio_to_ideal",
                                    "recomputed_share")},
            "config": rows[0]["config"], "runs": len(rows), "debates": n,
            "peak_kv_tokens": mean("peak_kv_tokens"),
            "radix_peak_kv_tokens": mean("radix_peak_kv_tokens"),
            "one_copy_ideal_tokens": mean("one_copy_ideal_tokens"),
            "greedy_agreement": sum(r["greedy_agreement"] * r["greedy_compared_turns"]
                                    for r in rows) / max(1, compared),
            "greedy_compared_turns": compared,
            "answer_consistency": sum(r["answer_consistency"] * r["debates"] for r in rows) / n,
            "inconsistent_debates": [{**d, "run": i} for i, r in enumerate(rows)
                                     for d in r["inconsistent_debates"]],
        })
    return out


def one_run(args, configs, tok, meta: dict, source: Path | None) -> list[dict]:
    """One radix run and one kvcmas run per configuration, measured now (``source`` None)
    or read back from a ``--turns`` folder."""
    t0 = time.perf_counter()
    print(f"[frontier] turns and server logs in {source or args.turns}", file=sys.stderr,
          flush=True)
    radix = load_arm(source, "radix") if source else run_arm("radix", {}, args, tok, "radix")
    if not source:
        print(f"[frontier] radix measured at {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    rows = []
    for cfg in configs:
        name = config_name(*cfg)
        ours = (load_arm(source, name) if source
                else run_arm("kvcmas", config_env(*cfg), args, tok, name))
        n = len({t["wid"] for t in ours["turns"]})
        rows.append({**meta, **compare(name, ours, radix, n, args.model.kv_bytes_per_token,
                                       chat_markers(tok)), "debates": n})
        sp = rows[-1]["ttft_speedup_vs_radix"]
        when = "" if source else f" measured at {time.perf_counter() - t0:.0f} s"
        print(f"[frontier] {name}{when}: same answer {rows[-1]['answer_consistency']:.3f}, "
              "non-owner TTFT " + ("n/a" if sp is None else f"{sp:.2f}x radix"),
              file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--debates", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="16:0.1,16:0.2,16:0.5,100000:1.0",
                    help="boundary:mass[:tail] per kvcmas run")
    ap.add_argument("--max-total-tokens", type=int, default=40000,
                    help="KV pool of every server: above the radix arm's demand, so peak KV is "
                         "not clipped")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="results stem (default: results/consistency_frontier[_<model>])")
    ap.add_argument("--turns", type=Path, default=None,
                    help="folder for every run's turns and server log (default: a new "
                         "temporary folder)")
    ap.add_argument("--from-turns", default=None,
                    help="recompute the table from --turns folders (comma-separated: their "
                         "debates are pooled); starts no server")
    add_model_arg(ap)
    args = ap.parse_args()
    args.model = model_from_args(ap, args)
    args.out = args.model.out_or_named(args.out, DEFAULT_OUT)
    if args.from_turns is None:
        args.turns = args.turns or Path(tempfile.mkdtemp(prefix="consistency_frontier_"))
        args.turns.mkdir(parents=True, exist_ok=True)
    configs = [parse_config(c) for c in args.configs.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok = args.model.tokenizer()
    commit = provenance.commit()
    meta = {"commit": commit, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "model": args.model.name, "max_new_tokens": args.max_new_tokens}
    t0 = time.perf_counter()
    sources = [Path(d) for d in args.from_turns.split(",")] if args.from_turns else [None]
    runs = [one_run(args, configs, tok, meta, src) for src in sources]
    rows = runs[0] if len(runs) == 1 else [{**meta, **r} for r in pooled(runs)]
    what = ("" if len(runs) == 1
            else f"pooled over {len(runs)} runs ({rows[0]['debates']} debates), ")
    print(f"# {what}{rows[0]['debates'] // len(runs)} concurrent 3-agent debates per run, "
          f"{args.max_new_tokens} new tokens per turn, one server at a time; radix non-owner "
          f"TTFT median per row is over that row's non-owner turns")
    print_table(rows)
    about = (f"{what}{rows[0]['debates'] // len(runs)} concurrent 3-agent debates per run, "
             f"{args.max_new_tokens}-token answers, one server at a time ({args.model.name})")
    record(args.out.with_suffix(".jsonl"), "".join(json.dumps(r) + "\n" for r in rows),
           what=f"same-answer rate, TTFT and KV by what readers recompute, one row per "
                f"configuration ({', '.join(r['config'] for r in rows)}): {about}")
    record(args.out.with_suffix(".png"), lambda p: plot(rows, p),
           what=f"its plot: same-answer rate against TTFT speed-up and against KV / ideal "
                f"({about})")
    print(f"[frontier] {meta['machine']}; total {time.perf_counter() - t0:.0f} s; results in "
          f"{args.out.with_suffix('.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
