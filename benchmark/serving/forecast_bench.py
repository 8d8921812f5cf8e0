"""How well the spend forecaster predicts a run's total spend, and what a budget saves with it.

Input: runs recorded by ``record_runs.py`` (``results/record_runs[_<kinds>][_<variant>][_<model>]
.jsonl``, named by ``--runs`` without the ``.jsonl``; one or more, each a *variant* here: e.g. the
embedded model's runs and the capable model's; each run's turns as the
server's ledger saw them, in finish order). Spend is *computed* tokens (prefill + decode;
``policy/spend_forecast.py``), and the prompt tokens read as a second measure.

- ``--fit``: fit the forecaster on every run of the variants (one model's) and write the
  artifact the server loads for that model (``python/sglang_kvcmas/policy/spend_forecast.json``
  for the embedded model, ``spend_forecast_<model>.json`` beside it for another known model;
  ``--out`` elsewhere, for ``--kvcmas-forecast-artifact``), shipped with the package.
- Default: the benchmark, by ``--folds``-fold cross-validation split by run (seed ``--seed``):
  each run is forecast by a model fitted on the other folds' runs of the same served model
  only (as shipped: one artifact per model). Per run, at 25 / 50 / 75%
  of its turns (turn ``k = round(p * T)``, clamped to ``1..T-1``): the absolute percentage error
  of the total forecast; the median over runs (MAPE, as a median), overall and per variant,
  beside naive forecasters:

  - ``naive_rate`` (the naive baseline of the headline): the spend so far extrapolated at its
    rate per turn to the training runs' mean turn count (at least one more turn) -- what a
    server could run without a model;
  - ``naive_linear``: the spend so far scaled by ``T / k``; it is *told* the run's final turn
    count ``T``, which no server knows (an oracle, reported for context);
  - ``naive_mean``: the mean total of the training runs (at least the spend so far).

  Also: how often the interval holds the true total, per kind, forecaster milliseconds per turn
  (state update + forecast, pure Python), and per variant a budget replay: each held-out run
  replayed turn by turn against a fixed per-run budget (the variant's training runs' median
  total): ``cap`` refuses a turn once the spend reaches the budget; ``forecast`` also refuses
  once the forecast's low end is past the budget times ``m`` (``m = 1`` is the server's rule;
  the smallest ``m`` of a grid that keeps the training runs' success count equal to ``cap``'s
  is chosen per fold, on the training runs). A run *succeeds* when it reaches its own end
  without a refusal and, where the recording graded it (``outcome.correct``: its final answer
  against GSM8K's, or the HumanEval problem's tests), its answer is right; variants without
  grades (the embedded model, which cannot do the tasks) are judged on completion only,
  labelled so. Runs recorded with graded versions (``outcome.versions``: the writer's answer
  after each of its turns, in the review kinds) are *shortened* by a refusal instead of
  failed: the frontend stops and submits its latest version, which succeeds when right.

Writes ``results/forecast_bench[_<name>].txt`` (``--name``, default what the runs' names add to
``record_runs``, joined by ``+``)
and a plot beside it (``.png``: error against the share of the run seen, per forecaster; the
budget replay's tokens and successes per variant), and ends with
``HEADLINE mape_at_50pct=<x> naive_mape_at_50pct=<x> forecast_ms=<x> budget_tokens_saved=<x>``
(MAPE over every held-out run; ``naive`` = ``naive_rate``; tokens saved on the first graded
variant, else the first variant).

    python benchmark/serving/forecast_bench.py --runs record_runs --fit
    python benchmark/serving/forecast_bench.py --runs record_runs_pal_qwen2-5-coder-0-5b --fit
    python benchmark/serving/forecast_bench.py --runs record_runs,record_runs_pal_qwen2-5-coder-0-5b
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sglang_kvcmas.policy import spend_forecast as sf
from sglang_kvcmas_bench import forecast_fit
from sglang_kvcmas_bench.results import record

RESULTS = Path(__file__).resolve().parent / "results"
POINTS = (0.25, 0.5, 0.75)
M_GRID = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
UNBOUNDED = 1 << 62  # a budget no run reaches


def with_in_flight(ledger_turns: list[dict], usage_turns: list[dict]) -> list[dict]:
    """The ledger's turns, each with ``in_flight`` (the run's requests started and unfinished
    when it finished) where the recording lacks it: requests started before the turn's finish
    (the client's send times) minus the turns finished by then (the ledger's clock, the same
    machine's)."""
    if all("in_flight" in t for t in ledger_turns):
        return ledger_turns
    starts = sorted(t["t0"] for t in usage_turns if "t0" in t)
    if len(starts) != len(ledger_turns) or any("t" not in t for t in ledger_turns):
        return ledger_turns
    return [{**t, "in_flight": max(0, bisect.bisect_left(starts, t["t"]) - (k + 1))}
            for k, t in enumerate(ledger_turns)]


def load_runs(path: Path) -> list[dict]:
    """Recorded runs with ``turns``: the ledger's turns (else the responses' usage), >= 2; and
    ``correct``: whether the run's final answer was right (None when not recorded);
    ``versions``: ``(turns done, right)`` per graded version of a writer's answer (review
    kinds recorded with versions; else empty)."""
    runs, seen = [], set()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        turns = with_in_flight(rec.get("ledger_turns") or [], rec.get("usage_turns", [])) or [
            {"agent": t.get("agent"), "prompt_tokens": t.get("prompt_tokens", 0),
             "recomputed": t.get("kvcmas_recomputed", t.get("prompt_tokens", 0)),
             "completion_tokens": t.get("completion_tokens", 0)}
            for t in rec.get("usage_turns", [])]
        key = (rec["kind"], rec["qid"])
        if len(turns) >= 2 and key not in seen:  # a run recorded twice counts once
            seen.add(key)
            runs.append({"kind": rec["kind"], "qid": rec["qid"], "turns": turns,
                         "variant": path.stem,
                         "model": rec.get("model", "embedded"),
                         "correct": (rec.get("outcome") or {}).get("correct"),
                         "versions": [tuple(v) for v in
                                      (rec.get("outcome") or {}).get("versions", [])
                                      if isinstance(v[1], bool)]})
    return runs


def at(p: float, n_turns: int) -> int:
    return min(n_turns - 1, max(1, round(p * n_turns)))


def replay(states: list[sf.TrajectoryState], model: sf.SpendForecaster | None, budget: int,
           m: float) -> tuple[int, int]:
    """Spend and turns run of one run under a budget: a turn is refused once the spend so far
    reaches ``budget``, or (with ``model``) the forecast's low end passes ``budget * m``; the
    run stops there (all ``len(states)`` turns run: it reached its own end)."""
    for k, state in enumerate(states[:-1]):
        if state.computed >= budget:
            return state.computed, k + 1
        if model is not None and model.forecast(state).low > budget * m:
            return state.computed, k + 1
    return states[-1].computed, len(states)


@dataclass(frozen=True)
class ReplayRun:
    """One held-out run for the budget replay: its states turn by turn, whether its final answer
    was right (None: not graded), and, for runs whose writer submits versions, ``versions``:
    ``(turns done, that version right)`` -- a run stopped early submits its latest version."""

    states: list[sf.TrajectoryState]
    correct: bool | None
    versions: tuple[tuple[int, bool], ...] = ()

    def succeeded(self, turns: int) -> bool:
        """Whether the run, stopped after ``turns`` turns, succeeds: at its own end, when its
        answer was not graded wrong; stopped early, when its latest version by then was right
        (a run without versions fails)."""
        if turns == len(self.states):
            return self.correct is not False
        return next((ok for t, ok in reversed(self.versions) if t <= turns), False)


def replay_run(run: dict, states: list[sf.TrajectoryState]) -> ReplayRun:
    return ReplayRun(states, run["correct"], tuple(run["versions"]))


def budget_outcome(runs: list[ReplayRun], model: sf.SpendForecaster | None, budget: int,
                   m: float) -> tuple[int, int]:
    """Tokens spent and runs succeeded over ``runs``."""
    spent = done = 0
    for run in runs:
        s, turns = replay(run.states, model, budget, m)
        spent, done = spent + s, done + run.succeeded(turns)
    return spent, done


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def describe(runs: list[dict]) -> str:
    kinds = sorted({r["kind"] for r in runs})
    return ", ".join(f"{k} {sum(r['kind'] == k for r in runs)}" for k in kinds)


@dataclass
class Replay:
    """One variant's budget replay over its held-out runs."""

    graded: bool
    shortens: bool = False  # refused runs submit their latest graded version
    runs: int = 0
    budgets: list[int] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    free: list[int] = field(default_factory=lambda: [0, 0])  # spent, succeeded: no budget
    cap: list[int] = field(default_factory=lambda: [0, 0])
    rule: list[int] = field(default_factory=lambda: [0, 0])
    chosen: list[int] = field(default_factory=lambda: [0, 0])
    sweep: dict[float, list[int]] = field(
        default_factory=lambda: {m: [0, 0] for m in M_GRID})

    def add(self, train: list, test: list, model: sf.SpendForecaster) -> None:
        budget = int(statistics.median(r.states[-1].computed for r in train))
        self.budgets.append(budget)
        _, cap_train = budget_outcome(train, None, budget, 1.0)
        m = next((m for m in M_GRID if budget_outcome(train, model, budget, m)[1] >= cap_train),
                 M_GRID[-1])
        self.ms.append(m)
        self.runs += len(test)
        for acc, (mod, bb, mm) in ((self.free, (None, UNBOUNDED, 1.0)),
                                   (self.cap, (None, budget, 1.0)),
                                   (self.rule, (model, budget, 1.0)),
                                   (self.chosen, (model, budget, m))):
            s, d = budget_outcome(test, mod, bb, mm)
            acc[0], acc[1] = acc[0] + s, acc[1] + d
        for mm in M_GRID:
            s, d = budget_outcome(test, model, budget, mm)
            self.sweep[mm][0] += s
            self.sweep[mm][1] += d

    @property
    def saved(self) -> int:
        return self.cap[0] - self.chosen[0]

    def lines(self, variant: str) -> list[str]:
        what = ("succeeded (submitted answer right)" if self.shortens else
                "succeeded (completed, answer right)" if self.graded else "completed")
        n = self.runs
        return [
            f"budget replay, {variant} ({n} held-out runs; per-fold budget = training runs' "
            f"median total: {', '.join(map(str, self.budgets))} computed tokens):",
            f"  no budget (every run to its own end):     spent {self.free[0]} tokens, "
            f"{what} {self.free[1]}/{n}",
            f"  cap (refuse once spent >= budget):        spent {self.cap[0]} tokens, "
            f"{what} {self.cap[1]}/{n}",
            f"  forecast, m=1 (server rule: low > budget): spent {self.rule[0]} tokens, "
            f"{what} {self.rule[1]}/{n}",
            f"  forecast, m chosen on training runs ({', '.join(f'{m:g}' for m in self.ms)}): "
            f"spent {self.chosen[0]} tokens, {what} {self.chosen[1]}/{n}",
            f"  tokens saved vs cap (chosen m): {self.saved} ({pct(self.saved / self.cap[0])}) "
            f"at {self.chosen[1]}/{n} vs {self.cap[1]}/{n} {what}",
            "  every m of the grid on the held-out runs (for context, not used to choose): "
            + ", ".join(f"m={mm:g} {v[0]} tokens {v[1]}/{n}" for mm, v in self.sweep.items()),
            ("  success = the answer the run submitted was right: at its own end its final "
             "answer; stopped by a refusal, its latest version (the frontend stops the run and "
             "submits it)" if self.shortens else
             "  success = the run's graded final answer was right and no turn was refused"
             if self.graded else "  completion = the run reached its own end without a "
             "refusal; these runs carry no grade (the model cannot do the tasks), so this is "
             "NOT task success")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="record_runs",
                   help="record_runs.py results to read, by name (results/<name>.jsonl: "
                        "record_runs[_<kinds>][_<variant>][_<model>]); several, comma-separated, "
                        "pooled")
    p.add_argument("--fit", action="store_true",
                   help="fit on every run of the variants (one model's), write the artifact the "
                        "server loads for that model (spend_forecast.json for the embedded "
                        "model, else spend_forecast_<model>.json beside it)")
    p.add_argument("--out", default=None, help="with --fit: write the artifact here instead")
    p.add_argument("--name", default=None,
                   help="results/forecast_bench_<name>.txt (default: what the runs' names add "
                        "to record_runs, joined by +; none for record_runs alone)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    variants = list(dict.fromkeys(v.strip() for v in args.runs.split(",") if v.strip()))
    runs = [r for v in variants for r in load_runs(RESULTS / f"{v}.jsonl")]
    for v in variants:
        print(f"{v}: {describe([r for r in runs if r['variant'] == v])}", file=sys.stderr)
    if args.fit:
        models = {r["model"] for r in runs}
        if args.out is None and len(models) != 1:
            p.error(f"--fit over runs of several models ({', '.join(sorted(models))}): "
                    "give --out")
        model_name = models.pop() if len(models) == 1 else None
        out = Path(args.out) if args.out else sf.ARTIFACT if model_name == "embedded" else \
            sf.ARTIFACT.with_name(f"spend_forecast_{model_name}.json")
        model = forecast_fit.fit([r["turns"] for r in runs], seed=args.seed, fitted_on="; ".join(
            f"{sum(r['variant'] == v for r in runs)} runs of {v}.jsonl "
            f"({describe([r for r in runs if r['variant'] == v])})" for v in variants))
        out.write_text(json.dumps(model.to_json(), separators=(",", ":")) + "\n")
        print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)
        return 0

    order = list(range(len(runs)))
    random.Random(args.seed).shuffle(order)
    fold_of = {i: n % args.folds for n, i in enumerate(order)}
    states = [sf.TrajectoryState.prefixes(r["turns"]) for r in runs]
    names = {"forecast": "spend_forecast (computed tokens)",
             "naive_rate": "naive_rate (spend/turn x mean turns)",
             "naive_linear": "naive_linear (spend x T/k; told T: oracle)",
             "naive_mean": "naive_mean (training runs' mean total)",
             "prompt_forecast": "spend_forecast (prompt tokens read)"}
    ape: dict[str, dict[float, list[tuple[str, float]]]] = {
        name: {q: [] for q in POINTS} for name in names}
    by_kind: dict[str, list[float]] = defaultdict(list)
    covered = {q: [] for q in POINTS}
    timings: list[float] = []
    replays = {v: Replay(graded=any(r["correct"] is not None for r in runs
                                    if r["variant"] == v),
                         shortens=any(r["versions"] for r in runs if r["variant"] == v))
               for v in variants}
    served = sorted({r["model"] for r in runs})
    for f, mdl in itertools.product(range(args.folds), served):
        train = [i for i in order if fold_of[i] != f and runs[i]["model"] == mdl]
        test = [i for i in order if fold_of[i] == f and runs[i]["model"] == mdl]
        if not test or len(train) < 2:
            continue
        model = forecast_fit.fit([runs[i]["turns"] for i in train], seed=args.seed)
        mean_total = statistics.fmean(states[i][-1].computed for i in train)
        mean_turns = statistics.fmean(len(states[i]) for i in train)
        for i in test:
            ss, final, v = states[i], states[i][-1], runs[i]["variant"]
            n = len(ss)
            for q in POINTS:
                s = ss[at(q, n) - 1]
                fc = model.forecast(s)
                guesses = {"forecast": fc.total,
                           "naive_rate": s.computed * max(mean_turns, s.turns + 1) / s.turns,
                           "naive_linear": s.computed * n / s.turns,
                           "naive_mean": max(mean_total, s.computed)}
                for name, guess in guesses.items():
                    ape[name][q].append((v, abs(guess - final.computed) / final.computed))
                ape["prompt_forecast"][q].append(
                    (v, abs(fc.prompt_total - final.prompt_tokens) / final.prompt_tokens))
                covered[q].append(fc.low <= final.computed <= fc.high)
                if q == 0.5:
                    by_kind[f"{runs[i]['kind']}@{v}"].append(ape["forecast"][q][-1][1])
            t0 = time.perf_counter()
            for state in sf.TrajectoryState.prefixes(runs[i]["turns"]):
                model.forecast(state)
            timings.append((time.perf_counter() - t0) * 1000 / n)
        for v, rep in replays.items():
            if any(runs[i]["variant"] == v for i in test):
                rep.add([replay_run(runs[i], states[i]) for i in train
                         if runs[i]["variant"] == v],
                        [replay_run(runs[i], states[i]) for i in test
                         if runs[i]["variant"] == v], model)

    def mdape(name: str, q: float, variant: str | None = None) -> float:
        return statistics.median(e for v, e in ape[name][q] if variant in (None, v))

    n_runs = len(ape["forecast"][0.5])
    ms = statistics.median(timings)
    lines = [f"# command: python benchmark/serving/forecast_bench.py --runs {args.runs} "
             f"--folds {args.folds} --seed {args.seed}" + (f" --name {args.name}"
                                                            if args.name else ""),
             f"runs: {len(runs)}; {args.folds}-fold cross-validation split by run (seed "
             f"{args.seed}): every run forecast by a model fitted on the other folds' runs of "
             "its own model (a model's forecaster is fitted on that model's runs, as shipped)"]
    for v in variants:
        vr = [(r, s) for r, s in zip(runs, states) if r["variant"] == v]
        kinds = sorted({r["kind"] for r, _ in vr})
        graded = [r["correct"] for r, _ in vr if r["correct"] is not None]
        lines += [f"{v}: {len(vr)} runs ({describe([r for r, _ in vr])})" +
                  (f"; answers right {sum(graded)}/{len(graded)}" if graded else "; not graded"),
                  "  turns per run: " + ", ".join(
                      f"{k} {min(len(s) for r, s in vr if r['kind'] == k)}-"
                      f"{max(len(s) for r, s in vr if r['kind'] == k)}" for k in kinds),
                  "  total computed tokens per run: " + ", ".join(
                      f"{k} {min(s[-1].computed for r, s in vr if r['kind'] == k)}-"
                      f"{max(s[-1].computed for r, s in vr if r['kind'] == k)}" for k in kinds)]
    lines += ["", "median absolute percentage error of the total forecast, at 25/50/75% of each "
              f"run ({n_runs} held-out runs):",
              f"  {'forecaster':46s} {'25%':>7s} {'50%':>7s} {'75%':>7s}"]
    for name, label in names.items():
        lines.append(f"  {label:46s} " + " ".join(f"{pct(mdape(name, q)):>7s}" for q in POINTS))
    if len(variants) > 1:
        for v in variants:
            lines.append(f"  at 50%, {v}: " + ", ".join(
                f"{name} {pct(mdape(name, 0.5, v))}" for name in names))
    lines.append("interval (nominal 10-90%) holds the true total: " + ", ".join(
        f"{int(100 * q)}% {pct(sum(covered[q]) / len(covered[q]))}" for q in POINTS))
    lines.append("forecast MdAPE at 50% by kind: " + ", ".join(
        f"{k} {pct(statistics.median(v))} ({len(v)})" for k, v in sorted(by_kind.items())))
    lines.append(f"forecaster: {ms:.4f} ms per turn (median over runs; state update + "
                 "forecast, pure Python)")
    for v, rep in replays.items():
        lines += ["", *rep.lines(v)]
    headline = next((rep for rep in replays.values() if rep.graded), replays[variants[0]])
    lines += ["",
              f"HEADLINE mape_at_50pct={mdape('forecast', 0.5):.3f} "
              f"naive_mape_at_50pct={mdape('naive_rate', 0.5):.3f} forecast_ms={ms:.4f} "
              f"budget_tokens_saved={headline.saved}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    name = args.name or "+".join(v.removeprefix("record_runs").lstrip("_") or "record_runs"
                                 for v in variants)
    stem = "forecast_bench" + (f"_{name}" if name != "record_runs" else "")
    about = (f"the spend forecaster on {len(runs)} recorded runs "
             f"({', '.join(f'{v}.jsonl' for v in variants)}), {args.folds}-fold by "
             f"run, seed {args.seed}")
    record(RESULTS / f"{stem}.txt", text, what=f"{about}: `{lines[-1]}`")
    errors = {label: [mdape(name, q) for q in POINTS] for name, label in names.items()
              if name != "prompt_forecast"}
    record(RESULTS / f"{stem}.png", lambda p: plot(errors, replays, p),
           what=f"its plot: error against the share of the run seen, per forecaster; the budget "
                f"replay per variant ({about})")
    return 0


def plot(errors: dict[str, list[float]], replays: dict[str, Replay], path: Path) -> None:
    """Left: MdAPE of the total forecast at 25/50/75% of a run, per forecaster; right: per
    variant, the tokens spent without a budget, under the spend cap and under the forecast rule
    (m chosen on training runs), each bar labelled with the runs that succeeded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, ys in errors.items():
        left.plot([int(100 * q) for q in POINTS], [100 * y for y in ys], marker="o", label=label)
    left.set_xlabel("% of the run's turns seen")
    left.set_ylabel("median abs. % error of the total")
    left.set_title("spend forecast, held-out runs")
    left.legend(fontsize=7)
    shown = [(v, r) for v, r in replays.items() if r.runs]
    for arm, offset, label in (("free", -0.27, "no budget"), ("cap", 0.0, "spend cap"),
                               ("chosen", 0.27, "forecast rule")):
        bars = right.bar([i + offset for i in range(len(shown))],
                         [getattr(r, arm)[0] for _, r in shown], 0.27, label=label)
        for bar, (_, r) in zip(bars, shown):
            right.annotate(f"{getattr(r, arm)[1]}/{r.runs}", (bar.get_x() + bar.get_width() / 2,
                           bar.get_height()), ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(shown)))
    right.set_xticklabels([v for v, _ in shown], rotation=15, fontsize=7)
    right.set_ylabel("computed tokens spent (held-out runs)")
    right.set_title("budget replay (labels: runs succeeded)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
