"""PReCache lab: LoRA-specialized agents (planner, solver, critic) share one transcript cache.

A plan -> solve -> critique workflow over GSM8K questions (items 0..; the adapters trained on
200..) builds one ChatML transcript; the agents differ only by LoRA adapter (same system prompt,
same turn opener). The transcript is generated once with no sharing (dense, adapter on, greedy).
Every method then replays it segment by segment (``LoraSharingMethod.append``) and after every
segment each agent reads it as the next speaker would:

- fidelity: the reader's view + its turn opener, 32 continuation tokens of the no-sharing greedy
  output teacher-forced: top-1 agreement and mean KL (``sglang_kvcmas_bench.lab`` / ``correction.fidelity``);
  greedy exact match and first divergence are read off teacher forcing (greedy decoding agrees
  with the reference exactly until the first teacher-forced top-1 miss; tested in
  test/lab/correction/test_precache.py);
- time to first token: the method's whole critical path (catch-up prefill, input encoding,
  rebuilds, recompute, split reads, the opener), all methods timed side by side per reader,
  median of repeats; ``rebase_alongside``'s rebuild is reported separately as background work;
- bytes held for the 3 agents; batched-decode throughput of the 3 agents (see ``throughput``).

HEADLINE and the summary cover readers that did not compute the shared context themselves
(every reader except the planner at the first two points, which read only what it computed).
HEADLINE's method is the sharing method with the highest KL recovered among those holding at most
half of no sharing's bytes. Methods: ``correction/lora_baselines.py`` (no_sharing, sglang, naive,
droidspeak), ``correction/precache_methods.py`` (first_agent, prelr_shared, rebase_*) and
``correction/precache_delta.py`` (rebase_mean_delta<r>[m]: centroid store + rank-r leaves of
each agent's own pass, per segment or merged ``m``; its background work is N agent passes).

    python benchmark/lab/precache_lab.py --quick        # 1 question; prints HEADLINE
    python benchmark/lab/precache_lab.py --questions 3 --max-message 64 --config attn_mlp
    python benchmark/lab/precache_lab.py --questions 3 --fidelity-only --methods naive ...

``--model-path`` (``model_arg``) is taken for a uniform command line, but the role
adapters (``sglang_kvcmas/adapters``) are trained for the embedded model: any other model is
refused with that message. Records name the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import sglang_kvcmas_lab.correction.lora_baselines  # noqa: F401  (registration)
import sglang_kvcmas_lab.correction.precache_block  # noqa: F401  (registration)
import sglang_kvcmas_lab.correction.precache_delta  # noqa: F401  (registration)
import sglang_kvcmas_lab.correction.precache_methods  # noqa: F401  (registration)
import torch
from sglang_kvcmas.adapters import ROLES
from sglang_kvcmas.adapters.role_data import TURN_OPENER
from sglang_kvcmas_bench.lab.decode_throughput import batched_decode_throughput
from sglang_kvcmas_bench.lab.precache_setup import (
    ADAPTERS_ARE_EMBEDDED,
    build_transcript,
    cached_transcript,
    fidelity,
    load,
)
from sglang_kvcmas_bench.lab.records import (
    JsonlWriter,
    TurnMetrics,
    format_table,
    plot_methods,
    summarize,
)
from sglang_kvcmas_bench.lab.reference import encode, make_reference
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_examples.datasets import gsm8k
from sglang_kvcmas_lab.correction.fidelity import teacher_forced
from sglang_kvcmas_lab.correction.lora_baselines import FIRST_READER
from sglang_kvcmas_lab.correction.lora_forward import AgentModel, LoraForward
from sglang_kvcmas_lab.correction.precache_base import create_lora_method

# label -> (registry name, kwargs); table order.
METHODS: dict[str, tuple[str, dict]] = {
    "no_sharing": ("no_sharing", {}),
    "sglang": ("sglang", {}),
    "sglang_alongside": ("sglang_alongside", {}),
    "naive": ("naive", {}),
    "first_agent": ("first_agent", {}),
    "droidspeak": ("droidspeak", {}),
    "prelr_shared": ("prelr_shared", {}),
    "prelr_shared[keys=base]": ("prelr_shared", {"keys": "base"}),
    "prelr_shared[read=materialize]": ("prelr_shared", {"read": "materialize"}),
    "rebase_after_turn": ("rebase_after_turn", {}),
    "rebase_alongside": ("rebase_alongside", {}),
    "rebase_after_turn[keys=base]": ("rebase_after_turn", {"keys": "base"}),
    "rebase_fixup15": ("rebase_fixup", {"fixup_rho": 0.15}),
    "rebase_fixup30": ("rebase_fixup", {"fixup_rho": 0.30}),
    "rebase_mean": ("rebase_mean", {}),
    "rebase_mean_fixup15": ("rebase_mean_fixup", {"fixup_rho": 0.15}),
    "rebase_mean_fixup30": ("rebase_mean_fixup", {"fixup_rho": 0.30}),
    "rebase_mean_fixup50": ("rebase_mean_fixup", {"fixup_rho": 0.50}),
    "rebase_mean_alongside": ("rebase_mean_alongside", {}),
    "rebase_mean_block": ("rebase_mean_block", {}),
    "rebase_mean_delta2": ("rebase_mean_delta", {"rank": 2}),
    "rebase_mean_delta4": ("rebase_mean_delta", {"rank": 4}),
    "rebase_mean_delta8": ("rebase_mean_delta", {"rank": 8}),
    "rebase_mean_delta4[v_only]": ("rebase_mean_delta", {"rank": 4, "delta_keys": False}),
    "rebase_mean_delta4m": ("rebase_mean_delta", {"rank": 4, "merged": True}),
    "rebase_mean_delta6m": ("rebase_mean_delta", {"rank": 6, "merged": True}),
    "rebase_mean_delta8m": ("rebase_mean_delta", {"rank": 8, "merged": True}),
    "rebase_mean_delta4c256": ("rebase_mean_delta", {"rank": 4, "chunk": 256}),
    "rebase_mean_delta6c256": ("rebase_mean_delta", {"rank": 6, "chunk": 256}),
}
QUICK_METHODS = ("no_sharing", "sglang", "sglang_alongside", "naive", "first_agent", "droidspeak",
                 "prelr_shared", "rebase_after_turn", "rebase_alongside", "rebase_mean",
                 "rebase_mean_alongside", "rebase_mean_fixup15", "rebase_mean_delta4",
                 "rebase_mean_delta4c256", "rebase_mean_delta6m")
REFERENCE, NAIVE = "no_sharing", "naive"
NON_SHARING = ("no_sharing", "sglang", "sglang_alongside")


def log(msg: str) -> None:
    print(f"[precache_lab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@torch.inference_mode()
def adapter_sanity(lora: LoraForward, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per agent: KL(adapter on || base) and top-1 agreement over the transcript."""
    base = lora.forward(ids, agent=None).logits
    out = {}
    for agent, role in enumerate(ROLES):
        tf = teacher_forced(lora.forward(ids, agent=agent).logits, base)
        out[role] = {"kl_on_vs_base": tf.mean_kl, "top1_on_vs_base": tf.top1}
    return out


