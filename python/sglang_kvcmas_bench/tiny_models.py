"""Tiny random-weight models of other families, built locally (no download) for checks that
need a model's architecture, not its answers: tokenizer and chat template are the embedded
model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_qwen2(folder: Path, hidden_size: int = 64, heads: int = 4, kv_heads: int = 2,
               layers: int = 2) -> Path:
    """A ``Qwen2ForCausalLM`` (head size ``hidden_size / heads``) saved to ``folder`` with the
    embedded model's tokenizer files (ChatML template); returns ``folder``."""
    import torch
    from sglang_kvcmas.models.resolve import resolve_model_path
    from transformers import Qwen2Config, Qwen2ForCausalLM

    embedded = resolve_model_path(None)
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(embedded / name, folder / name)
    return folder
