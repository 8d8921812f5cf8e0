"""PReCache identities on a tiny random Llama in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sglang_kvcmas_lab.correction.lora_forward import AgentModel, LoraForward
from sglang_kvcmas_lab.correction.lora_weights import TARGETS, AdapterSet, LoraFactors
from sglang_kvcmas_lab.correction.precache_pass import store_pass
from sglang_kvcmas_lab.correction.precache_read import split_read_forward
from sglang_kvcmas_lab.correction.precache_store import LowRankKVCache
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

RANK, SCALE, N_AGENTS = 4, 2.0, 3
TOL = dict(rtol=1e-9, atol=1e-10)


def _cfg() -> LlamaConfig:
    return LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0,
                       max_position_embeddings=512)


@pytest.fixture(scope="module")
def hf() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_cfg()).to(torch.float64).eval()


def tiny_lora(num_layers: int = 3) -> LoraForward:
    """A tiny random float64 Llama (seed 0) with ``num_layers`` layers and three random
    adapters (what the lab benchmarks' tests serve their methods with)."""
    torch.manual_seed(0)
    cfg = _cfg()
    cfg.num_hidden_layers = num_layers
    hf = LlamaForCausalLM(cfg).to(torch.float64).eval()
    return LoraForward(RefLlama(hf), random_adapters(hf))


def _dims(hf, target: str) -> tuple[int, int]:
    block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    mod = dict(hf.named_modules())[f"model.layers.0.{block}.{target}"]
    return mod.in_features, mod.out_features


def random_adapters(hf, *, zero_b: bool = False, targets=TARGETS, seed: int = 1) -> AdapterSet:
    g = torch.Generator().manual_seed(seed)
    per_agent = []
    for _ in range(N_AGENTS):
        layers = []
        for _ in range(hf.config.num_hidden_layers):
            layer = {}
            for t in targets:
                d_in, d_out = _dims(hf, t)
                a = torch.randn(d_in, RANK, generator=g, dtype=torch.float64) / d_in**0.5
                b = torch.randn(RANK, d_out, generator=g, dtype=torch.float64) * 0.3
                layer[t] = LoraFactors(a, torch.zeros_like(b) if zero_b else b, SCALE)
            layers.append(layer)
        per_agent.append(layers)
    return AdapterSet.from_agents(tuple(f"agent{i}" for i in range(N_AGENTS)), per_agent)


@pytest.fixture(scope="module")
def lora(hf) -> LoraForward:
    return LoraForward(RefLlama(hf), random_adapters(hf))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_explicit_lora_matches_peft(hf, lora):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=RANK, lora_alpha=RANK * SCALE, target_modules=list(TARGETS), lora_dropout=0.0))
    agent = 1
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in mod.lora_A:
            layer = int(name.split("layers.")[1].split(".")[0])
            f = lora.adapters.get(layer, name.rsplit(".", 1)[1], agent)
            mod.lora_A["default"].weight.data = f.a.T.clone()
            mod.lora_B["default"].weight.data = f.b.T.clone()
    ids = _ids(19, 0)
    ours = lora.forward(ids, agent=agent).logits
    theirs = RefLlama(model.eval()).forward(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-8)
    assert (ours - lora.forward(ids, agent=None).logits).abs().max() > 1e-3  # adapter matters


def test_writer_view_is_the_writers_dense_cache(lora):
    """K_i = X_i W_k + s (X_i A) B: a store written by agent i reproduces i's own K/V exactly."""
    ids = _ids(23, 1)
    for writer in range(N_AGENTS):
        dense = lora.forward(ids, agent=writer)
        out = store_pass(lora, ids, torch.arange(23), None, writer=writer)
        view = out.store.view(lora.adapters, writer)
        for layer in range(lora.spec.num_layers):
            torch.testing.assert_close(view.k[layer], dense.kv.k[layer], **TOL)
            torch.testing.assert_close(view.v[layer], dense.kv.v[layer], **TOL)
        torch.testing.assert_close(out.logits, dense.logits, **TOL)


