"""The leaf-mode frontier: fidelity against memory and speed at 3, 8 and 16 agents, in the server.

What a reader keeps of the tokens it recomputes (its leaves) trades fidelity for memory. This
benchmark serves ``scale.py``'s panel (N agents with their own system prompts introduce
themselves, then review one essay document in two rounds, the second reading every first-round
answer) once per arm, one server at a time, the same KV pool for every arm. Every sharing arm's
second round reads radix's first-round answers (replayed), not its own, so that the arms read
identical prompts there and their fidelity probes compare:

- ``radix``: SGLang's own prefix cache (each agent computes its own copy: the exact reference
  of TTFT and answers);
- ``naive``: sharing, nothing recomputed: every borrowed token read re-positioned only;
- ``exact``: sharing at the deployment's default picks (the first 16 tokens of every borrowed
  span and 10% by owner head mass recomputed, the readers that wait together for one segment
  splitting 20% of it by mass: ``policy.recompute.SEGMENT_SHARE``), kept as exact leaves
  (exact-sparse: leaf mode ``exact``, the reference of the leaf-byte ratio);
- ``factored<r>``: the default picks kept as factored leaves (leaf mode ``factored``: their
  deviation from the owner's KV at rank ``r``, per layer and KV head); ``factored4`` is the
  server's defaults; ``factored4_run4``: with SGLang's ``--max-running-requests 4``, so that at
  most 4 readers hold the slots of the tokens they recompute at once (the transient a turn's
  recompute adds to peak KV, whatever the leaf type).

(Arms of knobs no longer served, per-reader shares, mass caps, FIFO turns, a per-batch
recompute cap and low-rank corrections, ran before they were removed: their results stay in
``results/`` and ``docs/results.md``.)

Per arm: KL recovered (``1 − KL20 served / KL20 naive``, naive's pooled over the run's arms
(:func:`with_pooled_kl`; each arm's own beside it), over ``--probe`` round-2 readers, each
teacher-forced over the greedy answer of an exact prefill on the same server, as
``scale.probe_readers``), teacher-forced top-1, the share of turns whose greedy answer is radix's,
non-owner median TTFT vs radix, peak KV (pool slots held: the most of SGLang's gauges, sampled
every 0.5 s, and of the tree cache's mark after each row's allocation, which holds a prefill
batch's transient; plus factored leaves' bytes in tokens of KV, and the most deviations
running readers held expanded, as if at the pool's peak: an upper bound) over the one-copy
ideal, leaf bytes per agent (median over readers), and the prompt tokens each arm computed (prefill,
recomputed borrowed tokens included: no arm prefills a reference). The probe runs after the
workload and reads each probed reader three times: over what its turn left it (``leaves``: its
leaves, nothing recomputed: for a ``factored`` arm the picks through their deviations, as its
decode read them once they were factored; for ``exact`` the same picks exact), as in its turn
(``turn``: from the owner's KV, recomputing what the arm's policy gave it there, its split of
the segment share among the round's waiting readers included; no leaves) and alone as served
after the workload (``alone``: its leaves plus the whole 10% share recomputed anew).
``KL_rec``, which the pick and the headline use, is the first (runs before it: ``turn``, but
``alone`` for the ``factored`` arms). For a ``factored`` arm, ``leaves`` against ``turn`` is
what factoring its picks costs, on the same prompts and picks: the one comparison of leaf types
here that no run-to-run difference of the workload moves. The targets of a 16-agent deployment:
KL recovered ≥ 0.6, non-owner TTFT ≥ 2x radix, KV ≤ 1.25x the ideal, leaf bytes ≥ 4x smaller
than exact-sparse; the report names, per agent count, the arm with the highest KL recovered
among those meeting the others.

A factored arm also reports ``same_x``: the leaf bytes of the exact arm that keeps the same
tokens, over its own (``factored8`` against ``exact``). Its reader-alone probe recomputes the
whole 10% share over its leaves: for ``factored8``, more than its turns did at the defaults'
split.

    python benchmark/serving/frontier.py --quick   # 16 agents, 4 arms (< 15 min on 2 cores)
    python benchmark/serving/frontier.py           # 3, 8 and 16 agents, every arm (~75 min)
    python benchmark/serving/frontier.py --report results/frontier.json   # re-render only

The spare pass is off in every arm (``KVCMAS_SPARE_PREFILL=0``, radix's too, so the arms differ
in the cache alone). The probes run one at a time on the idle server after the workload, where
the spare pass would serve each exactly: every read would match the exact prefill and KL
recovered would be 0 / 0. A run whose probes read nothing approximate (naive's pooled KL20 under
:data:`MIN_NAIVE_KL`) fails rather than report it.

The document is 1024 tokens by default (``--doc``): long enough that every reader borrows
it, short enough that the radix arm of 16 agents takes about two minutes on 2 cores;
``scale.py``'s panel runs the same workload over a 7000-token document.

Ends with ``HEADLINE agents=16 kl_recovered=<x> ttft_speedup_vs_radix=<x> kv_vs_ideal=<x>
leaf_bytes_ratio_vs_exact=<x>`` for the default configuration (``factored4``; ``exact`` in runs
saved before it became the default); writes
``results/frontier[_quick][_<model>].{json,txt,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sglang_kvcmas.policy.recompute import RecomputeConfig
from sglang_kvcmas.server.options import parse_launcher_args
from sglang_kvcmas_bench.figures import fmt
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.review_panel import (
    leaf_bytes_per_agent,
    nonowner_ttft,
    panel_arm,
    same_answers,
)
from sglang_kvcmas_bench.server_arms import NO_SPARE_PASS, run_header

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ARM = "factored4"
"""The arm that runs the server's defaults (its flags only spell them out: a test checks)."""
EXACT_ARM = "exact"
"""Exact-sparse leaves at the default picks: the reference of ``leaf_bytes_ratio_vs_exact``."""
EXACT = ("--kvcmas-leaf-mode", "exact")
ARMS: dict[str, list[str]] = {
    "naive": ["--kvcmas-recompute-boundary", "0", "--kvcmas-recompute-mass-fraction", "0"],
    "exact": [*EXACT],
    "factored4": ["--kvcmas-leaf-mode", "factored", "--kvcmas-leaf-rank", "4"],  # default
    "factored8": ["--kvcmas-leaf-mode", "factored", "--kvcmas-leaf-rank", "8"],
    "factored4_run4": ["--kvcmas-leaf-mode", "factored", "--kvcmas-leaf-rank", "4",
                       "--max-running-requests", "4"],
}
"""Sharing arm -> the flags its kvcmas server adds to the defaults."""
QUICK_ARMS = ("naive", "exact", "factored4", "factored8")