def profile_droidspeak(lora, method, segs_upto, refs, suffix, width: int) -> int:
    """Pick the block start (multiples of width) with the lowest mean KL on the first point."""
    best, best_kl = 0, float("inf")
    for start in range(0, lora.spec.num_layers - width + 1, width):
        method.start, method.width = start, width
        kls = [fidelity(lora, method.view(r), r, suffix, refs[r])["mean_kl"] for r in refs]
        log(f"{method.name} profile: layers [{start}, {start + width}) "
            f"mean KL {statistics.mean(kls):.4f}")
        if statistics.mean(kls) < best_kl:
            best, best_kl = start, statistics.mean(kls)
    method.start = best
    return best


def time_side_by_side(closures: dict[str, object], repeats: int) -> dict[str, list[float]]:
    """Interleave methods within each repeat so that machine noise hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in closures}
    for _ in range(repeats):
        for name, fn in closures.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def headline_numbers(summary: dict, bytes_final: dict) -> dict[str, dict[str, float]]:
    ref, naive = summary[REFERENCE], summary[NAIVE]
    out = {}
    for name, row in summary.items():
        kl_rec = 1.0 - row["mean_kl"] / naive["mean_kl"] if naive["mean_kl"] > 0 else float("nan")
        out[name] = {**row, "kl_recovered": kl_rec,
                     "ttft_speedup": ref["ttft_s"] / row["ttft_s"],
                     "bytes_ratio": bytes_final[REFERENCE] / bytes_final[name]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 question, short messages (< 10 min)")
    ap.add_argument("--config", default="attn_mlp", choices=["attn", "attn_mlp"])
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--first-question", type=int, default=0)
    ap.add_argument("--max-message", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--cont-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--droidspeak-width", type=int, default=6)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--last-points", type=int, default=0,
                    help="read only at the last N points (long-transcript studies; 0: all)")
    ap.add_argument("--fidelity-only", action="store_true",
                    help="skip timing and throughput (exploring accuracy; no HEADLINE)")
    # One thread: on a shared 2-core machine two OpenMP threads stall for seconds at a time.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="folder of precache_lab_<config>[_quick].{jsonl,txt,png} (default: "
                         "results/); the no-sharing transcript is kept in its precache_lab/")
    add_model_arg(ap)
    args = ap.parse_args()
    model = model_from_args(ap, args, embedded_only=ADAPTERS_ARE_EMBEDDED)
    if args.quick:  # one question, and the variants that only answer design questions dropped
        args.questions, args.max_message = 1, min(args.max_message, 64)
        args.methods = [m for m in args.methods if m in QUICK_METHODS]
    for must in (REFERENCE, NAIVE):
        if must not in args.methods:
            args.methods.insert(0, must)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{args.config}{'_quick' if args.quick else ''}"
    writer = JsonlWriter(out_dir / f"precache_lab_{tag}.jsonl", model=model.name)
    config = {k: v for k, v in vars(args).items() if k != "out"}

    lora, tok = load(args.config, model)
    items = gsm8k()[args.first_question : args.first_question + args.questions]
    segs = cached_transcript(out_dir / "precache_lab", args, lambda: build_transcript(
        lora, tok, [it.question for it in items], args.max_message, args.max_tokens))
    all_ids = torch.cat([s.ids for s in segs])
    log(f"transcript: {len(segs)} segments, {all_ids.numel()} tokens")
    sanity = adapter_sanity(lora, all_ids)
    log(f"adapter on vs base over the transcript: {json.dumps(sanity)}")
    writer.write({**config, "kind": "adapter_sanity"}, sanity)

    suffix = encode(tok, TURN_OPENER)
    methods = {label: create_lora_method(METHODS[label][0], name=label, **METHODS[label][1])
               for label in args.methods}
    for m in methods.values():
        m.reset(lora)
    records, bytes_final, bg_times = [], {}, {}
    first_reader_of = []
    for t, seg in enumerate(segs):
        first_reader_of.append(FIRST_READER if seg.writer is None else seg.writer)
        for m in methods.values():
            m.append(seg)
        if args.last_points and t < len(segs) - args.last_points:
            continue
        ctx = torch.cat([s.ids for s in segs[: t + 1]])
        refs = {r: make_reference(AgentModel(lora, r), torch.cat([ctx, suffix]), args.cont_tokens)
                for r in range(len(ROLES))}
        for m in methods.values():  # droidspeak and rebase_mean_block: profile the block
            if t == 1 and hasattr(m, "width"):
                profile_droidspeak(lora, m, t, {r: refs[r] for r in refs if r != seg.writer},
                                   suffix, args.droidspeak_width)
        for reader, role in enumerate(ROLES):
            closures = {k: m.first_token(reader, suffix) for k, m in methods.items()}
            if args.fidelity_only:
                times = {k: [float("nan")] for k in closures}
            else:
                if t == 0 and reader == 0:
                    time_side_by_side(closures, 1)  # warm-up
                times = time_side_by_side(closures, args.repeats)
            owner = set(first_reader_of) == {reader}
            for label, m in methods.items():
                fid = fidelity(lora, m.view(reader), reader, suffix, refs[reader])
                extra = {"writer": seg.writer, "describe": m.describe()}
                bg = getattr(m, "background_work", lambda: None)()
                if bg is not None and not args.fidelity_only:  # the same work for every reader
                    if (label, t) not in bg_times:
                        bg_times[label, t] = time_side_by_side({"bg": bg}, 1)["bg"][0]
                    extra["background_s"] = bg_times[label, t]
                recomputed = 0
                if hasattr(m, "width"):  # a recomputed block of layers
                    recomputed = ctx.numel() * m.width // lora.spec.num_layers
                tm = TurnMetrics(
                    method=label, workload="gsm8k_plan_solve_critique", instance=0, turn=t,
                    agent=role, is_owner_turn=owner, prompt_tokens=ctx.numel() + suffix.numel(),
                    shared_tokens=ctx.numel(), new_shared_tokens=seg.ids.numel(), chain_depth=t,
                    ttft_s=statistics.median(times[label]), ttft_times_s=tuple(times[label]),
                    bytes_held=m.bytes_held(len(ROLES)), recomputed_tokens=recomputed,
                    extra=extra, **fid)
                records.append(tm.as_dict())
                writer.write({**config, "kind": "turn"}, tm.as_dict())
                bytes_final[label] = tm.bytes_held
        row = {k: round(r["mean_kl"], 4) for k, r in
               ((r["method"], r) for r in records[-len(methods):])}
        log(f"point {t + 1}/{len(segs)} ({ctx.numel()} tokens, writer {seg.writer}) done; "
            f"critic KL {row}")

    shared = [r for r in records if not r["is_owner_turn"]]
    summary = headline_numbers(summarize(shared), bytes_final)
    thr = {} if args.fidelity_only else batched_decode_throughput(
        lora, segs, methods, suffix, num_tokens=8 if args.quick else 16)
    for name, row in summary.items():
        row.update(thr.get(name, {}))
        bgs = [r["extra"]["background_s"] for r in shared
               if r["method"] == name and "background_s" in r["extra"]]
        row["background_median_s"] = statistics.median(bgs) if bgs else float("nan")
        writer.write({**config, "kind": "summary", "method": name}, row)
    cols = ["n", "top1", "mean_kl", "kl_recovered", "greedy_exact", "first_divergence",
            "ttft_median_s", "ttft_speedup", "bytes_ratio", "kv_err_v", "decode_tok_s",
            "background_median_s"]
    table = format_table(summary, cols, order=list(methods))
    print(table)
    about = (f"PReCache lab, {args.config} adapters, {args.questions} question(s), "
             f"{all_ids.numel()}-token transcript, methods {', '.join(methods)}")
    record(out_dir / f"precache_lab_{tag}.png", lambda p: plot_methods(
        summary, p, panels=[("ttft_speedup", "kl_recovered", "accuracy vs time to first token"),
                            ("bytes_ratio", "top1", "top-1 vs bytes saved")],
        title=f"PReCache lab ({args.config}, {all_ids.numel()} tokens)"),
        what=f"its plot: accuracy against TTFT and top-1 against bytes saved ({about})")
    if args.fidelity_only:
        record(out_dir / f"precache_lab_{tag}.txt", table + "\n", what=f"{about}: the table")
        record(writer.path, None, what=f"{about}: one record per read, the summaries")
        return
    sharing = {k: v for k, v in summary.items() if k not in NON_SHARING and v["bytes_ratio"] >= 2}
    best = max(sharing, key=lambda k: (round(sharing[k]["kl_recovered"], 3),
                                       sharing[k]["ttft_speedup"]))
    b = summary[best]
    log(f"run time {time.perf_counter() - t_start:.0f} s")
    line = (f"HEADLINE method={best} top1={b['top1']:.3f} kl_recovered={b['kl_recovered']:.3f} "
            f"ttft_speedup={b['ttft_speedup']:.2f} bytes_ratio={b['bytes_ratio']:.2f}")
    record(out_dir / f"precache_lab_{tag}.txt", table + "\n" + line + "\n",
           what=f"{about}: the table; `{line}`")
    record(writer.path, None, what=f"{about}: one record per read, the summaries; `{line}`")
    print(line)


if __name__ == "__main__":
    main()
