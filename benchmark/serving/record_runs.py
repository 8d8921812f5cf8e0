"""Record multi-agent runs whose length the agents decide, with every turn's token counts.

The spend forecaster (``sglang_kvcmas.policy.spend_forecast``) learns from these. Four kinds of
workflow, each over one GSM8K question, every agent turn an OpenAI chat completion carrying the
run's ``X-KVCMAS-Workflow`` header (answers of free length: ``--max-new-tokens``, sampled at
``--temperature`` so that two runs of one question may differ):

- ``debate``: three debaters answer together, round after round, until their final numbers agree
  or ``MAX_DEBATE_ROUNDS`` rounds have run;
- ``review``: a writer drafts, a reviewer answers ``APPROVED`` or lists problems, the writer
  revises, until the reviewer approves or ``MAX_REVIEW_LOOPS`` loops have run;
- ``panel``: four experts read each other's answers each round; after each round a moderator
  says ``CONCLUDE`` or ``CONTINUE`` (at most ``MAX_PANEL_ROUNDS`` rounds);
- ``fanout``: a planner lists sub-tasks (one per ``- `` or numbered line; the workers are as
  many, 1 to ``MAX_WORKERS``), the workers solve one each concurrently, an aggregator writes
  the answer.

With ``--kinds pal`` (a code model, which answers math tersely and wrongly in prose) the debate
and the review are program-aided instead: ``pal_debate`` (each debater writes a program that
prints the answer, run in the sandbox of ``benchmark/quality``; programs and printed numbers join
the transcript; until the printed numbers agree) and ``pal_review`` (the writer's program is run,
the reviewer sees it and its output). Every run's final answer (debates and panels: the majority)
is graded against GSM8K's reference number (``outcome.correct``), so a budget replay can be
judged by task success. ``--kinds code`` records ``code_review`` runs over HumanEval problems
(run ``qid`` is the problem's index): a coder completes the function, which is run on the
specification's own examples (its docstring's ``>>>`` lines; the hidden tests stay hidden), a
reviewer sees code and run and answers ``APPROVED`` or lists problems, the coder revises, until
approved with every example passing or ``MAX_REVIEW_LOOPS`` loops;
the last version is graded by the problem's own tests in the sandbox (pass@1) -- a task a small
code model does well, so the budget replay's success rate is far from zero.

After each run the script reads the server's ledger (``GET /kvcmas/workflows/{id}``: totals and
turns in the order they finished) and appends one JSON line to
``results/record_runs[_<kinds>][_<variant>][_<model>].jsonl`` (``_<kinds>`` unless ``plain``;
``--variant``: what else differs, e.g. ``t05`` for ``--temperature 0.5``): kind, question id,
the ledger's totals and turns, and the per-turn usage the responses carried (step, agent,
prompt / completion tokens and the ``kvcmas_*`` reuse fields). Rerunning skips the runs already
in the file; progress goes to stderr; ``--concurrency`` runs go at once. ``--minutes`` stops
starting new runs after that long.

    python benchmark/serving/record_runs.py --runs 80 --minutes 25 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests
from sglang_kvcmas.server.process import free_port
from sglang_kvcmas_bench.accuracy_tasks import (
    GSM8K_DEBATERS,
    code_block,
    examples_fail,
    gsm8k_flow,
    humaneval_examples,
    humaneval_passes,
    printed_number,
    same_number,
)
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import command_line, record
from sglang_kvcmas_bench.sandbox import run_python
from sglang_kvcmas_bench.server_arms import ArmServer
from sglang_kvcmas_bench.workflows import DEBATERS
from sglang_kvcmas_examples import fanout

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("debate", "review", "panel", "fanout")
PAL_KINDS = ("pal_debate", "pal_review", "panel", "fanout")
"""The kinds for a code model (``--kinds pal``): its debates and reviews are program-aided."""
CODE_KINDS = ("code_review",)
"""HumanEval kinds (``--kinds code``): graded by the problem's tests."""
KIND_SETS = {"plain": KINDS, "pal": PAL_KINDS, "code": CODE_KINDS}
MAX_DEBATE_ROUNDS = 5
MAX_REVIEW_LOOPS = 4
MAX_PANEL_ROUNDS = 4
MAX_WORKERS = 5

