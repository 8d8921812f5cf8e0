"""Programmatic role data for the planner / solver / critic adapters, and the transcript format.

Agents are specialized by adapter, not by prompt: every agent sees the same ChatML transcript
(one system message, the user's question, then the agents' messages as assistant turns) and the
same turn opener, so the adapter alone decides what an agent writes. Messages are derived
mechanically from a GSM8K item's worked answer:

- planner: ``PLAN:`` then one numbered step per solution line with its results hidden;
- solver: ``SOLUTION:`` then the cleaned solution lines and ``ANSWER: <number>``;
- critic: ``VERDICT: CORRECT`` / ``VERDICT: INCORRECT`` with a reason, after a solution that is
  deliberately corrupted (a wrong final number) half of the time.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

__all__ = [
    "ROLES",
    "SYSTEM",
    "TURN_OPENER",
    "Message",
    "RoleExample",
    "chat_text",
    "critic_message",
    "plan_message",
    "role_examples",
    "solution_message",
]

ROLES = ("planner", "solver", "critic")
SYSTEM = "You are one of several agents working together on a math word problem."
TURN_OPENER = "<|im_start|>assistant\n"
_CALC = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class RoleExample:
    """A training sequence: ``context`` (no loss) followed by ``target`` (the role's message)."""

    role: str
    context: str
    target: str


def _lines(answer: str) -> list[str]:
    body = answer.rsplit("####", 1)[0]
    return [_CALC.sub("", ln).strip() for ln in body.splitlines() if ln.strip()]


def plan_message(answer: str) -> str:
    steps = []
    for ln in _lines(answer):
        lhs = ln.split("=", 1)[0].strip().rstrip(".")
        steps.append(f"Compute {lhs}." if "=" in ln else f"Note: {ln}")
    steps.append("Report the final number.")
    return "PLAN:\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))


def solution_message(answer: str, final: str) -> str:
    return "SOLUTION:\n" + "\n".join(_lines(answer)) + f"\nANSWER: {final}"


def _corrupt(final: str, rng: random.Random) -> str:
    try:
        value = float(final)
    except ValueError:
        return final + "1"
    wrong = value + rng.choice([-3, -2, -1, 1, 2, 5, 10])
    return str(int(wrong)) if wrong == int(wrong) else f"{wrong:g}"


def critic_message(final: str, shown: str) -> str:
    if shown == final:
        return f"VERDICT: CORRECT\nReason: every step checks out and {final} is the right answer."
    return (f"VERDICT: INCORRECT\nReason: the answer {shown} is wrong; "
            f"recomputing the steps gives {final}.")


def chat_text(messages: list[Message], *, open_turn: bool = False) -> str:
    """ChatML text of ``messages`` (SmolLM2's template), optionally ending with a turn opener."""
    out = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return out + (TURN_OPENER if open_turn else "")


def role_examples(question: str, answer: str, final: str, rng: random.Random) -> list[RoleExample]:
    """One training example per role for a GSM8K item (the critic's solution may be corrupted)."""
    head = [Message("system", SYSTEM), Message("user", question)]
    plan = plan_message(answer)
    shown = final if rng.random() < 0.5 else _corrupt(final, rng)
    solution = solution_message(answer, final)
    shown_solution = solution_message(answer.replace(f"#### {final}", ""), shown)
    if shown != final:  # the corrupted solution's last line disagrees with its steps' results
        shown_solution = shown_solution.replace(f">>{final}", f">>{shown}")
    plan_msg = Message("assistant", plan)
    return [
        RoleExample("planner", chat_text(head, open_turn=True), plan + "<|im_end|>"),
        RoleExample("solver", chat_text([*head, plan_msg], open_turn=True),
                    solution + "<|im_end|>"),
        RoleExample("critic",
                    chat_text([*head, plan_msg, Message("assistant", shown_solution)],
                              open_turn=True),
                    critic_message(final, shown) + "<|im_end|>"),
    ]
