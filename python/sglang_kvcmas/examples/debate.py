"""A 3-agent debate over a GSM8K question, as an SGLang frontend program.

Each agent has its own system prompt (its *head*) and, every turn, reads the question and every
answer given so far (the *shared transcript*), then answers. Turns run one after another, so
the transcript grows by one answer per turn. This is the workload sglang-kvcmas exists for:
with plain prefix caching an agent can only reuse its *own* previous prompt, because the head
comes first; the shared transcript is prefilled again for every agent.

Per turn we print the prompt tokens, the tokens the server took from its cache
(``meta_info.cached_tokens``), and the time to first token measured on the client (streaming)
next to the server's own ``meta_info.first_token_latency``.

    python -m sglang_kvcmas.examples.debate --url http://127.0.0.1:30000 [--rounds 3]

Importable: :func:`run_debate` returns typed per-turn records for benchmarks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import sglang as sgl

from sglang_kvcmas.datasets import gsm8k

CHAT_TEMPLATE = "chatml"  # SmolLM2-Instruct's template; SGLang cannot infer it from our path


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


@dataclass(frozen=True)
class Turn:
    """One agent turn: what it said and what it cost.

    Attributes:
        round: 1-based debate round.
        agent: the agent's name.
        answer: generated text.
        prompt_tokens: tokens in the turn's prompt.
        cached_tokens: prompt tokens the server reused from its tree cache.
        completion_tokens: generated tokens.
        ttft_client_s: seconds from sending the request to the first streamed text chunk.
        ttft_server_s: the server's ``first_token_latency`` (request received → first token).
        latency_s: seconds until the turn finished, on the client.
        reuse: the server's reuse record (``meta_info.kvcmas_reuse``: tokens reused exactly,
            corrected, re-positioned, recomputed), or None when the server kept none (SGLang's
            own tree cache).
    """

    round: int
    agent: str
    answer: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_client_s: float
    ttft_server_s: float | None
    latency_s: float
    reuse: dict | None = None


@dataclass
class DebateRun:
    """All turns of one debate, in order."""

    question: str
    reference_answer: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.turns)


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
    start = time.perf_counter()
    state = agent_turn.run(
        system_prompt=agent.system_prompt, transcript=transcript_text(question, turns),
        first=not turns, answer_tokens=max_new_tokens, backend=backend, stream=True,
    )
    first_chunk = None
    for chunk in state.text_iter("answer"):
        if chunk and first_chunk is None:
            first_chunk = time.perf_counter()
    end = time.perf_counter()
    if state.error() is not None:
        raise RuntimeError(f"{agent.name}'s turn failed: {state.error()}")
    meta = state.get_meta_info("answer") or {}
    return Turn(
        round=round_, agent=agent.name, answer=state["answer"],
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        ttft_client_s=(first_chunk or end) - start,
        ttft_server_s=meta.get("first_token_latency"),
        latency_s=end - start,
        reuse=(meta.get("kvcmas_reuse") or [None])[0],
    )


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
            with ThreadPoolExecutor(len(agents)) as pool:
                turns = list(pool.map(lambda a: run_turn(backend, a, round_, question, before,
                                                         max_new_tokens), agents))
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


def _print_turn(turn: Turn) -> None:
    server = f"{turn.ttft_server_s * 1000:7.0f}" if turn.ttft_server_s is not None else "      ?"
    answer = " ".join(turn.answer.split())
    print(f"{turn.round:>5} {turn.agent:<8} {turn.prompt_tokens:>7} {turn.cached_tokens:>7} "
          f"{turn.ttft_client_s * 1000:>9.0f} {server:>9} {turn.completion_tokens:>5}  "
          f"{answer[:60]}{'…' if len(answer) > 60 else ''}", flush=True)


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
    print("round agent     prompt  cached  ttft_cli  ttft_srv   out  answer")
    print("                   tok     tok        ms        ms   tok")
    run = run_debate(backend, item.question, item.final, rounds=args.rounds,
                     max_new_tokens=args.max_new_tokens, on_turn=_print_turn,
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