REVIEW_ROLES = {
    "Writer": "You are the Writer. You write a clear worked solution to a math word problem, "
    "step by step, and revise it when the Reviewer finds problems. End with a line "
    "'Final answer: <number>'.",
    "Reviewer": "You are the Reviewer. You check the Writer's latest solution line by line. If "
    "it is fully correct, reply with the single word APPROVED. Otherwise list each problem you "
    "found with the corrected value.",
}
PAL_REVIEW_ROLES = {
    "Writer": "You are the Writer. You solve math word problems by writing short Python "
    "programs that print the answer, and revise them when the Reviewer finds problems.",
    "Reviewer": "You are the Reviewer. You check the Writer's latest program and what it "
    "printed against the question, line by line. If it is fully correct, reply with the single "
    "word APPROVED. Otherwise list each problem you found.",
}
CODE_REVIEW_ROLES = {
    "Coder": "You are the Coder. You implement Python functions exactly to their specification "
    "and revise them when the Reviewer finds problems.",
    "Reviewer": "You are the Reviewer. You check the Coder's latest implementation against the "
    "specification line by line, edge cases included; an example that fails is a problem. If "
    "it is fully correct, reply with the single word APPROVED. Otherwise list each problem you "
    "found, briefly, without code.",
}
PANEL_ROLES = {
    "Algebraist": "You are the Algebraist on a panel of four experts. You set the problem up "
    "as equations and solve them.",
    "Estimator": "You are the Estimator on a panel of four experts. You sanity-check the size "
    "of every quantity and the final result.",
    "Teacher": "You are the Teacher on a panel of four experts. You explain the reasoning "
    "simply and point out steps that others skipped.",
    "Skeptic": "You are the Skeptic on a panel of four experts. You look for the most likely "
    "mistake in the other experts' answers.",
    "Moderator": "You are the Moderator of a panel of four experts. After each round you read "
    "their answers and decide: reply CONCLUDE if they agree on a well-supported final answer, "
    "or CONTINUE if they should discuss another round. Give one sentence of reason.",
}
FANOUT_ROLES = {"Planner": fanout.PLANNER, "Worker": fanout.WORKER,
                "Aggregator": fanout.AGGREGATOR}
"""The fan-out example's roles (``sglang_kvcmas_examples.fanout``)."""
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"final answer\s*[:=]?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.I)


def final_number(text: str) -> str | None:
    """The number after the last 'Final answer:', else the reply's last number (normalized)."""
    found = _FINAL.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "").rstrip(".")
    try:
        value = float(raw)
    except ValueError:
        return raw
    return str(int(value)) if value == int(value) else f"{value:g}"


def majority(answers: list[str | None]) -> str | None:
    """The most common answer among those given (first seen wins a tie), else None."""
    given = [a for a in answers if a is not None]
    return Counter(given).most_common(1)[0][0] if given else None


@dataclass
class Run:
    """One run being recorded: its identity, and its turns' usage as the responses gave it."""

    kind: str
    qid: int
    question: str
    url: str
    max_new: int
    temperature: float
    item: str | dict | None = None  # what grades it: GSM8K's number, or the HumanEval problem
    workflow: str = field(default_factory=lambda: f"rr-{uuid.uuid4().hex[:12]}")
    turns: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.qid}"

    def ask(self, step: int, agent: str, system: str, user: str) -> str:
        """One agent turn (a chat completion in this run's workflow); returns its reply."""
        body = {"model": "default", "temperature": self.temperature, "max_tokens": self.max_new,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}]}
        t0 = time.time()
        r = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=1800,
                          headers={"X-KVCMAS-Workflow": self.workflow})
        r.raise_for_status()
        out = r.json()
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        rec = {"step": step, "agent": agent, "t0": t0, "t1": time.time(),
               "prompt_tokens": usage.get("prompt_tokens", 0),
               "completion_tokens": usage.get("completion_tokens", 0),
               **{k: v for k, v in details.items() if k.startswith("kvcmas_")}}
        with self.lock:
            self.turns.append(rec)
        return out["choices"][0]["message"]["content"] or ""

    def together(self, step: int, asks: dict[str, tuple[str, str]]) -> dict[str, str]:
        """Several agents' turns at once (``name -> (system, user)``); their replies by name."""
        with ThreadPoolExecutor(len(asks)) as pool:
            futures = {a: pool.submit(self.ask, step, a.split("#")[0], *su)
                       for a, su in asks.items()}
            return {a: f.result() for a, f in futures.items()}


