"""A 3-agent debate over a GSM8K question, as an SGLang frontend program.

Each agent has its own system prompt (its *head*) and, every turn, reads the question and every
answer given so far (the *shared transcript*), then answers. Turns run one after another, so
the transcript grows by one answer per turn. This is the workload sglang-kvcmas exists for:
with plain prefix caching an agent can only reuse its *own* previous prompt, because the head
comes first; the shared transcript is prefilled again for every agent.

Per turn we print the prompt tokens, the tokens the server took from its cache
(``meta_info.cached_tokens``), and the time to first token measured on the client (streaming)
next to the server's own ``meta_info.first_token_latency``.

    python -m sglang_kvcmas_examples.debate --url http://127.0.0.1:30000 [--rounds 3]

Importable: :func:`run_debate` returns typed per-turn records for benchmarks.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import sglang as sgl

from sglang_kvcmas_examples.datasets import gsm8k
from sglang_kvcmas_examples.turns import Turn, TurnTotals, print_turn, run_parallel, stream_turn

CHAT_TEMPLATE = "chatml"  # SmolLM2-Instruct's template; SGLang cannot infer it from our path
__all__ = ["CHAT_TEMPLATE", "DEFAULT_AGENTS", "Agent", "DebateRun", "Turn", "run_debate",
           "run_turn", "transcript_text"]


@dataclass(frozen=True)
class Agent:
    """A debate participant: a name and its own system prompt."""

    name: str
    system_prompt: str


DEFAULT_AGENTS = (
    Agent("Solver", "You are Solver, a careful mathematician. Work through the problem step "
          "by step, showing each calculation, and state the final number clearly."),
    Agent("Skeptic", "You are Skeptic, a critical reviewer. Check the other answers for "
          "arithmetic or reasoning mistakes, point them out briefly, and give your own number."),
    Agent("Judge", "You are Judge, a concise arbiter. Weigh the answers given so far, decide "
          "which final number is right, and explain your decision in one or two sentences."),
)


@dataclass
class DebateRun(TurnTotals):
    """All turns of one debate, in order."""

    question: str
    reference_answer: str
    turns: list[Turn] = field(default_factory=list)


def transcript_text(question: str, turns: list[Turn]) -> str:
    """The shared part of every agent's prompt: the question and every answer so far."""
    lines = [f"Question: {question}"]
    for t in turns:
        lines.append(f"\n[{t.agent}, round {t.round}]: {t.answer.strip()}")
    return "\n".join(lines)


@sgl.function
def agent_turn(s, system_prompt: str, transcript: str, first: bool, answer_tokens: int):
    # NOTE: not `max_new_tokens`: SGLang's `run()` takes that name as a sampling default.
    s += sgl.system(system_prompt)
    ask = ("Answer the question." if first else
           "Read the discussion above, then give your answer.")
    s += sgl.user(f"{transcript}\n\n{ask} End with 'Final answer: <number>'.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=answer_tokens, temperature=0.0))


def run_turn(backend, agent: Agent, round_: int, question: str, turns: list[Turn],
             max_new_tokens: int) -> Turn:
    """Run one agent turn with streaming, timing the first chunk on the client."""
    return stream_turn(agent_turn, backend, round_, agent.name, "answer",
                       system_prompt=agent.system_prompt,
                       transcript=transcript_text(question, turns), first=not turns,
                       answer_tokens=max_new_tokens)


def run_debate(backend, question: str, reference_answer: str = "", *,
               agents: tuple[Agent, ...] = DEFAULT_AGENTS, rounds: int = 3,
               max_new_tokens: int = 64, on_turn=None, parallel: bool = False) -> DebateRun:
    """Run a debate: ``rounds`` rounds, every agent once per round.

    Args:
        backend: an ``sgl.RuntimeEndpoint`` (chat template ``chatml`` for SmolLM2).
        on_turn: optional callback ``(Turn) -> None`` after each turn (progress output).
        parallel: the agents of a round answer at the same time, each over the transcript of
            the rounds before (a round-based debate); otherwise one after another, each over
            every answer so far.
    """
    run = DebateRun(question, reference_answer)
    for round_ in range(1, rounds + 1):
        if parallel:
            before = list(run.turns)
            turns = run_parallel([
                (lambda a=a: run_turn(backend, a, round_, question, before, max_new_tokens))
                for a in agents])
        else:
            turns = []
            for agent in agents:
                turns.append(run_turn(backend, agent, round_, question, run.turns + turns,
                                      max_new_tokens))
        for turn in turns:
            run.turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="3-agent GSM8K debate against an SGLang server.")
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question-index", type=int, default=0, help="GSM8K test item (0..1318)")
    p.add_argument("--rounds", type=int, default=3, choices=(1, 2, 3, 4))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--flush-cache", action="store_true", help="flush the server cache first")
    p.add_argument("--parallel", action="store_true",
                   help="the agents of a round answer at the same time")
    p.add_argument("--jsonl", help="append one JSON record per turn to this file")
    args = p.parse_args(argv)

    item = gsm8k()[args.question_index]
    backend = sgl.RuntimeEndpoint(args.url, chat_template_name=CHAT_TEMPLATE)
    if args.flush_cache:
        backend.flush_cache()
    print(f"Question {args.question_index}: {item.question}\n(reference answer: {item.final})\n")
    print("round agent        prompt  cached  ttft_cli  ttft_srv   out  answer")
    print("                      tok     tok        ms        ms   tok")
    run = run_debate(backend, item.question, item.final, rounds=args.rounds,
                     max_new_tokens=args.max_new_tokens, on_turn=print_turn,
                     parallel=args.parallel)
    share = run.cached_tokens / max(run.prompt_tokens, 1)
    print(f"\n{len(run.turns)} turns: {run.prompt_tokens} prompt tokens, {run.cached_tokens} "
          f"from the server's cache ({share:.1%}), {run.prompt_tokens - run.cached_tokens} "
          "prefilled.")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for turn in run.turns:
                f.write(json.dumps({"question_index": args.question_index, **asdict(turn)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
