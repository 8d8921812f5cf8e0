"""Prompts of the debate agents over a transcript of real text, as token ids (the robustness
benchmarks' load)."""

from __future__ import annotations

import random
from pathlib import Path

from sglang_kvcmas_bench.workflows import DEBATERS, chat_prompt_ids


class Prompts:
    """ChatML prompts of the debate agents over a transcript, as token ids."""

    def __init__(self, model_folder: Path | None = None) -> None:
        """``model_folder``: the served model's HF folder (default: the embedded model's)."""
        from sglang_kvcmas.models.resolve import resolve_model_path
        from sglang_kvcmas_examples.datasets import gsm8k
        from transformers import AutoTokenizer

        folder = model_folder or resolve_model_path(None)
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.questions = [it.question for it in gsm8k()[:200]]
        self.agents = list(DEBATERS)

    def ids(self, agent: str, transcript: str) -> list[int]:
        msgs = [{"role": "system", "content": DEBATERS[agent]},
                {"role": "user", "content": transcript}]
        return chat_prompt_ids(self.tok, msgs)

    def filler(self, n_tokens: int, seed: int) -> str:
        """A transcript of about ``n_tokens`` tokens of real text."""
        rng = random.Random(seed)
        parts, total = [], 0
        while total < n_tokens:
            q = rng.choice(self.questions)
            parts.append(q)
            total += len(self.tok.encode(q, add_special_tokens=False))
        return "\n\n".join(parts)
