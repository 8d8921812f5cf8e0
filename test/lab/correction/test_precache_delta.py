"""Drift pass and centroid + delta-leaf sharing on a tiny random Llama in float64."""

from __future__ import annotations

import pytest
import torch
from test_precache import N_AGENTS, TOL, _ids, hf, lora  # noqa: F401  (fixtures)

import sglang_kvcmas_lab.correction.lora_baselines  # noqa: F401  (registration)
from sglang_kvcmas_lab.correction.lora_weights import MEAN_AGENT
from sglang_kvcmas_lab.correction.precache_base import Segment, create_lora_method
from sglang_kvcmas_lab.correction.precache_delta import delta_leaf
from sglang_kvcmas_lab.correction.precache_drift import drift_pass
from sglang_kvcmas_lab.correction.precache_pass import store_pass
from sglang_kvcmas_lab.models.reference_llama import KVCache

HEAD_DIM = 8  # 48 / 6 heads: a rank-8 leaf per head is exact


def _close(a: KVCache, b: KVCache, **tol) -> None:
    for x, y in zip((*a.k, *a.v), (*b.k, *b.v), strict=True):
        torch.testing.assert_close(x, y, **(tol or TOL))


@pytest.mark.parametrize("shared", [None, MEAN_AGENT])
def test_drift_pass_with_own_attention_and_mlp_is_each_agents_dense_pass(lora, shared):
    ids = _ids(29, 3)
    split = 17  # two calls: the second reads the first's views as its past
    pos = torch.arange(ids.numel())
    first = drift_pass(lora, ids[:split], pos[:split], None, None, shared=shared,
                       attention="own", mlp="own")
    past_shared = first.store.view(lora.adapters, shared)
    second = drift_pass(lora, ids[split:], pos[split:], past_shared, first.views,
                        shared=shared, attention="own", mlp="own")
    for agent in range(N_AGENTS):
        dense = lora.forward(ids, agent=agent).kv
        _close(KVCache.concat([first.views[agent], second.views[agent]]), dense)


def test_drift_pass_store_is_the_store_pass(lora):
    ids, pos = _ids(13, 4), torch.arange(13)
    ours = drift_pass(lora, ids, pos, None, None, shared=MEAN_AGENT, attention="shared",
                      mlp="shared").store
    theirs = store_pass(lora, ids, pos, None, writer=MEAN_AGENT).store
    _close(ours.base, theirs.base)
    for a, b in zip((*ours.a_k, *ours.a_v), (*theirs.a_k, *theirs.a_v), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_drift_pass_shared_modes_differ_from_exact(lora):
    ids, pos = _ids(13, 5), torch.arange(13)
    out = drift_pass(lora, ids, pos, None, None, attention="shared", mlp="shared")
    dense = lora.forward(ids, agent=1).kv
    assert (out.views[1].v[-1] - dense.v[-1]).norm() > 1e-6  # first order, not exact
    torch.testing.assert_close(out.views[1].v[0], dense.v[0], **TOL)  # layer 0 is


@pytest.mark.parametrize("n_old,n_new", [(1, 1), (17, 5)])
def test_full_rank_leaf_reproduces_the_deviation_and_merges(lora, n_old, n_new):
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return KVCache([torch.randn(n, 2, HEAD_DIM, generator=g, dtype=torch.float64)
                        for _ in range(3)],
                       [torch.randn(n, 2, HEAD_DIM, generator=g, dtype=torch.float64)
                        for _ in range(3)], torch.arange(n))

    own_old, view_old, own_new, view_new = rand(n_old), rand(n_old), rand(n_new), rand(n_new)
    old = delta_leaf(0, 0, own_old, view_old, HEAD_DIM)
    got = old.apply(view_old)
    torch.testing.assert_close(got.k[0], view_old.k[0])  # layer 0: no leaf
    for layer in (1, 2):
        torch.testing.assert_close(got.k[layer], own_old.k[layer], **TOL)
        torch.testing.assert_close(got.v[layer], own_old.v[layer], **TOL)
    merged = delta_leaf(0, 0, own_new, view_new, HEAD_DIM, old=old)
    both = merged.apply(KVCache.concat([view_old, view_new]))
    for layer in (1, 2):
        torch.testing.assert_close(both.v[layer], torch.cat([own_old.v[layer],
                                                             own_new.v[layer]]), **TOL)
    assert delta_leaf(0, 0, own_old, view_old, 2, keys=False).k[1] is None


def _transcript():
    return [Segment(_ids(11, 10), None), Segment(_ids(7, 11), 0), Segment(_ids(9, 12), 1),
            Segment(_ids(5, 13), None), Segment(_ids(6, 14), 2)]


@pytest.mark.parametrize("kw,num_leaves", [({}, 5), ({"merged": True}, 1), ({"chunk": 15}, 2)])
def test_full_rank_centroid_delta_equals_no_sharing(lora, kw, num_leaves):
    ours = create_lora_method("rebase_mean_delta", rank=HEAD_DIM, **kw)
    ref = create_lora_method("no_sharing")
    suffix = _ids(3, 20)
    for m in (ours, ref):
        m.reset(lora)
    for seg in _transcript():
        ours.append(seg)
        ref.append(seg)
        for reader in range(N_AGENTS):
            _close(ours.view(reader), ref.view(reader), rtol=1e-8, atol=1e-9)
            torch.testing.assert_close(ours.first_token(reader, suffix)(),
                                       ref.first_token(reader, suffix)(), rtol=1e-8, atol=1e-9)
        ours.background_work()()
    assert ours.bytes_held(N_AGENTS) > ours.store.nbytes()
    assert len(ours.leaves) == num_leaves  # segments of 11, 7, 9, 5, 6 tokens


def test_low_rank_centroid_delta_is_between_centroid_and_exact(lora):
    segs = _transcript()
    methods = {k: create_lora_method(k, **kw) for k, kw in
               {"rebase_mean": {}, "rebase_mean_delta": {"rank": 2}}.items()}
    ref = create_lora_method("no_sharing")
    for m in (*methods.values(), ref):
        m.reset(lora)
        for seg in segs:
            m.append(seg)
    exact = ref.view(2)

    def err(view):
        return sum(float((a - b).norm()) for a, b in zip(view.v, exact.v))

    assert err(methods["rebase_mean_delta"].view(2)) < err(methods["rebase_mean"].view(2))


def test_centroid_block_over_every_layer_from_layer_0_is_exact(lora):
    import sglang_kvcmas_lab.correction.precache_block  # noqa: F401  (registration)

    ours = create_lora_method("rebase_mean_block", start=0,
                              width=lora.spec.num_layers)
    ref = create_lora_method("no_sharing")
    suffix = _ids(3, 21)
    for m in (ours, ref):
        m.reset(lora)
    for seg in _transcript():
        ours.append(seg)
        ref.append(seg)
    for reader in range(N_AGENTS):
        _close(ours.view(reader), ref.view(reader), rtol=1e-8, atol=1e-9)
        torch.testing.assert_close(ours.first_token(reader, suffix)(),
                                   ref.first_token(reader, suffix)(), rtol=1e-8, atol=1e-9)
