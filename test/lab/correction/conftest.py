"""A tiny random Llama in float64 and a two-agent read request over it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sglang_kvcmas_lab.correction import ReadRequest, SharedRead
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

VOCAB = 97


@pytest.fixture(scope="session")
def tiny() -> RefLlama:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0,
        max_position_embeddings=512,
    )
    return RefLlama(LlamaForCausalLM(cfg).to(torch.float64).eval())


def make_request(model: RefLlama, *, seed: int = 0, seg_lens=(23, 17), head_a=7, head_b=11,
                 suffix=3, with_reference=True):
    """Agent a (owner) reads head_a + segments; agent b reads head_b + the same segments.

    Returns (request for b, dense ids of b's prompt, a's exact cache of its whole prompt).
    """
    g = torch.Generator().manual_seed(seed)
    ha = torch.randint(0, VOCAB, (head_a,), generator=g)
    hb = torch.randint(0, VOCAB, (head_b,), generator=g)
    segs = [torch.randint(0, VOCAB, (n,), generator=g) for n in seg_lens]
    suf = torch.randint(0, VOCAB, (suffix,), generator=g)
    owner = model.forward(torch.cat([ha, *segs])).kv
    prefix = model.forward(hb).kv
    dense_ids = torch.cat([hb, *segs, suf])
    ref = model.forward(dense_ids).kv if with_reference else None
    reads, pos_a, pos_b, ref_views = [], head_a, head_b, []
    for i, s in enumerate(segs):
        n = s.numel()
        base = owner.slice(pos_a, pos_a + n)
        reads.append(SharedRead(i, "a", s, base, torch.arange(pos_b, pos_b + n), f"s{i}"))
        if ref is not None:
            ref_views.append(ref.slice(pos_b, pos_b + n))
        pos_a += n
        pos_b += n
    req = ReadRequest("b", prefix, hb, tuple(reads), suf,
                      tuple(ref_views) if ref is not None else None)
    return req, dense_ids, owner


def assert_cache_close(a: KVCache, b: KVCache, tol: float = 1e-9) -> None:
    assert torch.equal(a.positions, b.positions)
    for x, y in zip([*a.k, *a.v], [*b.k, *b.v], strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