def run_debate(run: Run) -> dict:
    transcript: list[str] = []
    for rnd in range(MAX_DEBATE_ROUNDS):
        ask = ("Give your answer." if rnd == 0 else f"This is round {rnd + 1}. Considering the "
               "answers above, give your updated answer.")
        user = "\n\n".join([f"Question: {run.question}", *transcript, ask])
        outs = run.together(rnd, {a: (DEBATERS[a], user) for a in DEBATERS})
        transcript.append("\n".join([f"Round {rnd + 1} answers:"] +
                                    [f"{a}: {outs[a].strip()}" for a in DEBATERS]))
        finals = [final_number(outs[a]) for a in DEBATERS]
        if finals[0] is not None and len(set(finals)) == 1:
            return {"stopped": "agreed", "rounds": rnd + 1, "answer": finals[0]}
    return {"stopped": "max_rounds", "rounds": MAX_DEBATE_ROUNDS, "answer": majority(finals)}


def review_loop(run: Run, roles: dict[str, str], writer: str, start: str,
                asks: tuple[str, str], review_ask: str,
                version: Callable[[int, str], tuple[str, str | None]],
                veto: Callable[[], bool] = lambda: False) -> dict:
    """A writer and a reviewer, until the reviewer answers ``APPROVED`` (and ``veto()``, asked
    then, does not overrule it) or ``MAX_REVIEW_LOOPS`` loops have run. The writer is asked
    ``asks[0]``, then ``asks[1]`` (revise); ``version(loop, reply)`` gives the transcript entry
    of its reply and the run's answer so far.

    The outcome's ``versions`` lists ``[turns done, answer]`` for each of the writer's versions
    (the answer a run stopped after that many turns would submit), so a budget replay can
    shorten a run instead of failing it."""
    transcript = [start]
    versions: list[list] = []
    step = 0
    for loop in range(MAX_REVIEW_LOOPS):
        reply = run.ask(step, writer, roles[writer],
                        "\n\n".join([*transcript, asks[loop > 0]]))
        entry, answer = version(loop, reply)
        transcript.append(entry)
        step += 1
        versions.append([step, answer])
        review = run.ask(step, "Reviewer", roles["Reviewer"],
                         "\n\n".join([*transcript, review_ask]))
        transcript.append(f"Reviewer (review {loop + 1}):\n{review.strip()}")
        step += 1
        if "APPROVED" in review.upper() and not veto():
            return {"stopped": "approved", "loops": loop + 1, "answer": answer,
                    "versions": versions}
    return {"stopped": "max_loops", "loops": MAX_REVIEW_LOOPS, "answer": answer,
            "versions": versions}


def run_review(run: Run) -> dict:
    return review_loop(
        run, REVIEW_ROLES, "Writer", f"Question: {run.question}",
        ("Write your solution.", "Revise your solution, fixing every problem the Reviewer "
         "listed."), "Review the latest draft. Reply APPROVED if it is correct.",
        lambda loop, draft: (f"Writer (draft {loop + 1}):\n{draft.strip()}",
                             final_number(draft)))


