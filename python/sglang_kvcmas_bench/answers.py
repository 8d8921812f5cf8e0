"""Final answers of recorded debates, and how two arms' turns agree: the same number, the same
greedy text, the first turn that differs."""

from __future__ import annotations

from sglang_kvcmas_bench.workload_runs import turn_key


def final_answers(turns: list[dict], n_debates: int) -> list[str | None]:
    """The final answer of debates ``0 .. n_debates - 1`` (``final_answer``)."""
    return [final_answer(turns, "debate", w) for w in range(n_debates)]


def final_answer(turns: list[dict], kind: str, wid: int) -> str | None:
    """The majority of the last step's answers (each reply's last number); a tie goes to the
    agent first by name, so the vote is the same in every process (a vote over a ``set`` broke
    ties by string hash order, which changes from one Python process to the next)."""
    from sglang_kvcmas_examples.datasets import last_number

    last = max(t["step"] for t in turns if t["wid"] == wid)
    answers = [last_number(t["text"]) for t in sorted(turns, key=lambda t: t["agent"])
               if t["wid"] == wid and t["step"] == last]
    answers = [a for a in answers if a is not None]
    return max(answers, key=answers.count) if answers else None  # first of the most common


def same_number(a: str | None, b: str | None) -> bool:
    """Whether two extracted answers are the same number (``"18"`` == ``"18.0"``)."""
    try:
        return a is not None and b is not None and float(a) == float(b)
    except ValueError:
        return a == b


def same_answer(a: str | None, b: str | None) -> bool:
    """Whether two debates' final answers agree: the same number, or no number in both."""
    return (a is None and b is None) or same_number(a, b)


def greedy_agreement(turns: list[dict], ref: dict[tuple, dict]) -> tuple[float, int]:
    """Share of turns whose greedy output is the reference arm's, over the turns whose prompts
    are the reference's (``ref``: ``turn_key`` -> reference turn); and how many those are."""
    same_prompt = [(t, ref[k]) for t in turns
                   if (k := turn_key(t)) in ref and ref[k]["prompt_ids"] == t["prompt_ids"]]
    return (sum(t["text"] == r["text"] for t, r in same_prompt) / max(1, len(same_prompt)),
            len(same_prompt))


def first_divergent_turn(turns: list[dict], ref: dict[tuple, dict], wid: int) -> dict | None:
    """The earliest turn of debate ``wid`` whose text differs from the reference arm's."""
    return next((t for t in sorted(turns, key=lambda t: (t["step"], t["agent"]))
                 if t["wid"] == wid and t["kind"] == "debate"
                 and t["text"] != ref[turn_key(t)]["text"]), None)
