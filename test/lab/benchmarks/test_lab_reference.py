"""The lab harness (``sglang_kvcmas_bench.lab``): fast greedy equals the model's naive greedy; metric bundle sanity."""

from __future__ import annotations

import torch
from sglang_kvcmas_bench.lab.records import summarize
from sglang_kvcmas_bench.lab.reference import fast_greedy, fidelity_bundle, make_reference
from sglang_kvcmas_lab.models.reference_llama import RefLlama
from transformers import LlamaConfig, LlamaForCausalLM


def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0)
    return RefLlama(LlamaForCausalLM(cfg).to(torch.float64).eval())


def test_fast_greedy_matches_naive_greedy():
    m = tiny()
    out = m.forward(torch.randint(0, 97, (19,)))
    assert fast_greedy(m, out.kv, out.logits[-1], 12) == m.greedy(out.kv, out.logits[-1], 12)
    shifted = out.kv.shifted(5)  # a re-positioned cache decodes the same way in both
    assert fast_greedy(m, shifted, out.logits[-1], 6) == m.greedy(shifted, out.logits[-1], 6)


def test_bundle_is_perfect_for_reference_and_not_for_a_perturbed_cache():
    m = tiny()
    ref = make_reference(m, torch.randint(0, 97, (15,)), 8)
    ok = fidelity_bundle(m, ref, ref.cache, ref.last_logits)
    assert ok["top1"] == 1.0 and ok["mean_kl"] < 1e-12 and ok["greedy_exact"] == 1.0
    bad = ref.cache.clone()
    bad.v[1] += 0.5 * torch.randn_like(bad.v[1])
    worse = fidelity_bundle(m, ref, bad, ref.last_logits)
    assert worse["mean_kl"] > 1e-6
    s = summarize([{"method": "x", "top1": 1.0, "mean_kl": 0.0, "greedy_exact": 1.0,
                    "first_divergence": 8, "ttft_s": 1.0, "bytes_held": 3,
                    "kv_rel_err_k": [0, 0.1], "kv_rel_err_v": [0, 0.2]}])
    assert s["x"]["kv_err_v"] == 0.2 and s["x"]["ttft_s"] == 1.0