def run_panel(run: Run) -> dict:
    experts = [a for a in PANEL_ROLES if a != "Moderator"]
    transcript: list[str] = [f"Question: {run.question}"]
    step = 0
    for rnd in range(MAX_PANEL_ROUNDS):
        ask = ("Give your answer, ending with 'Final answer: <number>'." if rnd == 0 else
               f"Round {rnd + 1}: read the other experts' answers above and give your updated "
               "answer, ending with 'Final answer: <number>'.")
        user = "\n\n".join([*transcript, ask])
        outs = run.together(step, {a: (PANEL_ROLES[a], user) for a in experts})
        step += 1
        transcript.append("\n".join([f"Round {rnd + 1}:"] +
                                    [f"{a}: {outs[a].strip()}" for a in experts]))
        verdict = run.ask(step, "Moderator", PANEL_ROLES["Moderator"], "\n\n".join(
            [*transcript, "Moderator: CONCLUDE or CONTINUE?"]))
        step += 1
        answer = majority([final_number(outs[a]) for a in experts])
        if "CONCLUDE" in verdict.upper() and "CONTINUE" not in verdict.upper():
            return {"stopped": "concluded", "rounds": rnd + 1, "answer": answer}
        transcript.append(f"Moderator: {verdict.strip()}")
    return {"stopped": "max_rounds", "rounds": MAX_PANEL_ROUNDS, "answer": answer}


def run_fanout(run: Run) -> dict:
    plan = run.ask(0, "Planner", FANOUT_ROLES["Planner"],
                   f"Question: {run.question}\n\nList the sub-tasks, one per line starting "
                   "with '- '.")
    tasks = fanout.sub_tasks(plan, run.question, MAX_WORKERS)
    shared = f"Question: {run.question}\n\nPlan:\n{plan.strip()}"
    outs = run.together(1, {f"Worker#{i}": (FANOUT_ROLES["Worker"],
                                            f"{shared}\n\nYour sub-task: {t}")
                            for i, t in enumerate(tasks)})
    results = "\n\n".join(f"Worker {i + 1} ({t}):\n{outs[f'Worker#{i}'].strip()}"
                          for i, t in enumerate(tasks))
    final = run.ask(2, "Aggregator", FANOUT_ROLES["Aggregator"],
                    f"{shared}\n\n{results}\n\nCombine the results into the final answer.")
    return {"stopped": "aggregated", "workers": len(tasks), "answer": final_number(final)}


def run_pal_debate(run: Run) -> dict:
    """Program-aided debate: each debater writes a program printing the answer (run in the
    sandbox; programs and printed numbers join the transcript), round after round, until the
    printed numbers agree."""
    flow = gsm8k_flow(run.qid, run.question, rounds=MAX_DEBATE_ROUNDS)
    for rnd in range(MAX_DEBATE_ROUNDS):
        asks = {a: tuple(m["content"] for m in flow.messages(rnd, a)) for a in GSM8K_DEBATERS}
        flow.record(rnd, run.together(rnd, asks))
        finals = [flow.executions[-1][a] for a in GSM8K_DEBATERS]
        if finals[0] is not None and len(set(finals)) == 1:
            return {"stopped": "agreed", "rounds": rnd + 1, "answer": finals[0]}
    return {"stopped": "max_rounds", "rounds": MAX_DEBATE_ROUNDS, "answer": majority(finals)}


def run_pal_review(run: Run) -> dict:
    """Program-aided review: the writer's program is run; the reviewer sees it and what it
    printed and approves it or lists problems; the writer revises, until approved."""
    def version(loop: int, draft: str) -> tuple[str, str | None]:
        code = code_block(draft)
        answer = printed_number(run_python(code, 10.0).stdout)
        return f"Writer (program {loop + 1}):\n```python\n{code}\n```\nprinted: {answer}", answer

    return review_loop(
        run, PAL_REVIEW_ROLES, "Writer", f"Question: {run.question}",
        ("Write a short Python program that computes the answer and prints only the final "
         "number, in one ```python block.", "Revise your program, fixing every problem the "
         "Reviewer listed, in one ```python block."),
        "Review the latest program. Reply APPROVED if it is correct.", version)


