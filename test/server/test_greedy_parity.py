"""Greedy output through our launcher equals transformers' greedy output (fp32 both)."""

from __future__ import annotations

import pytest
import requests
import torch

pytestmark = [pytest.mark.server, pytest.mark.slow]

NEW_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_kvcmas.models.resolve import resolve_model_path

    path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # One thread, like the server: two OpenMP threads crawl on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tokenizer, model
    torch.set_num_threads(threads)


@torch.inference_mode()
def hf_greedy(model, input_ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding, never stopping at EOS (the server is told to ignore it too)."""
    out = model(torch.tensor([input_ids]), use_cache=True)
    past, generated = out.past_key_values, []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return generated


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(server, hf_model, prompt):
    tokenizer, model = hf_model
    input_ids = tokenizer(prompt)["input_ids"]
    r = requests.post(
        f"{server.url}/generate",
        json={"input_ids": input_ids,
              "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                                  "ignore_eos": True}},
        timeout=120,
    )
    r.raise_for_status()
    served = r.json()["output_ids"]
    expected = hf_greedy(model, input_ids, NEW_TOKENS)
    assert served == expected, (
        f"server {tokenizer.decode(served)!r} != transformers {tokenizer.decode(expected)!r}"
    )