TARGETS = {"kl_recovered": 0.6, "ttft_speedup_vs_radix": 2.0, "kv_vs_ideal": 1.25,
           "leaf_bytes_ratio_vs_exact": 4.0}
"""The 16-agent targets (a minimum for each, but ``kv_vs_ideal``: a maximum)."""


MIN_NAIVE_KL = 1e-6
"""Least pooled KL20 of the naive reads for the probes to have read borrowed KV approximately."""


KL_FLOOR = -1.5
"""The plot draws KL recovered below this on it, its value in the label."""


def turn_selection(flags: list[str], agents: int) -> tuple[int, float, int]:
    """(boundary, mass fraction, tail) a round-2 reader of an arm recomputed in its turn: the
    arm's knobs, with the mass share the policy gives each of the ``agents - 1`` readers that
    wait together for the round's leader."""
    config = parse_launcher_args(flags).config
    readers = max(1, agents - 1)
    policy = RecomputeConfig.from_serving(config).with_readers(readers)
    return policy.boundary_tokens, policy.reader_mass_fraction, policy.tail_tokens


def say(text: str) -> None:
    print(f"[frontier] {text}", file=sys.stderr, flush=True)


def arm_row(panel: dict[str, dict], name: str, kv_bytes_per_token: int) -> dict:
    """One sharing arm's columns from ``scale.panel_arm`` records (``panel`` holds radix)."""
    p = panel[name]
    fid = p.get("fidelity") or {}
    by_agent = p.get("leaf_bytes_by_agent") or {}
    leaf = leaf_bytes_per_agent(by_agent)
    factored = sum(t.get("factored", 0) for t in by_agent.values())
    # Host memory beside the pool: the stored factors, and the deviations running readers held
    # expanded (their peak, counted as if it coincided with the pool's: an upper bound).
    peak = p["peak_kv_tokens"] + (factored + p.get("materialized_leaf_bytes_peak", 0)) \
        / kv_bytes_per_token
    no = nonowner_ttft(panel, name) if "radix" in panel else {}
    same = same_answers(panel, name) if "radix" in panel else None
    doc_turns = [t for t in p["turns"] if t["round"] > 0]
    # The read judged: the reader over what its turn left it (its leaves, nothing recomputed:
    # what its decode read) where probed so; in runs before that probe, the reader as in its
    # turn (its split of the segment share), but for a factored arm, whose in-turn probe reads
    # its picks exact: the reader alone over its leaves (and the full share recomputed).
    if fid.get("kl_recovered_leaves") is not None:
        read = "_leaves"
    else:
        read = "_turn" if "kl_recovered_turn" in fid and \
            "factored" not in p.get("flags", []) else ""
    return {
        "flags": p.get("flags", []),
        "kl_recovered": fid.get(f"kl_recovered{read}"),
        "kl_recovered_alone": fid.get("kl_recovered"),
        "kl_recovered_turn": fid.get("kl_recovered_turn"),
        "kl_recovered_leaves": fid.get("kl_recovered_leaves"),
        "top1": fid.get(f"top1{read}"), "top1_alone": fid.get("top1"),
        "turn_selection": fid.get("turn_config"), "kl20": fid.get("kl20"),
        "kl20_turn": fid.get("kl20_turn"), "kl20_leaves": fid.get("kl20_leaves"),
        "kl20_naive": fid.get("kl20_naive"), "kl20_read": fid.get(f"kl20{read}"),
        "probes": [{k: a.get(k) for k in ("agent", "served", "naive", "turn", "leaves",
                                          "recomputed", "turn_recomputed", "borrowed")}
                   for a in fid.get("agents") or []],
        "top1_naive": fid.get("top1_naive"), "probed": len(fid.get("agents") or []),
        "same_answer_as_radix": None if same is None else statistics.fmean(same.values()),
        "ttft_speedup_vs_radix": no["radix"] / no[name] if no else None,
        "kv_vs_ideal": peak / p["one_copy_ideal_tokens"],
        "peak_kv_tokens": p["peak_kv_tokens"], "factored_bytes": factored,
        "materialized_leaf_bytes_peak": p.get("materialized_leaf_bytes_peak", 0),
        "leaf_bytes_per_agent": statistics.median(leaf) if leaf else 0,
        "computed_tokens": sum(t.get("computed", 0) for t in p["turns"]),
        "recomputed_tokens": sum(t.get("recomputed", 0) for t in doc_turns),
        "makespan_s": p["makespan_s"],
        "makespan_speedup": panel["radix"]["makespan_s"] / p["makespan_s"]
        if "radix" in panel else None,
    }


