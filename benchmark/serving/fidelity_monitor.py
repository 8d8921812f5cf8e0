"""The fidelity monitor and exactness that adapts to load, end to end on SGLang's server.

Three phases, each one server at a time through SGLang's OpenAI chat route (streamed; answers
go back as assistant messages, ``sglang_kvcmas_bench.chat_workloads``):

- ``fault``: a sharing server with a fault injected (``--kvcmas-recompute-boundary 0
  --kvcmas-recompute-mass-fraction 0``: readers recompute nothing) and every reader turn sampled
  (``--kvcmas-fidelity-share 1``) serves waves of concurrent code-review panels. Reported: the
  sampled turns until the loop first raised what readers recompute (``detect_samples``), each
  level's top-1 agreement with exact serving over its samples, the level the loop settled at
  and whether the agreement there is back at the target.
- ``idle``: one debate at a time (GSM8K, three agents, three rounds), under radix and under
  sharing with the defaults: the same final answer as radix's (``same_answer_idle``) and the
  median TTFT, radix's over ours (``ttft_ratio_idle``).
- ``loaded``: ``--loaded-flows`` concurrent panels under radix and under sharing with the
  defaults: the same verdict as radix's (``same_answer_loaded``), non-owner TTFT radix's over
  ours on the turns that borrowed (``ttft_speedup_loaded``), and the monitor's cost: the tokens
  its exact prefills computed over all tokens the server computed (workflow prefill and decode,
  head requests, the monitor: ``monitor_overhead``), and the reader turns it sampled over the
  configured share.

``jcr`` (judge consistency against exact serving on the capable model) comes from the quality
benchmark's full run, not from here: the line prints ``jcr=n/a``.

    python benchmark/serving/fidelity_monitor.py --quick       # all three phases
    python benchmark/serving/fidelity_monitor.py --phases fault --fault-waves 4
    python benchmark/serving/fidelity_monitor.py --quick --phases idle --idle-debates 6 --profile

``--profile`` samples each arm's scheduler with py-spy while the idle and loaded phases run and
writes where its time went (``sglang_kvcmas_bench.scheduler_profile``) beside the result.

Writes ``results/fidelity_monitor[_quick][_<model>].json`` and its index row (server logs under
``results/fidelity_monitor[_quick]/``) and prints a ``HEADLINE`` line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from sglang_kvcmas_bench.chat_workloads import Workload, answer_of, build, chat, run_flow
from sglang_kvcmas_bench.figures import fmt
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.scheduler_profile import SchedulerProfile
from sglang_kvcmas_bench.scheduler_profile import report as profile_report
from sglang_kvcmas_bench.server_arms import ArmServer, kvcmas_state, run_header

RESULTS = Path(__file__).resolve().parent / "results"
FAULT_FLAGS = ["--kvcmas-recompute-boundary", "0", "--kvcmas-recompute-mass-fraction", "0",
               "--kvcmas-fidelity-share", "1"]
"""The injected fault: readers recompute nothing; every reader turn is sampled."""
TARGET = 0.99
"""The loop's top-1 agreement target (``policy.fidelity.AGREEMENT_TARGET``)."""
SHARE = 0.02
"""The default sampled share (``--kvcmas-fidelity-share``)."""


def say(text: str) -> None:
    print(f"[fidelity] {text}", file=sys.stderr, flush=True)


def _served(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=60).read())["data"][0][
        "id"]


def _fresh(w: Workload) -> None:
    for flow in w.agents:  # the next server starts from the opening messages again
        for agent in flow:
            del agent.messages[2:]


def _run(url: str, served: str, w: Workload, tag: str, at_once: bool) -> list[dict]:
    if at_once:
        with ThreadPoolExecutor(w.flows) as pool:
            flows = list(pool.map(lambda f: run_flow(url, served, w, f, tag), range(w.flows)))
    else:
        flows = [run_flow(url, served, w, f, tag) for f in range(w.flows)]
    return [asdict(t) for flow in flows for t in flow]


def _metric(url: str, name: str, labels: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text,
                       re.MULTILINE)
    return sum(float(v) for v in found)


# ----- phases -----


def fault_phase(model, tok, args, logs: Path) -> dict:
    """Waves of concurrent panels on a server with the fault injected, until the loop has held
    one level for ``--settle`` samples (or ``--fault-waves`` waves ran)."""
    w = build("panel", tok, args.fault_flows, args.fault_answer, args.agents, args.doc_tokens)
    waves = []
    with ArmServer("kvcmas", logs / "fault.log",
                   [*model.server_args, "--max-total-tokens", str(args.pool), *FAULT_FLAGS]
                   ) as server:
        served = _served(server.url)
        for wave in range(args.fault_waves):
            t0 = time.perf_counter()
            turns = _run(server.url, served, w, f"fault{wave}", at_once=True)
            _fresh(w)
            state = kvcmas_state(server.url).get("fidelity") or {}
            waves.append({"wave": wave, "seconds": time.perf_counter() - t0,
                          "turns": len(turns), "sampled": state.get("sampled"),
                          "steps": state.get("steps", [])})
            say(f"fault wave {wave}: {state.get('sampled')} sampled, steps "
                f"{[(s['from'], s['to'], s['samples']) for s in state.get('steps', [])]}")
            recent = state.get("recent", [])
            steps = state.get("steps", [])
            if steps and sum(1 for r in recent if r["level"] == steps[-1]["to"]) >= args.settle:
                break
        state = kvcmas_state(server.url).get("fidelity") or {}
    return summarize_fault(state, waves)


