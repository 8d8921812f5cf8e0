"""Multi-agent workflows for the serving head-to-head: 3-agent debates and reviewer chains.

A workflow is a sequence of *steps*; each step is a group of agents that run concurrently over the
same shared transcript (every agent of a step sees identical transcript tokens, after its own
system prompt). After a step, its outputs are appended to the transcript. The prompt of an agent
is ChatML ``system(agent head) + user(transcript + instruction) + assistant opener``.

Agents (system prompts of ~100 tokens) are fixed per deployment and shared by all workflows, as a
real multi-agent service has a fixed set of roles; each workflow has its own GSM8K question.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_HEAD_TAIL = (
    " Work through the problem step by step, show the arithmetic you rely on, and keep your reply "
    "short and focused. When other agents have answered, read their reasoning carefully, say "
    "where you agree or disagree and why. Always finish your reply with a line of the form "
    "'Final answer: <number>'."
)

DEBATERS = {
    "Ada": "You are Ada, a meticulous mathematician in a team of three debaters solving grade-"
    "school math word problems together." + _HEAD_TAIL,
    "Ben": "You are Ben, a practical engineer in a team of three debaters who checks every "
    "quantity, unit and intermediate result against the question." + _HEAD_TAIL,
    "Cleo": "You are Cleo, a skeptical reviewer in a team of three debaters who looks for the "
    "single most likely mistake before agreeing with anyone." + _HEAD_TAIL,
}

CHAIN = {
    "Writer": "You are the Writer. You draft a clear worked solution to a math word problem for "
    "a student, explaining each step in plain words." + _HEAD_TAIL,
    "Checker": "You are the Checker. You verify every calculation in the draft and point out any "
    "arithmetic error with the corrected value." + _HEAD_TAIL,
    "Teacher": "You are the Teacher. You judge whether the draft explains the reasoning well for "
    "a student and suggest one concrete improvement." + _HEAD_TAIL,
    "Editor": "You are the Editor. You read the draft and both reviews and write the final, "
    "corrected solution in a few sentences." + _HEAD_TAIL,
}


def chat_prompt_ids(tok, messages: list[dict], generation: bool = True) -> list[int]:
    """The token ids of ``messages`` under ``tok``'s chat template, the generation prompt added
    unless ``generation`` is False (an agent's head: its system turn alone).
    ``apply_chat_template`` returns a list or, in newer transformers, an encoding."""
    out = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


@dataclass
class Workflow:
    """One workflow instance: its question, its steps, and the transcript so far."""

    kind: str
    wid: int
    question: str
    steps: list[list[str]]
    heads: dict[str, str]
    transcript: list[str] = field(default_factory=list)

    def user_message(self, step: int) -> str:
        parts = [f"Question: {self.question}"]
        parts += self.transcript
        if self.kind == "debate":
            ask = ("Give your answer." if step == 0 else
                   f"This is round {step + 1}. Considering the answers above, give your updated answer.")
        else:
            ask = f"Now do your part ({', '.join(self.steps[step])})."
        return "\n\n".join(parts + [ask])

    def messages(self, step: int, agent: str) -> list[dict]:
        return [{"role": "system", "content": self.heads[agent]},
                {"role": "user", "content": self.user_message(step)}]

    def record(self, step: int, outputs: dict[str, str]) -> None:
        label = f"Round {step + 1} answers:" if self.kind == "debate" else f"Step {step + 1}:"
        lines = [label] + [f"{a}: {outputs[a].strip()}" for a in self.steps[step]]
        self.transcript.append("\n".join(lines))


def debate(wid: int, question: str, rounds: int = 3) -> Workflow:
    return Workflow("debate", wid, question, [list(DEBATERS)] * rounds, DEBATERS)


def reviewer_chain(wid: int, question: str) -> Workflow:
    return Workflow("chain", wid, question, [["Writer"], ["Checker", "Teacher"], ["Editor"]], CHAIN)
