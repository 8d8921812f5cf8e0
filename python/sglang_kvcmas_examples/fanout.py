"""Fan-out / fan-in: a planner, up to 8 workers in parallel, an aggregator, on a GSM8K question.

Round 1: the Planner splits the question into sub-tasks. Round 2: the Workers, one per sub-task
(at most ``--workers``), solve them at the same time: one frontend program whose state
``fork``s once per worker after the shared prefix (the Worker's system prompt, the question and
the plan), so the prefix is computed once and every fork adds only its sub-task. Round 3: the
Aggregator reads the plan and every worker's result and gives the final answer. The workers'
prompt repeats the question and plan the Planner's turn computed under another head, and the
Aggregator's repeats it again under a third: what sglang-kvcmas shares across heads.

    python -m sglang_kvcmas_examples.fanout --url http://127.0.0.1:30000 [--workers 8]

Importable: :func:`run_fanout` returns typed per-turn records for benchmarks. A fork's
``ttft_client_s`` is the server's first-token latency (the frontend does not stream forks).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field

import sglang as sgl

from sglang_kvcmas_examples.turns import Turn, TurnTotals, print_turn, stream_turn, turn_of

CHAT_TEMPLATE = "chatml"
PLANNER = ("You are the Planner. You split a math word problem into the smallest number of "
           "independent sub-tasks that a team of workers can solve separately, one per line "
           "starting with '- '. Do not solve them.")
WORKER = ("You are a Worker. You solve exactly the sub-task you are given, showing the "
          "arithmetic, and end with 'Result: <number>'.")
AGGREGATOR = ("You are the Aggregator. You combine the workers' results into the answer of the "
              "original problem, checking that they fit together. End with 'Final answer: "
              "<number>'.")
MAX_WORKERS = 8
_TASK_LINE = re.compile(r"\s*(?:[-*\u2022]|\d+[.)]|sub-?task\s*\d+\s*:)\s+(.+)", re.I)
"""A planner's sub-task line: ``- x``, ``* x``, ``1. x``, ``2) x`` or ``Sub-task 3: x``."""


@dataclass
class FanoutRun(TurnTotals):
    """All turns of one run: the Planner's, the Workers' (in sub-task order), the
    Aggregator's."""

    question: str
    reference_answer: str
    tasks: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


def sub_tasks(plan: str, question: str, most: int) -> list[str]:
    """The plan's sub-task lines (at most ``most``), or the question itself when it lists
    none."""
    tasks = [m.group(1).strip() for m in map(_TASK_LINE.match, plan.splitlines()) if m]
    return [t for t in tasks if t][:most] or [question]


@sgl.function
def plan_turn(s, question: str, answer_tokens: int):
    s += sgl.system(PLANNER)
    s += sgl.user(f"Question: {question}\n\nList the sub-tasks, one per line starting with '- '.")
    s += sgl.assistant(sgl.gen("plan", max_tokens=answer_tokens, temperature=0.0))


@sgl.function
def worker_turns(s, shared: str, tasks: list[str], answer_tokens: int):
    """One state forked once per sub-task after the shared prefix; returns each fork's
    (result, meta_info)."""
    s += sgl.system(WORKER)
    s += sgl.user(shared)
    # SGLang's fork sends the prefix to be cached (one prefill for every fork) only when the
    # state's text is already rendered when it looks; the program's worker thread may not have
    # rendered it yet, so wait for it first.
    s.text()
    forks = s.fork(len(tasks))
    for f, task in zip(forks, tasks):
        f += sgl.user(f"Your sub-task: {task}")
        f += sgl.assistant(sgl.gen("result", max_tokens=answer_tokens, temperature=0.0))
    out = [(f["result"], f.get_meta_info("result")) for f in forks]
    forks.join()
    return out


@sgl.function
def aggregate_turn(s, shared: str, results: str, answer_tokens: int):
    s += sgl.system(AGGREGATOR)
    s += sgl.user(f"{shared}\n\n{results}\n\nCombine the results into the final answer.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=answer_tokens, temperature=0.0))


def run_fanout(backend, question: str, reference_answer: str = "", *,
               workers: int = MAX_WORKERS, answer_tokens: int = 96,
               on_turn=None) -> FanoutRun:
    """Plan, fan out to at most ``workers`` workers (1..8), aggregate.

    Raises:
        ValueError: ``workers`` outside 1..8.
        RuntimeError: a program run failed (the server's error in the message).
    """
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be in 1..{MAX_WORKERS}, got {workers}")
    run = FanoutRun(question, reference_answer)

    def done(turn: Turn) -> Turn:
        run.turns.append(turn)
        if on_turn is not None:
            on_turn(turn)
        return turn

    plan = done(stream_turn(plan_turn, backend, 1, "Planner", "plan", question=question,
                            answer_tokens=answer_tokens)).answer
    run.tasks = sub_tasks(plan, question, workers)
    shared = f"Question: {question}\n\nPlan:\n{plan.strip()}"
    start = time.perf_counter()
    state = worker_turns.run(shared=shared, tasks=run.tasks, answer_tokens=answer_tokens,
                             backend=backend)
    end = time.perf_counter()
    if state.error() is not None:
        raise RuntimeError(f"the workers' turns failed: {state.error()}")
    results = []
    for i, (text, meta) in enumerate(state.ret_value):
        turn = done(turn_of(text, meta, 2, f"Worker{i + 1}", start, end, None))
        results.append(f"Worker {i + 1} ({run.tasks[i]}):\n{turn.answer.strip()}")
    done(stream_turn(aggregate_turn, backend, 3, "Aggregator", "answer", shared=shared,
                     results="\n\n".join(results), answer_tokens=answer_tokens))
    return run


def main(argv: list[str] | None = None) -> int:
    from sglang_kvcmas_examples.datasets import gsm8k

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question-index", type=int, default=0, help="GSM8K test item (0..1318)")
    p.add_argument("--workers", type=int, default=MAX_WORKERS, choices=range(1, MAX_WORKERS + 1),
                   metavar="1..8")
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    item = gsm8k()[args.question_index]
    backend = sgl.RuntimeEndpoint(args.url, chat_template_name=CHAT_TEMPLATE)
    print(f"Question {args.question_index}: {item.question}\n(reference answer: {item.final})\n")
    print("round agent        prompt  cached  ttft_cli  ttft_srv   out  answer")
    print("                      tok     tok        ms        ms   tok")
    run = run_fanout(backend, item.question, item.final, workers=args.workers,
                     answer_tokens=args.max_new_tokens, on_turn=print_turn)
    print(f"\n{len(run.turns)} turns ({len(run.tasks)} workers): {run.prompt_tokens} prompt "
          f"tokens, {run.cached_tokens} from the server's cache, "
          f"{run.prompt_tokens - run.cached_tokens} prefilled.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