def run_code_review(run: Run) -> dict:
    """Coder and reviewer over one HumanEval specification (``run.question``): the coder's
    function is run on the specification's own examples (``run.item``'s docstring, in the
    sandbox; not the hidden tests that grade it), the reviewer sees the code and that run and
    approves or lists problems, the coder revises, until approved with every example passing
    (the run of the examples overrules an approval, as a test executor would: the small models
    approve nearly anything); the answer is the last code."""
    failing = [False]

    def version(loop: int, reply: str) -> tuple[str, str]:
        code = code_block(reply)
        entry = f"Coder (version {loop + 1}):\n```python\n{code}\n```"
        if isinstance(run.item, dict):
            ran = humaneval_examples(run.item, reply)
            failing[0] = examples_fail(ran)
            entry += f"\nRunning the specification's examples: {ran}"
        return entry, code

    return review_loop(
        run, CODE_REVIEW_ROLES, "Coder", f"Specification:\n```python\n{run.question}```",
        ("Complete the function. Reply with the whole function in one ```python block.",
         "Revise the function, fixing every problem the Reviewer listed and every failing "
         "example. Reply with the whole function in one ```python block."),
        "Review the latest implementation and what running the examples showed. Reply APPROVED "
        "if it is correct.", version, veto=lambda: failing[0])


RUNNERS = {"debate": run_debate, "review": run_review, "panel": run_panel,
           "fanout": run_fanout, "pal_debate": run_pal_debate, "pal_review": run_pal_review,
           "code_review": run_code_review}


def plan_runs(n: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int]]:
    """The first ``n`` runs: ``kinds`` in turn, each on its own item (a GSM8K test question, or
    for ``code_*`` kinds a HumanEval problem)."""
    return [(kinds[i % len(kinds)], i) for i in range(n)]


def grade(kind: str, answer: str | None, item: str | dict) -> bool:
    """Whether a run's final answer is right: ``code_*`` kinds by the HumanEval problem's tests
    (``item`` the problem), the others against GSM8K's number (``item`` the reference)."""
    if kind.startswith("code_"):
        return answer is not None and humaneval_passes(item, f"```python\n{answer}\n```")
    return same_number(answer, item)


def done_keys(path: Path) -> set[str]:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run: that run is redone
        keys.add(f"{rec['kind']}/{rec['qid']}")
    return keys


