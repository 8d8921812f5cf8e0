"""How well the spend forecaster predicts a run's total spend, and what a budget saves with it.

Input: runs recorded by ``record_runs.py`` (``results/record_runs_<variant>.jsonl``; each run's
turns as the server's ledger saw them, in finish order). Spend is *computed* tokens (prefill +
decode; ``policy/spend_forecast.py``), and the prompt tokens read as a second measure.

- ``--fit``: fit the forecaster on every run and write its artifact
  (``python/sglang_kvcmas/policy/spend_forecast.json``, shipped with the package).
- Default: the benchmark, by ``--folds``-fold cross-validation split by run (seed ``--seed``):
  each run is forecast by a model fitted on the other folds' runs only. Per run, at 25 / 50 / 75%
  of its turns (turn ``k = round(p * T)``, clamped to ``1..T-1``): the absolute percentage error
  of the total forecast; the median over runs (MAPE, as a median) beside two naive forecasters:

  - ``naive_linear``: the spend so far scaled by ``T / k``; it is told the run's final turn
    count ``T``, which no server knows (an optimistic naive);
  - ``naive_mean``: the mean total of the training runs (at least the spend so far).

  Also: how often the interval holds the true total, per kind, forecaster milliseconds per turn
  (state update + forecast, pure Python), and a budget replay: each held-out run replayed turn
  by turn against a fixed per-run budget (the training runs' median total): ``cap`` refuses a
  turn once the spend reaches the budget; ``forecast`` also refuses once the forecast's low end
  is past the budget times ``m`` (``m = 1`` is the server's rule; the smallest ``m`` of a grid
  that keeps the training runs' completion rate equal to ``cap``'s is chosen per fold, on the
  training runs). A run *completes* when it reaches its own end without a refusal. The embedded
  model cannot do these tasks (its answers are mostly wrong), so task success is not measured:
  the saving is reported at equal **completion** rate, labelled so.

Writes ``results/forecast_bench_<variant>.txt`` and ends with
``HEADLINE mape_at_50pct=<x> naive_mape_at_50pct=<x> forecast_ms=<x> budget_tokens_saved=<x>``
(``naive`` = ``naive_linear``, the stronger naive).

    python benchmark/serving/forecast_bench.py --fit
    python benchmark/serving/forecast_bench.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from sglang_kvcmas.policy import spend_forecast as sf  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POINTS = (0.25, 0.5, 0.75)
M_GRID = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)


def load_runs(path: Path) -> list[dict]:
    """Recorded runs with ``turns``: the ledger's turns (else the responses' usage), >= 2."""
    runs, seen = [], set()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        turns = rec.get("ledger_turns") or [
            {"agent": t.get("agent"), "prompt_tokens": t.get("prompt_tokens", 0),
             "recomputed": t.get("kvcmas_recomputed", t.get("prompt_tokens", 0)),
             "completion_tokens": t.get("completion_tokens", 0)}
            for t in rec.get("usage_turns", [])]
        key = (rec["kind"], rec["qid"])
        if len(turns) >= 2 and key not in seen:  # a run recorded twice counts once
            seen.add(key)
            runs.append({"kind": rec["kind"], "qid": rec["qid"], "turns": turns})
    return runs


def prefix_states(turns: list[dict]) -> list[sf.TrajectoryState]:
    """The state after each turn (index k-1: after k turns)."""
    states, state, seen = [], sf.TrajectoryState(), set()
    for t in turns:
        agent = t.get("agent")
        state = state.add(int(t["prompt_tokens"]), int(t["recomputed"]),
                          int(t["completion_tokens"]), agent is not None and agent not in seen)
        seen.add(agent)
        states.append(state)
    return states


def at(p: float, n_turns: int) -> int:
    return min(n_turns - 1, max(1, round(p * n_turns)))


def replay(states: list[sf.TrajectoryState], model: sf.SpendForecaster | None, budget: int,
           m: float) -> tuple[int, bool]:
    """Spend and completion of one run under a budget: a turn is refused once the spend so far
    reaches ``budget``, or (with ``model``) the forecast's low end passes ``budget * m``."""
    for state in states[:-1]:
        if state.computed >= budget:
            return state.computed, False
        if model is not None and model.forecast(state).low > budget * m:
            return state.computed, False
    return states[-1].computed, True