SAME_PICKS = {"factored4": "exact", "factored8": "exact", "factored4_run4": "exact",
              # arms of saved results, re-rendered by --report
              "factored4_fifo": "exact_fifo", "factored4_per_reader": "exact_per_reader",
              "factored4_per_reader_run4": "exact_per_reader",
              "factored8_per_reader": "exact_per_reader",
              "factored16_per_reader": "exact_per_reader",
              "factored4_per_reader_cap256": "exact_per_reader",
              "factored8_per_reader_cap256": "exact_per_reader"}
"""A factored arm -> the exact arm that recomputes and keeps the same tokens exactly."""


def with_leaf_ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """Adds ``leaf_bytes_ratio_vs_exact`` (exact-sparse leaf bytes at the defaults / the arm's;
    inf for an arm that keeps none) where the ``exact`` arm ran, and for a factored arm whose
    exact counterpart ran (:data:`SAME_PICKS`), ``leaf_bytes_ratio_vs_same_picks``: the same
    tokens kept exact / kept factored."""
    exact = rows.get(EXACT_ARM, {}).get("leaf_bytes_per_agent")
    for name, row in rows.items():
        mine = row["leaf_bytes_per_agent"]
        row["leaf_bytes_ratio_vs_exact"] = (None if exact is None else
                                            exact / mine if mine else float("inf"))
        same = rows.get(SAME_PICKS.get(name, ""), {}).get("leaf_bytes_per_agent")
        if same is not None and mine:
            row["leaf_bytes_ratio_vs_same_picks"] = same / mine
    return rows