def record_one(run: Run, model_name: str) -> dict:
    """Run one workflow and read its ledger; ``run.item`` grades it (see :func:`grade`)."""
    t0, item = time.time(), run.item
    outcome = RUNNERS[run.kind](run)
    outcome["gold"] = item["task_id"] if isinstance(item, dict) else item
    outcome["correct"] = grade(run.kind, outcome.get("answer"), item)
    if "versions" in outcome:  # each version graded; the answers themselves are not kept
        outcome["versions"] = [[turns, grade(run.kind, answer, item)]
                               for turns, answer in outcome["versions"]]
    r = requests.get(f"{run.url}/kvcmas/workflows/{run.workflow}", timeout=60)
    ledger = r.json() if r.ok else {"error": r.status_code}
    turns = sorted(run.turns, key=lambda t: t["t1"])
    return {"kind": run.kind, "qid": run.qid, "workflow": run.workflow, "model": model_name,
            "max_new_tokens": run.max_new, "temperature": run.temperature,
            "outcome": outcome, "seconds": round(time.time() - t0, 2),
            "n_turns": len(turns),
            "totals": {k: ledger.get(k) for k in ("requests", "agents", "prompt_tokens",
                                                  "reused_exact", "reused_factored",
                                                  "reused_repositioned", "recomputed",
                                                  "completion_tokens", "computed")},
            "ledger_turns": ledger.get("turns", []), "usage_turns": turns}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(p)
    p.add_argument("--runs", type=int, default=60, help="runs in the plan (kinds in turn)")
    p.add_argument("--kinds", choices=tuple(KIND_SETS), default="plain",
                   help=f"plain: {', '.join(KINDS)}; pal (a code model): "
                        f"{', '.join(PAL_KINDS)}; code (HumanEval): {', '.join(CODE_KINDS)}")
    p.add_argument("--minutes", type=float, default=25.0,
                   help="start no new run after this long (minutes)")
    p.add_argument("--concurrency", type=int, default=8, help="runs at once")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--variant", default="",
                   help="what else differs from the default run, in the file's name (e.g. t05 "
                        "for --temperature 0.5)")
    p.add_argument("--url", default=None, help="a running kvcmas server (default: boot one)")
    p.add_argument("--max-total-tokens", type=int, default=60000)
    args = p.parse_args()
    # SIGTERM ends the program through SystemExit, so the server it booted is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = model_from_args(p, args)
    out = model.named(RESULTS / ("record_runs" + ("" if args.kinds == "plain" else f"_{args.kinds}")
                                 + (f"_{args.variant}" if args.variant else "") + ".jsonl"))
    done = done_keys(out)
    kinds = KIND_SETS[args.kinds]
    from sglang_kvcmas_examples.datasets import gsm8k, humaneval

    problems = humaneval() if args.kinds == "code" else ()
    if args.kinds == "code" and args.runs > len(problems):
        p.error(f"--kinds code has {len(problems)} HumanEval problems; --runs {args.runs}")
    todo = [kq for kq in plan_runs(args.runs, kinds) if f"{kq[0]}/{kq[1]}" not in done]
    print(f"record_runs: {len(done)} done, {len(todo)} to run -> {out}", file=sys.stderr)
    if not todo:
        return 0
    questions = gsm8k() if args.kinds != "code" else ()

    def problem(kind: str, qid: int) -> tuple[str, str | dict]:
        """The text a run starts from and what grades it."""
        if kind.startswith("code_"):
            return problems[qid]["prompt"], problems[qid]
        return questions[qid].question, questions[qid].final

    write_lock = threading.Lock()
    command = command_line()
    deadline = time.time() + args.minutes * 60
    counts = {"ok": 0, "failed": 0}

    def go(url: str, kind: str, qid: int) -> None:
        if time.time() > deadline:
            return
        text, item = problem(kind, qid)
        run = Run(kind, qid, text, url, args.max_new_tokens, args.temperature, item)
        try:
            rec = record_one(run, model.name)
        except Exception as e:  # one failed run is skipped, the others go on
            counts["failed"] += 1
            print(f"record_runs: {run.key} failed: {e!r}", file=sys.stderr)
            return
        with write_lock:
            counts["ok"] += 1
            record(out, json.dumps(rec) + "\n", append=True, command=command,
                   what=f"{len(done) + counts['ok']} runs of {model.name} whose length the "
                        f"agents decide, --kinds {args.kinds} ({', '.join(kinds)}), temperature "
                        f"{args.temperature:g}, {args.max_new_tokens} new tokens a turn: every "
                        f"turn's tokens from the server's ledger, the outcome, graded where it "
                        f"can be (a rerun resumes, skipping the runs already there)")
            tot = rec["totals"]
            shown = {k: v for k, v in rec["outcome"].items()
                     if not (k == "answer" and kind.startswith("code_"))}  # code: too long
            print(f"record_runs: [{counts['ok']}/{len(todo)}] {run.key} {shown} "
                  f"turns={rec['n_turns']} prompt={tot['prompt_tokens']} "
                  f"computed={tot['computed']} {rec['seconds']:.0f}s", file=sys.stderr)

    def all_runs(url: str) -> None:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for f in [pool.submit(go, url, k, q) for k, q in todo]:
                f.result()

    if args.url:
        all_runs(args.url.rstrip("/"))
    else:
        log = Path("/tmp") / f"{out.stem}_server.log"
        server = ArmServer("kvcmas", log, [*model.server_args, "--max-total-tokens",
                                           str(args.max_total_tokens)])
        # A port away from the 31000s other benchmarks boot on: a server still loading there
        # has not bound its port yet, and /health would reach it instead of ours.
        server.port = free_port(33000 + random.randrange(900), 34000)
        with server:
            print(f"record_runs: server up at {server.url} (log {log})", file=sys.stderr)
            all_runs(server.url)
    print(f"record_runs: {counts['ok']} recorded, {counts['failed']} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
