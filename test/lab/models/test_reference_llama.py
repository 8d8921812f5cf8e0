"""The reference forward reproduces Hugging Face's, and its cache identities hold exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama, rotate


@pytest.fixture(scope="module")
def tiny() -> RefLlama:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0, max_position_embeddings=512,
    )
    return RefLlama(LlamaForCausalLM(cfg).to(torch.float64).eval())


def test_matches_hf_logits(tiny):
    ids = torch.randint(0, 97, (23,))
    ref = tiny.forward(ids).logits
    hf = tiny.hf(ids[None]).logits[0]
    # HF builds RoPE frequencies in float32 even for a float64 model (ours are float64), which
    # bounds the agreement at ~1e-8 here; everything else is the same arithmetic.
    torch.testing.assert_close(ref, hf, rtol=1e-6, atol=1e-7)


def test_incremental_equals_full(tiny):
    ids = torch.randint(0, 97, (31,))
    full = tiny.forward(ids)
    a = tiny.forward(ids[:20])
    b = tiny.forward(ids[20:], past=a.kv)
    torch.testing.assert_close(b.logits, full.logits[20:], rtol=1e-10, atol=1e-10)
    both = KVCache.concat([a.kv, b.kv])
    for k_full, k_inc in zip(full.kv.k, both.k):
        torch.testing.assert_close(k_inc, k_full, rtol=1e-10, atol=1e-10)


def test_rerotation_composes():
    x = torch.randn(17, 3, 8, dtype=torch.float64)
    p = torch.arange(5, 22)
    torch.testing.assert_close(rotate(rotate(x, p, 1e4), torch.full_like(p, 9), 1e4),
                               rotate(x, p + 9, 1e4), rtol=1e-12, atol=1e-12)


def test_layer0_kv_is_prefix_free_and_shift_invariant(tiny):
    """Layer-0 pre-RoPE K/V of a segment depend neither on what precedes it nor on its offset."""
    seg = torch.randint(0, 97, (12,))
    alone = tiny.forward(seg).kv
    after = tiny.forward(torch.cat([torch.randint(0, 97, (7,)), seg])).kv.slice(7, 19)
    # Equal up to float64 rounding (matmul blocking differs with the number of rows).
    torch.testing.assert_close(after.k[0], alone.k[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after.v[0], alone.v[0], rtol=1e-12, atol=1e-12)


def test_shifted_whole_sequence_is_exact(tiny):
    """A cache computed at positions 0.. and read at 0+δ.. equals computing it at δ.. (all
    layers, since every relative distance is preserved)."""
    ids = torch.randint(0, 97, (15,))
    tail = torch.randint(0, 97, (4,))
    a = tiny.forward(ids)
    moved = tiny.forward(tail, past=a.kv.shifted(11))
    direct = tiny.forward(tail, past=tiny.forward(ids, positions=torch.arange(11, 26)).kv)
    torch.testing.assert_close(moved.logits, direct.logits, rtol=1e-10, atol=1e-10)