def summarize_fault(state: dict, waves: list[dict]) -> dict:
    """Detection, each level's agreement, and where the loop settled."""
    steps, recent = state.get("steps", []), state.get("recent", [])
    by_level: dict[int, list[int]] = {}
    for r in recent:
        agreed, positions = by_level.setdefault(r["level"], [0, 0])
        by_level[r["level"]] = [agreed + r["agreed"], positions + r["positions"]]
    agreement = {lvl: a / p for lvl, (a, p) in sorted(by_level.items()) if p}
    ups = [s for s in steps if s["to"] > s["from"]]
    settled = steps[-1]["to"] if steps else 0
    return {"waves": waves, "steps": steps, "recent": recent, "agreement_by_level": agreement,
            "detect_samples": ups[0]["samples"] if ups else None,
            "settled_level": settled, "settled_agreement": agreement.get(settled),
            "recovered": bool(ups) and (agreement.get(settled) or 0.0) >= TARGET}


def _each_arm(phase: str, w: Workload, at_once: bool, model, args, logs: Path,
              kvcmas_extra=None) -> dict:
    """``w`` under radix, then under sharing (defaults), one server at a time: each arm's turns,
    makespan and monitor state, plus ``kvcmas_extra(url)``'s entries for the sharing arm."""
    out = {}
    for arm in ("radix", "kvcmas"):
        with ArmServer(arm, logs / f"{phase}_{arm}.log",
                       [*model.server_args, "--max-total-tokens", str(args.pool)]) as server:
            served = _served(server.url)
            chat(server.url, served, [{"role": "user", "content": "Warm up."}], 2, "warmup")
            raw = logs / f"profile_{phase}_{arm}.raw"
            spy = SchedulerProfile(server.proc.pid, raw).start() if args.profile else None
            t0 = time.perf_counter()
            turns = _run(server.url, served, w, f"{phase}-{arm}", at_once=at_once)
            if spy is not None and spy.stop() is not None:
                record(logs.parent / f"{logs.name}_profile_{phase}_{arm}.txt",
                       profile_report(raw), what=f"py-spy profile of the {arm} scheduler "
                       f"during the {phase} phase")
            out[arm] = {"turns": turns, "makespan_s": time.perf_counter() - t0,
                        "fidelity": kvcmas_state(server.url).get("fidelity")}
            if arm == "kvcmas" and kvcmas_extra is not None:
                out[arm].update(kvcmas_extra(server.url))
            say(f"{phase} {arm}: {out[arm]['makespan_s']:.1f} s")
        _fresh(w)
    return out


def idle_phase(model, tok, args, logs: Path) -> dict:
    """Debates one at a time, under radix and under sharing (defaults)."""
    w = build("debate", tok, args.idle_debates, args.idle_answer, 3, args.doc_tokens)
    out = _each_arm("idle", w, False, model, args, logs)
    return compare(out, "debate") | {"arms": out}


def _cost(url: str) -> dict:
    """What the loaded run's workflows and head requests computed."""
    flows = json.loads(urllib.request.urlopen(url + "/kvcmas/workflows?limit=1000",
                                              timeout=60).read())["workflows"]
    return {"workflow_computed": sum(f["computed"] for f in flows
                                     if f["workflow"].startswith("loaded-")),
            "head_prefilled": _metric(url, "kvcmas:head_prefill_tokens_total",
                                      'kind="prefilled"')}