def with_pooled_kl(rows: dict[str, dict]) -> dict[str, dict]:
    """For arms that read identical prompts (radix's round-1 answers replayed): KL recovered
    against naive's KL pooled over the run's arms, not each arm's own.

    Naive's KL is read from each arm's own tree (who led the round, the owner's KV, which
    readers were probed), and it moves several times more between arms than the served reads
    do; over one pooled denominator the columns rank arms as their KL against the exact
    prefill (``kl20_read``) does. Each arm's own-naive figure stays as
    ``kl_recovered_own``."""
    naive = [r["kl20_naive"] for r in rows.values() if r.get("kl20_naive")]
    if not naive:
        return rows
    pool = statistics.fmean(naive)
    for r in rows.values():
        if r.get("kl20_read") is None:  # saved before rows kept it: the same rule as arm_row
            factored = "factored" in r.get("flags", [])
            r["kl20_read"] = r.get("kl20" if factored or r.get("kl20_turn") is None
                                   else "kl20_turn")
        if "kl_recovered_own" not in r:
            r["kl_recovered_own"] = r.get("kl_recovered")
            r["kl_recovered_turn_own"] = r.get("kl_recovered_turn")
            r["kl_recovered_alone_own"] = r.get("kl_recovered_alone")
        r["kl20_naive_pooled"] = pool
        for key, kl20 in (("kl_recovered", r.get("kl20_read")),
                          ("kl_recovered_turn", r.get("kl20_turn")),
                          ("kl_recovered_leaves", r.get("kl20_leaves")),
                          ("kl_recovered_alone", r.get("kl20"))):
            r[key] = None if kl20 is None else 1 - kl20 / pool
    return rows


def turn_kl(row: dict) -> float | None:
    """KL recovered as in the reader's turn (the share recomputed exactly, no leaves), also for
    rows saved before the row kept it."""
    if row.get("kl_recovered_turn") is not None:
        return row["kl_recovered_turn"]
    turn, naive = row.get("kl20_turn"), row.get("kl20_naive")
    return 1 - turn / naive if turn is not None and naive else None


def meets(row: dict, targets: dict[str, float], skip: str = "") -> bool:
    """Whether ``row`` meets every target but ``skip`` (a missing figure fails)."""
    for key, bound in targets.items():
        if key == skip:
            continue
        x = row.get(key)
        if x is None or (x > bound if key == "kv_vs_ideal" else x < bound):
            return False
    return True


def pick(rows: dict[str, dict], targets: dict[str, float] = TARGETS) -> str | None:
    """The arm with the highest KL recovered among those meeting the other targets."""
    ok = [n for n, r in rows.items() if r.get("kl_recovered") is not None
          and meets(r, targets, skip="kl_recovered")]
    return max(ok, key=lambda n: rows[n]["kl_recovered"]) if ok else None