def test_stacked_lowrank_equals_per_agent_products(lora):
    ids = _ids(11, 2)
    out = store_pass(lora, ids, torch.arange(11), None, writer=None, return_hidden=True)
    x = lora.ref.decoder.layers[1].input_layernorm(out.hidden[1])
    for agent in range(N_AGENTS):
        f = lora.adapters.get(1, "v_proj", agent)
        torch.testing.assert_close(out.store.agent_a(1, "v", agent, RANK), x @ f.a, **TOL)


@pytest.mark.parametrize("keys", ["lowrank", "base"])
@pytest.mark.parametrize("n_shared,n_new", [(1, 1), (17, 5), (30, 12)])
def test_split_read_equals_materialized_read(lora, keys, n_shared, n_new):
    """P (V0 + s a B) = P V0 + s (P a) B, with keys read the same way in both."""
    ids = _ids(n_shared + n_new, 3)
    store = store_pass(lora, ids[:n_shared], torch.arange(n_shared), None, writer=None).store
    pos = torch.arange(n_shared, n_shared + n_new)
    for agent in range(N_AGENTS):
        split = split_read_forward(lora, store, agent, ids[n_shared:], pos, keys=keys)
        naive = lora.forward(ids[n_shared:], pos, store.view(lora.adapters, agent, keys=keys),
                             agent=agent)
        torch.testing.assert_close(split.logits, naive.logits, **TOL)


def test_neutral_scheme_exact_when_every_b_is_zero(hf):
    """With B = 0 every adapter is the identity, so the neutral store is every agent's cache."""
    lora = LoraForward(RefLlama(hf), random_adapters(hf, zero_b=True))
    ids = _ids(29, 4)
    store = store_pass(lora, ids[:21], torch.arange(21), None, writer=None).store
    for agent in range(N_AGENTS):
        dense = lora.forward(ids, agent=agent)
        read = split_read_forward(lora, store, agent, ids[21:], torch.arange(21, 29))
        torch.testing.assert_close(read.logits, dense.logits[21:], **TOL)


def test_neutral_scheme_inexact_with_real_adapters(lora):
    """The same construction with B != 0 differs (so the identity above can fail)."""
    ids = _ids(29, 4)
    store = store_pass(lora, ids[:21], torch.arange(21), None, writer=None).store
    dense = lora.forward(ids, agent=0)
    read = split_read_forward(lora, store, 0, ids[21:], torch.arange(21, 29))
    assert (read.logits - dense.logits[21:]).abs().max() > 1e-4


def test_neutral_layer0_view_exact_for_any_adapter(lora):
    """Layer 0 reads embeddings, which no adapter touches: the neutral view is exact there."""
    ids = _ids(15, 5)
    store = store_pass(lora, ids, torch.arange(15), None, writer=None).store
    for agent in range(N_AGENTS):
        dense = lora.forward(ids, agent=agent).kv
        view = store.view(lora.adapters, agent)
        torch.testing.assert_close(view.k[0], dense.k[0], **TOL)
        torch.testing.assert_close(view.v[0], dense.v[0], **TOL)
        assert (view.v[2] - dense.v[2]).abs().max() > 1e-6  # deeper layers drift


def test_kv_only_adapters_neutral_exact_at_every_layer(hf):
    """Adapters on k/v only change nothing a later layer reads except through attention outputs,
    which the neutral pass does not see: so only layer 0 is exact — and keys-only (v untouched,
    o untouched) still drift through attention. Here only k is adapted and its B is zero except
    at the last layer: everything before the last layer is exact."""
    ad = random_adapters(hf, targets=("k_proj",))
    for layer in range(hf.config.num_hidden_layers - 1):
        ad.factors[layer]["k_proj"] = tuple(
            LoraFactors(f.a, torch.zeros_like(f.b), f.scale) for f in ad.factors[layer]["k_proj"])
    lora = LoraForward(RefLlama(hf), ad)
    ids = _ids(20, 6)
    store = store_pass(lora, ids[:14], torch.arange(14), None, writer=None).store
    for agent in range(N_AGENTS):
        dense = lora.forward(ids, agent=agent)
        read = split_read_forward(lora, store, agent, ids[14:], torch.arange(14, 20))
        torch.testing.assert_close(read.logits, dense.logits[14:], **TOL)


