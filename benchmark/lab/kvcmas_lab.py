"""KVCMAS lab: prompt-specialized agents share one cache, measured against every baseline.

For each workload instance the transcript is generated once with no sharing (dense prefill and
greedy decoding of every agent's turn); every method then replays the same turns:

- a segment's first reader owns it: its cache of the segment (its base) is never modified; an
  agent's answer is a new segment owned by it;
- an agent holds its head and its own view of everything up to its last turn (prefix caching);
- a non-owner turn reads the segments others own since: ``builder.build`` returns its cache and
  first-token logits; that call, timed as a whole (median of repeats), is the turn's TTFT:
  process CPU time with one torch thread (wall time is recorded too, as ``ttft_wall_s``).

Per (method, turn) it records teacher-forced top-1 / KL vs no sharing over the reference
continuation, greedy exact match / first divergence, per-layer KV relative error on the read
tokens, TTFT, recomputed tokens and bytes held (bases + leaves + correction state + heads).

    python benchmark/lab/kvcmas_lab.py --quick          # debate 3 x 3, 128-token answers; HEADLINE
    python benchmark/lab/kvcmas_lab.py --workload both --instances 3 --rounds 3 --agents 4

``--model-path`` (``model_arg``; Llama or Qwen2 with a ChatML template): every
method runs on that model; records name it, and the result files get ``_<model>`` for a model
other than the embedded one.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sglang_kvcmas_bench.lab.records import (
    JsonlWriter,
    TurnMetrics,
    format_table,
    plot_methods,
    summarize,
)
from sglang_kvcmas_bench.lab.reference import fidelity_bundle, load_lab_model
from sglang_kvcmas_bench.lab.transcripts import Transcript, make_transcript
from sglang_kvcmas_bench.lab.workloads import debate, reviewer_chain
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_lab.correction import ReadRequest, SharedRead, create_builder
from sglang_kvcmas_lab.correction.fidelity import kv_relative_error
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

CHOICE = {"estimator": "sparse", "rho": 0.25, "score": "attn", "num_first": 4}

# name -> (registry name, kwargs). Order = table order. "kvcmas_impact" was the previous choice
# (layer-1 signals, 16 boundary tokens): measured weaker once answers are 128 tokens.
METHODS: dict[str, tuple[str, dict]] = {
    "no_sharing": ("no_sharing", {}),
    "prefix_caching": ("prefix_caching", {}),
    "naive": ("naive", {}),
    "cacheblend_5": ("cacheblend", {"rho": 0.05}),
    "cacheblend_15": ("cacheblend", {"rho": 0.15}),
    "cacheblend_30": ("cacheblend", {"rho": 0.30}),
    "kvcomm": ("kvcomm", {}),
    **{f"oracle_r{r}": ("oracle", {"rank": r}) for r in (1, 2, 4, 8, 16)},
    # The chosen estimator (by the ablations below): exact sparse tokens picked by the deep-layer
    # attention the suffix pays them (one probe pass over the uncorrected cache), few boundary
    # tokens forced (the probe finds the sinks that matter on its own).
    "kvcmas": ("kvcmas", CHOICE),
    # Ablations, each one change from the choice. Selector and boundary width:
    "kvcmas_impact": ("kvcmas", {**CHOICE, "rho": 0.05, "score": "impact", "num_first": 16}),
    "kvcmas_v": ("kvcmas", {**CHOICE, "score": "v"}),
    "kvcmas_attn_v": ("kvcmas", {**CHOICE, "score": "attn_v"}),
    "kvcmas_first16": ("kvcmas", {**CHOICE, "num_first": 16}),
    "kvcmas_first1": ("kvcmas", {**CHOICE, "num_first": 1}),
    # ... the budget of exact tokens:
    **{f"kvcmas_rho{round(100 * rho)}": ("kvcmas", {**CHOICE, "rho": rho})
       for rho in (0.1, 0.15, 0.35)},
    # ... and the low-rank predictors of the other tokens on top of the same exact tokens:
    **{f"kvcmas_{est}": ("kvcmas", {**CHOICE, "estimator": est})
       for est in ("transfer", "online", "interp")},
}


# --quick's subset (fits its budget): every baseline, the oracle at r = 4, 8, 16, the choice and
# the ablations that bound it (previous selector, boundary width, budget, low-rank on top).
QUICK_METHODS = ("no_sharing", "prefix_caching", "naive", "cacheblend_5", "cacheblend_15",
                 "cacheblend_30", "kvcomm", "oracle_r4", "oracle_r8", "oracle_r16", "kvcmas",
                 "kvcmas_impact", "kvcmas_first16", "kvcmas_rho15", "kvcmas_rho35",
                 "kvcmas_transfer", "kvcmas_interp")

# Builds that are dense prefills (seconds each, stable CPU time) or the oracle bound: --quick
# times them once to stay within its budget; the sharing methods keep the median of --repeats.
DENSE_BUILDS = ("no_sharing", "prefix_caching", "kvcomm", "oracle")


def is_stateful(reg: str, kw: dict) -> bool:
    """Methods whose state carries across workflow instances (replayed on history instances)."""
    return reg == "kvcomm" or (reg == "kvcmas" and kw.get("estimator") == "online")


# ---- replay one method over a transcript ------------------------------------------------
@dataclass
class SegState:
    owner: str
    base: KVCache  # owner's cache of the segment (owner positions); never modified
    depth: int  # corrections the base's own context went through (0 = exact)


@dataclass
class AgentState:
    views: list[KVCache] = field(default_factory=list)  # its view of segments 0..len-1
    depths: list[int] = field(default_factory=list)


def parse_method(spec: str) -> tuple[str, str, dict]:
    """``label`` from METHODS, or ``label=registry:key=value,...`` for an ad-hoc variant."""
    if "=" not in spec.split(":")[0]:
        reg, kw = METHODS[spec]
        return spec, reg, dict(kw)
    label, rest = spec.split("=", 1)
    reg, _, args = rest.partition(":")
    kw = {}
    for item in filter(None, args.split(",")):
        k, v = item.split("=")
        try:
            kw[k] = int(v)
        except ValueError:
            try:
                kw[k] = float(v)
            except ValueError:
                kw[k] = v
    return label, reg, kw


def run_method(model: RefLlama, tr: Transcript, label: str, builder, head_caches: dict,
               repeats: int, greedy: bool, writer, config, log,
               greedy_tokens: int | None = None, measure: bool = True):
    """Replay ``tr`` with ``builder`` (whose online state carries over between calls).
    Returns (records, builder after the run). ``measure=False``: history only (no metrics)."""
    if not measure:
        repeats, greedy = 1, False
    wl = tr.workload
    segs: list[SegState] = []
    agents = {a: AgentState() for a in wl.agents}
    leaves_bytes: dict[tuple[int, str], int] = {}
    peak_working = 0
    records = []
    for ti, turn in enumerate(tr.turns):
        ag = agents[turn.agent]
        head = head_caches[turn.agent]
        held = len(ag.views)
        prefix = KVCache.concat([head, *ag.views]) if ag.views else head
        prefix_ids = torch.cat([tr.heads[turn.agent], *turn.seg_ids[:held]])
        pos = len(prefix)
        reads, own_new = [], []
        for j in range(held, len(turn.seg_ids)):
            ids = turn.seg_ids[j]
            p = torch.arange(pos, pos + ids.numel())
            if j >= len(segs):  # nobody computed it yet: this reader owns it
                own_new.append(j)
            else:
                slot = "task" if j == 0 else f"a{j}"
                reads.append(SharedRead(j, segs[j].owner, ids, segs[j].base, p, slot))
            pos += ids.numel()
        is_owner = not reads
        if is_owner:
            # Owner turn (exact for every method): prefill its new segments + suffix on its own.
            ids = torch.cat([*(turn.seg_ids[j] for j in own_new), turn.suffix_ids])
            c0, t0 = time.process_time(), time.perf_counter()
            out = model.forward(ids, past=prefix)
            ttft, times = time.process_time() - c0, ()
            wall = time.perf_counter() - t0
            cache = KVCache.concat([prefix, out.kv])
            last = out.logits[-1]
            start = len(prefix)
            for j in own_new:
                n = turn.seg_ids[j].numel()
                v = cache.slice(start, start + n)
                segs.append(SegState(turn.agent, v, 0))
                ag.views.append(v)
                ag.depths.append(0)
                start += n
            views, recomputed, info, read_depth = (), 0, {}, 0
        else:
            assert not own_new, "a reader only owns segments nobody read before it"
            ref_views = None
            if builder.needs_reference:
                ref_views, s = [], len(prefix)
                for r in reads:
                    ref_views.append(turn.ref.cache.slice(s, s + r.ids.numel()))
                    s += r.ids.numel()
                ref_views = tuple(ref_views)
            req = ReadRequest(turn.agent, prefix, prefix_ids, tuple(reads), turn.suffix_ids,
                              ref_views)
            # Each timed repeat runs on its own copy of the method's state (made beforehand).
            copies = [copy.deepcopy(builder) for _ in range(max(1, repeats))]
            # TTFT = this process's CPU time for the whole build (1 torch thread): on a machine
            # shared with other jobs, wall time mostly measures their load, not the method.
            times, walls = [], []
            for b in copies:
                c0, t0 = time.process_time(), time.perf_counter()
                res = b.build(model, req)
                times.append(time.process_time() - c0)
                walls.append(time.perf_counter() - t0)
            builder = copies[-1]
            ttft = sorted(times)[len(times) // 2]
            wall = sorted(walls)[len(walls) // 2]
            times = tuple(times)
            cache, last, views = res.cache, res.last_logits, res.views
            recomputed, info = res.recomputed_tokens, res.info
            for r, leaf in zip(reads, res.leaves):
                leaves_bytes[(r.segment_id, turn.agent)] = leaf.nbytes()
            read_depth = 1 + max(segs[r.segment_id].depth for r in reads)
            ag.views.extend(views)
            ag.depths.extend(segs[r.segment_id].depth + 1 for r in reads)
        # The agent's answer: a new segment it owns, computed over its own cache.
        ans = turn.answer_seg[turn.suffix_ids.numel():]
        out = model.forward(ans, past=cache)
        n_suf = turn.suffix_ids.numel()
        base = KVCache.concat([cache.slice(len(cache) - n_suf, len(cache)), out.kv])
        segs.append(SegState(turn.agent, base, 0 if is_owner else read_depth))
        ag.views.append(base)
        ag.depths.append(0 if is_owner else read_depth)
        peak_working = max(peak_working, len(cache) + ans.numel())
        # Metrics.
        if not measure:
            continue
        if is_owner:  # exact by construction for every method (nothing read from others)
            fid = {"top1": 1.0, "mean_kl": 0.0, "max_kl": 0.0}
        else:
            fid = fidelity_bundle(model, turn.ref, cache, last, greedy=greedy,
                                  greedy_tokens=greedy_tokens)
        kerr = verr = []
        if views:
            s0 = len(prefix)
            n = sum(v.positions.numel() for v in views)
            ref_read = turn.ref.cache.slice(s0, s0 + n)
            got = KVCache.concat(list(views))
            kerr = kv_relative_error(ref_read.k, got.k)
            verr = kv_relative_error(ref_read.v, got.v)
        spec = model.spec
        per_tok = spec.kv_bytes_per_token(model.dtype)
        heads_b = sum(len(h) for h in head_caches.values()) * per_tok
        if builder.persistent:
            bytes_held = (heads_b + sum(len(s.base) for s in segs) * per_tok
                          + sum(leaves_bytes.values()) + builder.state_nbytes())
        else:
            bytes_held = peak_working * per_tok
        m = TurnMetrics(
            method=label, workload=wl.name, instance=wl.instance, turn=ti, agent=turn.agent,
            is_owner_turn=is_owner, prompt_tokens=int(turn.ref.cache.positions.numel()),
            shared_tokens=int(sum(s.numel() for s in turn.seg_ids)),
            new_shared_tokens=int(sum(r.ids.numel() for r in reads)),
            chain_depth=int(read_depth), top1=fid["top1"], mean_kl=fid["mean_kl"],
            max_kl=fid["max_kl"], greedy_exact=fid.get("greedy_exact", float("nan")),
            first_divergence=fid.get("first_divergence", -1), ttft_s=ttft, ttft_times_s=times,
            bytes_held=int(bytes_held), recomputed_tokens=int(recomputed), kv_rel_err_k=kerr,
            kv_rel_err_v=verr, extra={**info, "num_reads": len(reads), "ttft_wall_s": wall})
        rec = m.as_dict()
        writer.write({**config, "method": label, "builder": builder.describe()}, rec)
        records.append(rec)
    return records, builder


# ---- driver ----------------------------------------------------------------------------------
def headline(summary: dict, method: str = "kvcmas") -> str:
    k, nv, ns, kc = (summary[m] for m in (method, "naive", "no_sharing", "kvcomm"))
    kl_rec = 1.0 - k["mean_kl"] / nv["mean_kl"] if nv["mean_kl"] > 0 else float("nan")
    return (f"HEADLINE method={method} kl_recovered={kl_rec:.3f} "
            f"ttft_speedup={ns['ttft_s'] / k['ttft_s']:.2f} "
            f"bytes_ratio_vs_kvcomm={kc['bytes_held'] / k['bytes_held']:.2f} top1={k['top1']:.3f}")


def add_derived(summary: dict) -> None:
    nv, ns = summary.get("naive"), summary.get("no_sharing")
    for row in summary.values():
        if nv and nv["mean_kl"] > 0:
            row["kl_recovered"] = 1.0 - row["mean_kl"] / nv["mean_kl"]
        if ns:
            row["ttft_speedup"] = ns["ttft_s"] / row["ttft_s"] if row["ttft_s"] else float("nan")
        if "kvcomm" in summary:
            row["bytes_vs_kvcomm"] = summary["kvcomm"]["bytes_held"] / max(1, row["bytes_held"])


COLUMNS = ["n", "top1", "mean_kl", "kl_recovered", "greedy_exact", "first_divergence", "ttft_s",
           "ttft_speedup", "recomputed_frac", "bytes_held", "bytes_vs_kvcomm", "kv_err_k",
           "kv_err_v"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 10 min on 2 cores)")
    ap.add_argument("--workload", choices=("debate", "chain", "both"), default="debate")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--first-instance", type=int, default=0)
    ap.add_argument("--warmup-instances", type=int, default=2,
                    help="earlier instances replayed first by stateful methods (KVCOMM anchors, "
                         "KVCMAS online state) as a server's history; not measured")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--cont-tokens", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--essay-chars", default="4000",
                    help="essay length in characters; a comma list cycles over instances")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dense-repeats", type=int, default=None,
                    help="timed repeats for methods whose build is dense prefill (no sharing, "
                         "prefix caching, KVCOMM) and for the oracle bound; default --repeats")
    ap.add_argument("--no-greedy", action="store_true")
    ap.add_argument("--methods", default=None,
                    help="';'-separated METHODS labels or label=registry:k=v,k=v; or all "
                         "(--quick: its QUICK_METHODS subset unless given)")
    ap.add_argument("--threads", type=int, default=1,
                    help="1 is faster than 2 on a shared 2-core machine")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="folder of kvcmas_lab[_quick][_<model>].{jsonl,png} (default: results/)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    bench_model = model_from_args(ap, args, lab=True)
    if args.quick:
        # The serving benchmark's debate (3 agents x 3 rounds, 128-token answers), one measured
        # instance after one history instance for the stateful methods.
        args.instances, args.agents, args.rounds, args.warmup_instances = 1, 3, 3, 1
        args.answer_tokens, args.repeats, args.greedy_tokens = 128, 3, 16
        args.dense_repeats = 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start, c_start = time.perf_counter(), time.process_time()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = bench_model.named(Path(f"kvcmas_lab{'_quick' if args.quick else ''}")).name
    jsonl = out_dir / f"{stem}.jsonl"
    jsonl.unlink(missing_ok=True)
    writer = JsonlWriter(jsonl, model=bench_model.name)
    if args.methods is None:
        args.methods = ";".join(QUICK_METHODS) if args.quick else "all"
    specs = list(METHODS) if args.methods == "all" else args.methods.split(";")
    for must in ("no_sharing", "naive") + (("kvcomm", "kvcmas") if args.quick else ()):
        if must not in [sp.split("=")[0] for sp in specs]:
            specs.append(must)
    methods = [parse_method(sp) for sp in specs]
    labels = [m[0] for m in methods]

    tok, model = load_lab_model(bench_model, torch.float32)
    log(f"model {bench_model.name} ({bench_model.folder.name}): {model.spec}")

    workloads = []  # (workload, measured?)
    first = args.first_instance
    for i in range(first, first + args.warmup_instances + args.instances):
        measured = i >= first + args.warmup_instances
        if args.workload in ("debate", "both"):
            workloads.append((debate(i, args.agents, args.rounds), measured))
        if args.workload in ("chain", "both"):
            lengths = [int(x) for x in str(args.essay_chars).split(",")]
            workloads.append((reviewer_chain(i, lengths[i % len(lengths)]), measured))
    builders: dict[tuple[str, str], object] = {}

    records = []
    # Stateful methods (KVCOMM anchors, KVCMAS online state) keep state across instances of the
    # same workload, as a server would: run instances in order inside one builder per method.
    for wl, measured in workloads:
        log(f"transcript {wl.name}#{wl.instance}: {len(wl.turns)} turns, agents {wl.agents}"
            f"{'' if measured else ' (history for stateful methods, not measured)'}")
        tr = make_transcript(model, tok, wl, args.answer_tokens, args.cont_tokens, log)
        head_caches = {a: model.forward(h).kv for a, h in tr.heads.items()}
        for label, reg, kw in methods:
            if not measured and not is_stateful(reg, kw):
                continue
            builder = builders.get((wl.name, label)) or create_builder(reg, **kw)
            config = {"workload": wl.name, "instance": wl.instance, "agents": len(wl.agents),
                      "rounds": args.rounds, "answer_tokens": args.answer_tokens,
                      "cont_tokens": args.cont_tokens, "greedy_tokens": args.greedy_tokens,
                      "repeats": args.dense_repeats if reg in DENSE_BUILDS and
                      args.dense_repeats is not None else args.repeats,
                      "dtype": "float32", "threads": args.threads, "quick": args.quick}
            t0 = time.perf_counter()
            reps = args.repeats
            if reg in DENSE_BUILDS and args.dense_repeats is not None:
                reps = args.dense_repeats
            recs, builders[(wl.name, label)] = run_method(
                model, tr, label, builder, head_caches, reps, not args.no_greedy,
                writer, config, log, args.greedy_tokens, measure=measured)
            records.extend(recs)
            if not measured:
                log(f"  {label:16s} history ({time.perf_counter() - t0:.1f}s)")
                continue
            nonown = [r for r in recs if not r["is_owner_turn"]]
            kl = sum(r["mean_kl"] for r in nonown) / max(1, len(nonown))
            log(f"  {label:16s} mean_kl {kl:.5f}  ttft {sum(r['ttft_s'] for r in nonown):.2f}s "
                f"({time.perf_counter() - t0:.1f}s)")

    nonowner = summarize(records, where=lambda r: not r["is_owner_turn"])
    add_derived(nonowner)
    table = format_table(nonowner, COLUMNS, order=labels)
    print("\nNon-owner turns (all workloads):\n" + table)
    for wname in sorted({w.name for w, _ in workloads}):
        s = summarize(records, where=lambda r, w=wname: not r["is_owner_turn"] and r["workload"] == w)
        add_derived(s)
        print(f"\n[{wname}] non-owner turns:\n" + format_table(s, COLUMNS, order=labels))
    print_breakdowns(records, labels)
    print_turn_recovery(records, labels)
    about = (f"KVCMAS lab, {args.workload} workload ({bench_model.name}), methods "
             f"{', '.join(labels)}")

    def png(path: Path) -> None:
        plot_methods(nonowner, path,
                     panels=[("ttft_speedup", "kl_recovered",
                              "fidelity vs speed (non-owner turns)"),
                             ("bytes_held", "kl_recovered", "fidelity vs bytes held")],
                     title=f"KVCMAS lab: "
                           f"{'SmolLM2-135M' if bench_model.is_embedded else bench_model.name} "
                           "fp32, CPU")

    record(out_dir / f"{stem}.png", png,
           what=f"its plot: fidelity against speed and bytes held, non-owner turns ({about})")
    main_wl = "debate" if args.workload in ("debate", "both") else "chain"
    s = summarize(records, where=lambda r: not r["is_owner_turn"] and r["workload"] == main_wl)
    add_derived(s)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    log(f"done; records in {jsonl}; process CPU time {time.process_time() - c_start:.0f}s "
        f"(~ wall time on an idle machine, 1 thread), load average {load}")
    line = (headline(s) if all(m in s for m in ("kvcmas", "naive", "no_sharing", "kvcomm"))
            else "HEADLINE unavailable: needs kvcmas, naive, no_sharing and kvcomm")
    record(jsonl, None, what=f"{about}: one record per method and turn; `{line}`")
    print(line)
    return 0


def turn_recovery(records: list[dict], method: str) -> list[float]:
    """Per non-owner turn: 1 - KL(method) / KL(naive) on that turn (same workload, instance)."""
    key = lambda r: (r["workload"], r["instance"], r["turn"])  # noqa: E731
    naive = {key(r): r["mean_kl"] for r in records
             if r["method"] == "naive" and not r["is_owner_turn"]}
    return [1 - r["mean_kl"] / naive[key(r)] for r in records
            if r["method"] == method and not r["is_owner_turn"] and naive.get(key(r), 0) > 0]


def print_turn_recovery(records: list[dict], labels: list[str]) -> None:
    """The headline's kl_recovered is a ratio of means: the turns with the largest naive KL
    weigh most. Per-turn recovery (median, worst) shows whether it holds turn by turn."""
    print("\nKL recovered per non-owner turn (ratio within each turn): median / min / max")
    for m in labels:
        v = sorted(turn_recovery(records, m))
        if v and m not in ("no_sharing", "naive"):
            print(f"{m:18s} {statistics.median(v):8.3f} {v[0]:8.3f} {v[-1]:8.3f}   (n={len(v)})")


def print_breakdowns(records: list[dict], labels: list[str]) -> None:
    """KL recovered (vs naive in the same bucket) by chain depth and by transcript length, for
    the correction methods: how fidelity and the oracle rank it needs change with both."""
    interesting = [m for m in labels if m.startswith(("kvcmas", "oracle", "cacheblend"))]
    nonown = [r for r in records if not r["is_owner_turn"]]
    for key, name in (("chain_depth", "chain depth"), ("shared_tokens", "shared tokens")):
        def bucket(r, key=key):
            return f"{(r[key] // 256) * 256}+" if key == "shared_tokens" else str(r[key])

        buckets = sorted({bucket(r) for r in nonown}, key=lambda b: int(b.rstrip("+")))

        def kl(m, b):
            rs = [r["mean_kl"] for r in nonown if r["method"] == m and bucket(r) == b]
            return sum(rs) / len(rs) if rs else float("nan")

        print(f"\nKL recovered vs naive by {name} (non-owner turns; naive mean KL, n in header):")
        ns = {b: sum(1 for r in nonown if r["method"] == "naive" and bucket(r) == b)
              for b in buckets}
        print("method".ljust(18) + "".join(f"{b}(n={ns[b]})".rjust(14) for b in buckets))
        print("naive KL".ljust(18) + "".join(f"{kl('naive', b):.5f}".rjust(14) for b in buckets))
        for m in interesting:
            cells = [1 - kl(m, b) / kl("naive", b) if kl("naive", b) > 0 else float("nan")
                     for b in buckets]
            print(m.ljust(18) + "".join(f"{c:.3f}".rjust(14) for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