def table(agents: int, rows: dict[str, dict], doc: int) -> list[str]:
    lines = [f"{agents} agents, {doc}-token document:",
             f"{'arm':>27} {'KL_rec':>7} {'turn':>6} {'alone':>6} {'own':>6} {'KL20':>7} "
             f"{'naive':>7} {'top1':>6} {'same':>5} "
             f"{'TTFTx':>6} "
             f"{'KV/ideal':>8} {'leaf_KiB':>8} {'leaf_x':>7} {'same_x':>6} {'computed':>8} "
             f"{'recomp':>7} {'makespan':>8}"]
    for name, r in rows.items():
        ratio = r.get("leaf_bytes_ratio_vs_exact")
        lines.append(
            f"{name:>27} {fmt(r['kl_recovered'], 3):>7} {fmt(turn_kl(r), 2):>6} "
            f"{fmt(r.get('kl_recovered_alone'), 2):>6} {fmt(r.get('kl_recovered_own'), 2):>6} "
            f"{fmt(r.get('kl20_read'), 5):>7} {fmt(r.get('kl20_naive'), 5):>7} "
            f"{fmt(r['top1'], 4):>6} "
            f"{fmt(r['same_answer_as_radix'], 2):>5} {fmt(r['ttft_speedup_vs_radix'], 2):>6} "
            f"{r['kv_vs_ideal']:>8.3f} {r['leaf_bytes_per_agent'] / 1024:>8.0f} "
            f"{'inf' if ratio == float('inf') else fmt(ratio, 2):>7} "
            f"{fmt(r.get('leaf_bytes_ratio_vs_same_picks'), 2):>6} {r['computed_tokens']:>8} "
            f"{r['recomputed_tokens']:>7} {r['makespan_s']:>7.1f}s")
    pooled = next((r["kl20_naive_pooled"] for r in rows.values() if "kl20_naive_pooled" in r),
                  None)
    if pooled is not None:
        lines.append(f"  KL_rec, turn, alone: 1 - KL20 / naive's KL20 pooled over the arms "
                     f"({pooled:.5f}; the prompts are identical); own: over the arm's own naive "
                     "read; KL20: the read's KL20 against the exact prefill; naive: the arm's "
                     "own naive KL20")
    if any(r.get("kl20_leaves") is not None for r in rows.values()):
        lines.append("  KL_rec, top1: the reader over what its turn left it (its leaves, "
                     "nothing recomputed); turn: its turn's picks recomputed exactly; alone: "
                     "its leaves plus the whole share recomputed")
    best = pick(rows)
    lines.append(f"  best meeting the targets (KV <= {TARGETS['kv_vs_ideal']}x, TTFT >= "
                 f"{TARGETS['ttft_speedup_vs_radix']}x, leaves >= "
                 f"{TARGETS['leaf_bytes_ratio_vs_exact']}x smaller), by KL recovered: "
                 f"{best or 'none'}" + (f" ({fmt(rows[best]['kl_recovered'], 3)}; the KL "
                                        f"target {TARGETS['kl_recovered']} "
                                        f"{'met' if meets(rows[best], TARGETS) else 'not met'})"
                                        if best else ""))
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["by_agents"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for n, run in runs.items():
        rows = run["arms"]
        names = [a for a in rows if rows[a]["kl_recovered"] is not None]
        x = [max(rows[a]["leaf_bytes_per_agent"], 1) / 1024 for a in names]
        y = [max(rows[a]["kl_recovered"], KL_FLOOR) for a in names]  # outliers on the floor
        axes[0].scatter(x, y, label=f"{n} agents")
        for a, xi, yi in zip(names, x, y):
            kl = rows[a]["kl_recovered"]
            axes[0].annotate(a if kl >= KL_FLOOR else f"{a} ({kl:.1f})", (xi, yi), fontsize=7)
        kv = [rows[a]["kv_vs_ideal"] for a in rows]
        tt = [rows[a]["ttft_speedup_vs_radix"] or 0 for a in rows]
        axes[1].scatter(kv, tt, label=f"{n} agents")
        for a, xi, yi in zip(rows, kv, tt):
            axes[1].annotate(a, (xi, yi), fontsize=7)
    axes[0].set(xscale="log", xlabel="leaf KiB per reader agent (log; naive at 1/1024)",
                ylabel="KL recovered vs naive", title="fidelity vs leaf memory",
                ylim=(KL_FLOOR - 0.1, 1.0))
    axes[0].axhline(TARGETS["kl_recovered"], ls=":", c="grey")
    axes[1].set(xlabel="peak KV / one-copy ideal", ylabel="non-owner TTFT speedup vs radix",
                title="memory vs first-token speed")
    axes[1].axvline(TARGETS["kv_vs_ideal"], ls=":", c="grey")
    axes[1].axhline(TARGETS["ttft_speedup_vs_radix"], ls=":", c="grey")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"leaf-mode frontier ({result['model']}, {result['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"16 agents, arms {', '.join(QUICK_ARMS)}")
    ap.add_argument("--agents", default="3,8,16", help="agent counts, comma-separated")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"sharing arms, comma-separated, of: {', '.join(ARMS)}")
    ap.add_argument("--doc", type=int, default=1024, help="document tokens")
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--probe", type=int, default=None,
                    help="round-2 readers probed per arm (default 8; --quick: 4)")
    ap.add_argument("--pool", type=int, default=40000, help="KV pool tokens of every arm")
    ap.add_argument("--out", type=Path, default=None,
                    help="results stem (default: results/frontier[_quick][_<model>])")
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="re-render a saved result's .txt and .png (runs nothing)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    if args.report is not None:
        print(rewrite(args.report))
        return 0
    if args.quick:
        args.agents, args.arms = "16", ",".join(QUICK_ARMS)
    if args.probe is None:
        args.probe = 4 if args.quick else 8
    model = model_from_args(ap, args)
    agent_counts = [int(a) for a in args.agents.split(",") if a]
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or any(not 2 <= n <= 16 for n in agent_counts) or not agent_counts:
        ap.error(f"--arms of {', '.join(ARMS)} and --agents in 2..16 "
                 f"(got arms {args.arms!r}, agents {args.agents!r})")
    out = args.out or model.named(RESULTS / ("frontier_quick" if args.quick else "frontier"))
    logs = model.named(RESULTS / "frontier")
    logs.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer()
    t_start = time.monotonic()
    result: dict = {
        **run_header("benchmark/serving/frontier.py", argv, model),
        "pool_tokens": args.pool, "doc_tokens": args.doc, "answer_tokens": args.answer_tokens,
        "probe": args.probe, "replayed": True, "targets": TARGETS, "default_arm": DEFAULT_ARM,
        "by_agents": {},
    }
    for n in agent_counts:
        panel: dict[str, dict] = {}
        for i, name in enumerate(["radix", *arms]):
            say(f"{n} agents: arm {name} ({i + 1}/{len(arms) + 1}), "
                f"{time.monotonic() - t_start:.0f} s in")
            if name == "radix":
                panel[name] = panel_arm("radix", tok, n, args.doc, args.answer_tokens, args.pool,
                                        logs, model.server_args, env=NO_SPARE_PASS)
            else:
                panel[name] = panel_arm(f"{name}_{n}", tok, n, args.doc, args.answer_tokens,
                                        args.pool, logs, model.server_args,
                                        server_arm="kvcmas", flags=ARMS[name], probe=args.probe,
                                        probe_turn=turn_selection(ARMS[name], n),
                                        replay=panel["radix"]["round1_answers"],
                                        probe_leaves=True, env=NO_SPARE_PASS)
        rows = with_pooled_kl(with_leaf_ratios(
            {a: arm_row(panel, a, model.kv_bytes_per_token) for a in arms}))
        result["by_agents"][n] = {"arms": rows, "best": pick(rows),
                                  "radix_makespan_s": panel["radix"]["makespan_s"],
                                  "radix_peak_kv_vs_ideal": panel["radix"]["peak_kv_tokens"]
                                  / panel["radix"]["one_copy_ideal_tokens"],
                                  "one_copy_ideal_tokens": panel["radix"]["one_copy_ideal_tokens"],
                                  "radix_computed_tokens": sum(t.get("computed", 0) for t in
                                                               panel["radix"]["turns"])}
        print("\n".join(agents_lines(n, result["by_agents"][n], args.doc)), flush=True)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    print(write(result, out))
    unread = unread_probes(result)
    if unread:
        print(f"frontier: the probes at {unread} agents read nothing approximate (naive's KL20 "
              f"under {MIN_NAIVE_KL:g}): their KL columns measure nothing", file=sys.stderr)
        return 1
    return 0


