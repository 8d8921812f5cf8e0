"""The KVCMAS lab's replay on a tiny random model: every registered lab method runs, owner turns
and exact methods are exact, and the chosen KVCMAS recomputes only part of what it reads."""

from __future__ import annotations

import pytest
import torch
from helpers.bench_scripts import load_script
from sglang_kvcmas_bench.lab.reference import make_reference
from sglang_kvcmas_bench.lab.transcripts import Transcript, Turn
from sglang_kvcmas_lab.correction import create_builder
from sglang_kvcmas_lab.models.reference_llama import RefLlama
from transformers import LlamaConfig, LlamaForCausalLM

lab = load_script("benchmark/lab/kvcmas_lab.py")
METHODS, parse_method, run_method = lab.METHODS, lab.parse_method, lab.run_method

VOCAB = 97


@pytest.fixture(scope="module")
def tiny() -> RefLlama:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0,
                      max_position_embeddings=512)
    return RefLlama(LlamaForCausalLM(cfg).to(torch.float64).eval())


class _Sink:
    def write(self, config, rec):
        return rec


def tiny_transcript(model, *, agents=3, rounds=2, seg=9, ans=7, head=5):
    """A debate-shaped transcript over random ids: task segment, one answer segment per turn."""
    g = torch.Generator().manual_seed(1)
    names = ("solver", "skeptic", "tutor", "estimator")[:agents]
    heads = {a: torch.randint(0, VOCAB, (head + i,), generator=g) for i, a in enumerate(names)}
    suffix = torch.randint(0, VOCAB, (2,), generator=g)
    segs = [torch.randint(0, VOCAB, (seg,), generator=g)]

    class _WL:
        name, instance = "debate", 0

    wlo = _WL()
    wlo.agents = names
    tr = Transcript(wlo, heads)
    for r in range(rounds):
        for a in names:
            prompt = torch.cat([heads[a], *segs, suffix])
            ref = make_reference(model, prompt, 6)
            answer = torch.cat([suffix, torch.randint(0, VOCAB, (ans,), generator=g)])
            tr.turns.append(Turn(a, r, list(segs), suffix, answer, ref))
            segs.append(answer)
    return tr


@pytest.fixture(scope="module")
def replay(tiny):
    tr = tiny_transcript(tiny)
    heads = {a: tiny.forward(h).kv for a, h in tr.heads.items()}
    return tr, heads


@pytest.mark.parametrize("label", list(METHODS))
def test_every_lab_method_replays(tiny, replay, label):
    tr, heads = replay
    _, reg, kw = parse_method(label)
    recs, _ = run_method(tiny, tr, label, create_builder(reg, **kw), heads, 1, True, _Sink(),
                         {}, lambda m: None, greedy_tokens=4)
    assert len(recs) == len(tr.turns)
    for r in recs:
        if r["is_owner_turn"] or reg in ("no_sharing", "prefix_caching", "kvcomm"):
            assert r["mean_kl"] < 1e-9 and r["top1"] == 1.0
    reads = [r for r in recs if not r["is_owner_turn"]]
    assert reads and all(r["ttft_s"] >= 0 and r["bytes_held"] > 0 for r in reads)
    if label == "kvcmas":
        assert 0 < sum(r["recomputed_tokens"] for r in reads) < sum(
            r["new_shared_tokens"] for r in reads)