def loaded_phase(model, tok, args, logs: Path) -> dict:
    """``--loaded-flows`` panels at once, under radix and under sharing (defaults)."""
    w = build("panel", tok, args.loaded_flows, args.loaded_answer, args.agents, args.doc_tokens)
    out = _each_arm("loaded", w, True, model, args, logs, _cost)
    result = compare(out, "panel") | {"arms": out}
    mon = out["kvcmas"].get("fidelity") or {}
    spent = mon.get("prefilled_tokens", 0)
    total = out["kvcmas"]["workflow_computed"] + out["kvcmas"]["head_prefilled"] + spent
    result["monitor_overhead"] = spent / total if total else None
    result["monitor_sampled"] = mon.get("sampled")
    result["monitor_reader_turns"] = mon.get("reader_turns")
    result["sampled_share"] = (mon.get("sampled", 0) / mon["reader_turns"]
                               if mon.get("reader_turns") else None)
    return result


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def compare(arms: dict, workload: str) -> dict:
    """Same final answers as radix, and TTFT (radix's over ours): every turn's median, and that
    of the turns that borrowed under sharing (non-owners) against the same turns under radix."""
    key = lambda t: (t["flow"], t["round"], t["agent"])
    rt = {key(t): t for t in arms["radix"]["turns"]}
    mine = arms["kvcmas"]["turns"]
    last = max(t["round"] for t in mine)
    finals = [t for t in mine if t["round"] == last]
    same = sum(answer_of(workload, t["text"]) == answer_of(workload, rt[key(t)]["text"])
               for t in finals)
    readers = [t for t in mine if t["borrowed"]]
    ours_all, radix_all = _median([t["ttft_s"] for t in mine]), _median(
        [t["ttft_s"] for t in arms["radix"]["turns"]])
    ours_nonowner = _median([t["ttft_s"] for t in readers])
    radix_nonowner = _median([rt[key(t)]["ttft_s"] for t in readers])
    return {"same_answer": same / len(finals) if finals else None, "finals": len(finals),
            "same_text": sum(t["text"] == rt[key(t)]["text"] for t in mine) / len(mine),
            "ttft_ratio": radix_all / ours_all if ours_all else None,
            "ttft_ratio_nonowner": (radix_nonowner / ours_nonowner
                                    if ours_nonowner and radix_nonowner else None),
            "readers": len(readers), "turns": len(mine),
            "makespan_ratio": arms["radix"]["makespan_s"] / arms["kvcmas"]["makespan_s"]}


def headline(result: dict) -> str:
    fault, idle, loaded = (result.get(k) or {} for k in ("fault", "idle", "loaded"))
    return ("HEADLINE "
            f"monitor_overhead={fmt(loaded.get('monitor_overhead'), 4)} "
            f"detect_samples={fault.get('detect_samples')} "
            f"same_answer_idle={fmt(idle.get('same_answer'), 2)} "
            f"ttft_ratio_idle={fmt(idle.get('ttft_ratio'), 2)} "
            f"same_answer_loaded={fmt(loaded.get('same_answer'), 2)} "
            f"ttft_speedup_loaded={fmt(loaded.get('ttft_ratio_nonowner'), 2)} jcr=n/a")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the sizes below marked (quick)")
    p.add_argument("--phases", default="fault,loaded,idle")
    p.add_argument("--fault-flows", type=int, default=4)
    p.add_argument("--fault-waves", type=int, default=4)
    p.add_argument("--fault-answer", type=int, default=32)
    p.add_argument("--settle", type=int, default=8,
                   help="samples at the level the loop last moved to before the fault phase "
                   "stops")
    p.add_argument("--idle-debates", type=int, default=20)
    p.add_argument("--idle-answer", type=int, default=256, help="(quick: 48)")
    p.add_argument("--loaded-flows", type=int, default=16)
    p.add_argument("--loaded-answer", type=int, default=64, help="(quick: 32)")
    p.add_argument("--agents", type=int, default=3, help="reviewers per panel")
    p.add_argument("--doc-tokens", type=int, default=1200, help="(quick: 600)")
    p.add_argument("--pool", type=int, default=60000)
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", action="store_true",
                   help="py-spy each arm's scheduler in the idle and loaded phases")
    p.add_argument("--keep", type=Path, help="a result file of this benchmark: the phases not "
                   "run now are taken from it (each phase records the commit it ran at)")
    add_model_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.idle_answer, args.loaded_answer, args.doc_tokens = 48, 32, 600
    model = model_from_args(p, args)
    tok = model.tokenizer()
    out = args.out or model.named(RESULTS / ("fidelity_monitor" + ("_quick" if args.quick
                                                                     else "") + ".json"))
    logs = out.parent / out.stem  # ignored by git: server logs
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = run_header("benchmark/serving/fidelity_monitor.py", argv, model)
    phases = {"fault": fault_phase, "idle": idle_phase, "loaded": loaded_phase}
    if args.keep:
        kept = json.loads(args.keep.read_text())
        for name in phases:
            if name in kept and name not in args.phases.split(","):
                result[name] = {**kept[name], "commit": kept[name].get("commit",
                                                                       kept.get("commit"))}
    for name in args.phases.split(","):
        t0 = time.perf_counter()
        result[name] = phases[name](model, tok, args, logs)
        result[name]["phase_s"] = time.perf_counter() - t0
        result[name]["commit"] = result.get("commit")
        say(f"{name}: {time.perf_counter() - t0:.0f} s")
    line = headline(result)
    result["headline"] = line
    record(out, json.dumps(result, indent=1, default=str),
           what="fidelity monitor: fault detection and recovery, idle and loaded answers, TTFT "
                "and the monitor's cost")
    fault = result.get("fault") or {}
    if fault:
        print(f"fault: detected after {fault['detect_samples']} samples; agreement by level "
              f"{ {k: round(v, 4) for k, v in fault['agreement_by_level'].items()} }; settled "
              f"at level {fault['settled_level']} (recovered: {fault['recovered']})")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
