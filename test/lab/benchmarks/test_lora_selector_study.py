"""The LoRA selector study's reader view and centroid pass against plain dense forwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.bench_scripts import load_script

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab" / "correction"))

from sglang_kvcmas_lab.correction.lora_forward import LoraForward  # noqa: E402
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT  # noqa: E402
from sglang_kvcmas_lab.models.reference_llama import KVCache, keys_with_past  # noqa: E402
from test_precache import tiny_lora  # noqa: E402

study = load_script("benchmark/lab/lora_selector_study.py")
Point, centroid_pass, default_picks = study.Point, study.centroid_pass, study.default_picks
pick, reader_view, scores = study.pick, study.reader_view, study.scores

TOL = dict(rtol=1e-9, atol=1e-9)
HEAD, BLOCK = 5, 23


@pytest.fixture(scope="module")
def lora() -> LoraForward:
    return tiny_lora(num_layers=7)  # probe layers 2 and 6


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 97, (HEAD + BLOCK,), generator=torch.Generator().manual_seed(4))


def test_every_token_recomputed_is_the_exact_prefill(lora, ids):
    exact = lora.forward(ids, agent=1)
    base = lora.forward(ids, agent=MEAN_AGENT).kv.slice(HEAD, HEAD + BLOCK)
    cache, logits = reader_view(lora, 1, exact.kv.slice(0, HEAD), base, ids[HEAD:],
                                torch.arange(BLOCK))
    torch.testing.assert_close(logits, exact.logits[-1], **TOL)
    for a, b in zip([*cache.k, *cache.v], [*exact.kv.k, *exact.kv.v]):
        torch.testing.assert_close(a, b, **TOL)


def test_picks_read_the_centroid_elsewhere(lora, ids):
    """Picks [3, 9, last]: a dense pass over every token whose K/V are swapped for the
    centroid's outside the picks at every layer gives the same logits."""
    head = lora.forward(ids[:HEAD], agent=2).kv
    cbase = lora.forward(ids, agent=MEAN_AGENT).kv.slice(HEAD, HEAD + BLOCK)
    sel = torch.tensor([3, 9, BLOCK - 1])
    _, logits = reader_view(lora, 2, head, cbase, ids[HEAD:], sel)

    keep = torch.ones(BLOCK, dtype=torch.bool)
    keep[sel] = False
    h, pos = lora.ref.embed(ids[HEAD:]), cbase.positions
    for layer in range(lora.spec.num_layers):
        _, q, k, v = lora.qkv(layer, h, 2)
        k = torch.where(keep[:, None, None], cbase.k[layer], k)
        v = torch.where(keep[:, None, None], cbase.v[layer], v)
        kk, vv, kp = keys_with_past(head, layer, k, v, pos)
        h = lora.finish_layer(layer, h, lora.ref.attend(q, pos, kk, vv, kp), 2)
    torch.testing.assert_close(logits, lora.ref.logits(h[-1:])[0], **TOL)


def test_centroid_pass_is_the_mean_agents_prefill_with_head_mass(lora, ids):
    kv, mass = centroid_pass(lora, ids, HEAD)
    ref = lora.forward(ids, agent=MEAN_AGENT).kv
    for a, b in zip([*kv.k, *kv.v], [*ref.k, *ref.v]):
        torch.testing.assert_close(a, b, **TOL)
    assert mass.shape == (HEAD + BLOCK,)
    torch.testing.assert_close(mass[:HEAD], torch.ones(HEAD, dtype=mass.dtype), **TOL)
    assert bool(((mass[HEAD:] > 0) & (mass[HEAD:] < 1)).all())


def test_picks_keep_the_defaults_and_add_the_best_scored():
    keep = default_picks(50, (0, 20))
    assert keep[:8].all() and keep[20:28].all() and keep[18:].all() and not keep[8:18].any()
    score = torch.zeros(50)
    score[[9, 11, 2]] = torch.tensor([1.0, 3.0, 9.0])  # 2 is a default pick already
    assert pick(keep, score, 2).tolist() == [*range(8), 9, 11, *range(18, 50)]


def test_own_scores_rank_the_readers_messages_first():
    p = Point(reader=1, after="planner", question=0,
              ids=torch.zeros(3 + 12, dtype=torch.long),
              head_len=3, starts=(0, 4, 8, 10), owners=(None, 1, 0, None))
    own = p.own()
    assert own.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    z = torch.zeros(12, 1, 1)
    s = scores("own", p, torch.zeros(12), None, KVCache([z], [z], torch.arange(12)), 0)
    assert set(torch.topk(s, 4).indices.tolist()) == {4, 5, 6, 7}