def budget_outcome(runs: list[list[sf.TrajectoryState]], model: sf.SpendForecaster | None,
                   budget: int, m: float) -> tuple[int, int]:
    spent = done = 0
    for states in runs:
        s, ok = replay(states, model, budget, m)
        spent, done = spent + s, done + ok
    return spent, done


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="embedded", help="record_runs_<variant>.jsonl to read")
    p.add_argument("--fit", action="store_true", help="fit on every run, write the artifact")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ridge", type=float, default=3.0)
    args = p.parse_args()
    src = RESULTS / f"record_runs_{args.variant}.jsonl"
    runs = load_runs(src)
    kinds = sorted({r["kind"] for r in runs})
    print(f"{len(runs)} runs from {src.name}: " +
          ", ".join(f"{k} {sum(r['kind'] == k for r in runs)}" for k in kinds), file=sys.stderr)
    if args.fit:
        model = sf.fit([r["turns"] for r in runs], ridge=args.ridge,
                       fitted_on=f"{len(runs)} runs of {src.name} ("
                                 + ", ".join(f"{k} {sum(r['kind'] == k for r in runs)}"
                                             for k in kinds) + ")")
        sf.ARTIFACT.write_text(json.dumps(model.to_json(), indent=1) + "\n")
        print(f"wrote {sf.ARTIFACT} ({sf.ARTIFACT.stat().st_size} bytes)", file=sys.stderr)
        return 0

    order = list(range(len(runs)))
    random.Random(args.seed).shuffle(order)
    fold_of = {i: n % args.folds for n, i in enumerate(order)}
    states = [prefix_states(r["turns"]) for r in runs]
    ape: dict[str, dict[float, list[float]]] = {
        name: {q: [] for q in POINTS} for name in ("forecast", "naive_linear", "naive_mean",
                                                    "prompt_forecast")}
    by_kind: dict[str, list[float]] = defaultdict(list)
    covered = {q: [] for q in POINTS}
    timings: list[float] = []
    cap_spent = cap_done = fc_spent = fc_done = rule_spent = rule_done = 0
    budgets, ms_chosen = [], []
    sweep = {m: [0, 0] for m in M_GRID}  # m -> [spent, completed] over held-out runs
    for f in range(args.folds):
        train = [i for i in order if fold_of[i] != f]
        test = [i for i in order if fold_of[i] == f]
        if not test or len(train) < 2:
            continue
        model = sf.fit([runs[i]["turns"] for i in train], ridge=args.ridge)
        totals = [states[i][-1].computed for i in train]
        mean_total = statistics.fmean(totals)
        for i in test:
            ss, final = states[i], states[i][-1]
            n = len(ss)
            for q in POINTS:
                s = ss[at(q, n) - 1]
                fc = model.forecast(s)
                ape["forecast"][q].append(abs(fc.total - final.computed) / final.computed)
                ape["prompt_forecast"][q].append(
                    abs(fc.prompt_total - final.prompt_tokens) / final.prompt_tokens)
                ape["naive_linear"][q].append(abs(s.computed * n / s.turns - final.computed)
                                              / final.computed)
                ape["naive_mean"][q].append(abs(max(mean_total, s.computed) - final.computed)
                                            / final.computed)
                covered[q].append(fc.low <= final.computed <= fc.high)
                if q == 0.5:
                    by_kind[runs[i]["kind"]].append(ape["forecast"][q][-1])
            state, seen = sf.TrajectoryState(), set()
            t0 = time.perf_counter()
            for t in runs[i]["turns"]:
                state = state.add(int(t["prompt_tokens"]), int(t["recomputed"]),
                                  int(t["completion_tokens"]),
                                  t.get("agent") is not None and t.get("agent") not in seen)
                seen.add(t.get("agent"))
                model.forecast(state)
            timings.append((time.perf_counter() - t0) * 1000 / n)
        budget = int(statistics.median(totals))
        budgets.append(budget)
        train_states = [states[i] for i in train]
        _, cap_train = budget_outcome(train_states, None, budget, 1.0)
        m = next((m for m in M_GRID
                  if budget_outcome(train_states, model, budget, m)[1] == cap_train), M_GRID[-1])
        ms_chosen.append(m)
        test_states = [states[i] for i in test]
        s, d = budget_outcome(test_states, None, budget, 1.0)
        cap_spent, cap_done = cap_spent + s, cap_done + d
        s, d = budget_outcome(test_states, model, budget, m)
        fc_spent, fc_done = fc_spent + s, fc_done + d
        s, d = budget_outcome(test_states, model, budget, 1.0)
        rule_spent, rule_done = rule_spent + s, rule_done + d
        for mm in M_GRID:
            s, d = budget_outcome(test_states, model, budget, mm)
            sweep[mm][0] += s
            sweep[mm][1] += d

    n_runs = len(ape["forecast"][0.5])
    med = {name: {q: statistics.median(v[q]) for q in POINTS} for name, v in ape.items()}
    ms = statistics.median(timings)
    lines = [f"# command: python benchmark/serving/forecast_bench.py --variant {args.variant} "
             f"--folds {args.folds} --seed {args.seed} --ridge {args.ridge}",
             f"runs: {len(runs)} from {src.name} (" + ", ".join(
                 f"{k} {sum(r['kind'] == k for r in runs)}" for k in kinds) + "); "
             f"{args.folds}-fold cross-validation split by run (seed {args.seed}): every run "
             "forecast by a model fitted on the other folds",
             "turns per run: " + ", ".join(
                 f"{k} {min(len(r['turns']) for r in runs if r['kind'] == k)}-"
                 f"{max(len(r['turns']) for r in runs if r['kind'] == k)}" for k in kinds),
             "total computed tokens per run (prefill + decode): " + ", ".join(
                 f"{k} {min(s[-1].computed for s, r in zip(states, runs) if r['kind'] == k)}-"
                 f"{max(s[-1].computed for s, r in zip(states, runs) if r['kind'] == k)}"
                 for k in kinds),
             "",
             "median absolute percentage error of the total forecast, at 25/50/75% of each run "
             f"({n_runs} held-out runs):",
             f"  {'forecaster':44s} {'25%':>7s} {'50%':>7s} {'75%':>7s}"]
    names = {"forecast": "spend_forecast (computed tokens)",
             "naive_linear": "naive_linear (spend x T/k; told T)",
             "naive_mean": "naive_mean (training runs' mean total)",
             "prompt_forecast": "spend_forecast (prompt tokens read)"}
    for name, label in names.items():
        lines.append(f"  {label:44s} " + " ".join(f"{pct(med[name][q]):>7s}" for q in POINTS))
    lines.append("interval (nominal 10-90%) holds the true total: " + ", ".join(
        f"{int(100 * q)}% {pct(sum(covered[q]) / len(covered[q]))}" for q in POINTS))
    lines.append("forecast MdAPE at 50% by kind: " + ", ".join(
        f"{k} {pct(statistics.median(v))} ({len(v)})" for k, v in sorted(by_kind.items())))
    lines.append(f"forecaster: {ms:.4f} ms per turn (median over runs; state update + "
                 "forecast, pure Python)")
    saved = cap_spent - fc_spent
    lines += ["",
              f"budget replay (held-out runs; per-fold budget = training runs' median total: "
              f"{', '.join(map(str, budgets))} computed tokens):",
              f"  cap (refuse once spent >= budget):        spent {cap_spent} tokens, "
              f"completed {cap_done}/{n_runs}",
              f"  forecast, m=1 (server rule: low > budget): spent {rule_spent} tokens, "
              f"completed {rule_done}/{n_runs}",
              f"  forecast, m chosen on training runs ({', '.join(f'{m:g}' for m in ms_chosen)})"
              f": spent {fc_spent} tokens, completed {fc_done}/{n_runs}",
              f"  tokens saved vs cap (chosen m): {saved} ({pct(saved / cap_spent)}) at "
              f"completion {fc_done}/{n_runs} vs {cap_done}/{n_runs}",
              "  for context, every m of the grid on the held-out runs (not used to choose): "
              + ", ".join(f"m={mm:g} {v[0]} tokens {v[1]}/{n_runs}" for mm, v in sweep.items()),
              "  completion = the run reached its own end without a refusal; the embedded model "
              "cannot do these tasks, so this is NOT task success",
              "",
              f"HEADLINE mape_at_50pct={med['forecast'][0.5]:.3f} "
              f"naive_mape_at_50pct={med['naive_linear'][0.5]:.3f} forecast_ms={ms:.4f} "
              f"budget_tokens_saved={saved}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (RESULTS / f"forecast_bench_{args.variant}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