def unread_probes(result: dict) -> list[int]:
    """Agent counts whose probes ran but whose naive reads matched the exact prefill."""
    out = []
    for n, block in result["by_agents"].items():
        rows = [r for r in block["arms"].values() if r.get("probed")]
        naive = [r.get("kl20_naive_pooled", r.get("kl20_naive")) or 0.0 for r in rows]
        if rows and max(naive) < MIN_NAIVE_KL:
            out.append(int(n))
    return out


def agents_lines(n: int, block: dict, doc: int) -> list[str]:
    """The report of one agent count (``result["by_agents"][n]``)."""
    return [*table(n, block["arms"], doc),
            f"  radix: makespan {block['radix_makespan_s']:.1f} s, computed "
            f"{block['radix_computed_tokens']} tokens, peak KV / ideal "
            f"{fmt(block.get('radix_peak_kv_vs_ideal'), 3)}"]


def write(result: dict, out: Path) -> str:
    """Writes ``out.{json,txt,png}`` from a result; returns the headline."""
    by = {int(n): b for n, b in result["by_agents"].items()}
    head_n = 16 if 16 in by else max(by)
    default = result.get("default_arm", "exact")  # runs saved before it was named: exact
    d = by[head_n]["arms"].get(default)
    headline = (f"HEADLINE agents={head_n} kl_recovered={fmt(d and d['kl_recovered'], 3)} "
                f"ttft_speedup_vs_radix={fmt(d and d['ttft_speedup_vs_radix'], 2)} "
                f"kv_vs_ideal={fmt(d and d['kv_vs_ideal'], 3)} "
                f"leaf_bytes_ratio_vs_exact={fmt(d and d['leaf_bytes_ratio_vs_exact'], 2)}")
    body = [line for n in sorted(by) for line in agents_lines(n, by[n], result["doc_tokens"])]
    lines = [f"# {result['command']}",
             f"# {result['model']}, commit {result['commit']}, {result['machine']}, pool "
             f"{result['pool_tokens']} tokens, {result['answer_tokens']}-token answers, "
             f"{result.get('probe', 4)} readers probed per arm"
             f"{', radix round-1 answers replayed' if result.get('replayed') else ''}, "
             f"{result['seconds']:.0f} s",
             *body, f"default arm: {default}", headline]
    about = (f"the leaf-mode frontier at {', '.join(str(n) for n in sorted(by))} agents "
             f"({result['model']}, {result['doc_tokens']}-token document, "
             f"{result['answer_tokens']}-token answers, pool {result['pool_tokens']}, "
             f"{result.get('probe', 4)} readers probed per arm), arms "
             f"{', '.join(by[head_n]['arms'])} against radix")
    command = result["command"]
    record(out.with_suffix(".txt"), "\n".join(lines) + "\n",
           what=f"{about}: `{headline}`; {result['seconds']:.0f} s", command=command)
    record(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n",
           what=f"its figures per agent count and arm ({about})", command=command)
    record(out.with_suffix(".png"), lambda p: plot(result, p),
           what="its plot: KL recovered against leaf bytes per agent; TTFT speed-up against "
                f"peak KV / ideal ({about})", command=command)
    return headline


def rewrite(path: Path) -> str:
    """Re-renders a saved result (``--report``) with this version's derived columns."""
    result = json.loads(path.read_text())
    for block in result["by_agents"].values():
        block["arms"] = with_leaf_ratios(block["arms"])
        if result.get("replayed"):
            block["arms"] = with_pooled_kl(block["arms"])
        block["best"] = pick(block["arms"])
    return write(result, path.with_suffix(""))


if __name__ == "__main__":
    sys.exit(main())