def test_lowrank_cache_concat_slice_roundtrip(lora):
    ids = _ids(18, 7)
    a = store_pass(lora, ids[:10], torch.arange(10), None, writer=None).store
    b = store_pass(lora, ids[10:], torch.arange(10, 18), a.base, writer=None).store
    both = LowRankKVCache.concat([a, b])
    assert len(both) == 18 and len(both.slice(10, 18)) == 8
    whole = store_pass(lora, ids, torch.arange(18), None, writer=None).store
    torch.testing.assert_close(both.view(lora.adapters, 2).v[2], whole.view(lora.adapters, 2).v[2],
                               **TOL)
    per_token = both.lowrank_nbytes() / 18
    assert per_token == 3 * 2 * N_AGENTS * RANK * 8  # layers x (k, v) x agents x r x float64


def test_greedy_first_divergence_is_first_teacher_forced_miss(lora):
    """Greedy output agrees with the reference until the first teacher-forced top-1 miss, so
    first divergence and exact match can be read off teacher forcing."""
    ids = _ids(21, 8)
    store = store_pass(lora, ids[:16], torch.arange(16), None, writer=1).store
    ref_model, test_model = AgentModel(lora, 0), AgentModel(lora, 0)
    dense = ref_model.forward(ids)
    ref_ids = ref_model.greedy(dense.kv, dense.logits[-1], 12)
    view = store.view(lora.adapters, 0)
    suffix = test_model.forward(ids[16:], past=view)
    cache = KVCache.concat([view, suffix.kv])
    test_ids = test_model.greedy(cache, suffix.logits[-1], 12)
    tf = torch.cat([suffix.logits[-1:], test_model.forward(torch.tensor(ref_ids[:-1]),
                                                           past=cache).logits])
    miss = [i for i in range(12) if int(tf[i].argmax()) != ref_ids[i]]
    first_tf = miss[0] if miss else 12
    first_greedy = next((i for i in range(12) if ref_ids[i] != test_ids[i]), 12)
    assert first_tf == first_greedy


def test_mean_agent_delta_is_the_mean_of_the_agents_deltas(lora):
    from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT

    x = torch.randn(5, 48, dtype=torch.float64)
    want = sum(lora.adapters.delta(2, "o_proj", x, i) for i in range(N_AGENTS)) / N_AGENTS
    torch.testing.assert_close(lora.adapters.delta(2, "o_proj", x, MEAN_AGENT), want, **TOL)


def test_mean_base_exact_when_agents_share_one_adapter(hf):
    """Centroid scheme: if every agent has the same adapter, the mean pass is each one's pass."""
    from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT

    one = random_adapters(hf)
    same = AdapterSet(one.names, [{t: (fs[0],) * N_AGENTS for t, fs in layer.items()}
                                  for layer in one.factors])
    lora = LoraForward(RefLlama(hf), same)
    ids = _ids(26, 9)
    store = store_pass(lora, ids[:19], torch.arange(19), None, writer=MEAN_AGENT).store
    for agent in range(N_AGENTS):
        dense = lora.forward(ids, agent=agent)
        read = split_read_forward(lora, store, agent, ids[19:], torch.arange(19, 26))
        torch.testing.assert_close(read.logits, dense.logits[19:], **TOL)


def test_rope_splits_over_the_lowrank_key(lora):
    """RoPE(X W_k + s (X A) B) = RoPE(X W_k) + RoPE(s (X A) B)."""
    from sglang_kvcmas_lab.models.reference_llama import rotate

    ids = _ids(13, 10)
    store = store_pass(lora, ids, torch.arange(13), None, writer=None).store
    k0 = store.base.k[1]
    f = lora.adapters.get(1, "k_proj", 2)
    delta = (f.scale * (store.agent_a(1, "k", 2, RANK) @ f.b)).view_as(k0)
    pos = torch.arange(40, 53)
    torch.testing.assert_close(rotate(k0 + delta, pos, 1000.0),
                               rotate(k0, pos, 1000.0) + rotate(delta, pos, 1000.0), **TOL)
