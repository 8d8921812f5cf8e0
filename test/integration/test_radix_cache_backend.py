"""The ``kvcmas`` backend: a RadixCache subclass that behaves like SGLang's RadixCache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_kvcmas.integration.radix_cache_backend import BACKEND_NAME, KvcmasRadixCache
from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache
from sglang_kvcmas.integration.tree_cache_factory import build_shared_tree_cache


class RecordingAllocator:
    """Mock token-to-KV allocator: records which slots the tree frees."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, indices: torch.Tensor) -> None:
        self.freed.extend(indices.tolist())

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.free(indices)


def _insert(cache, tokens: list[int], first_slot: int) -> int:
    value = torch.arange(first_slot, first_slot + len(tokens), dtype=torch.int64)
    return cache.insert(InsertParams(key=RadixKey(tokens), value=value)).prefix_len


def _match(cache, tokens: list[int]) -> tuple[int, list[int]]:
    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    return result.device_prefix_len, cache.path_device_indices(result.last_device_node).tolist()


def test_is_a_radix_cache_named_kvcmas():
    cache = KvcmasRadixCache.create_simulated()
    assert isinstance(cache, KvcmasRadixCache) and isinstance(cache, RadixCache)
    assert cache.backend_name == BACKEND_NAME == "kvcmas"
    assert cache.supports_prefix_sharing()


def test_shares_prefixes_and_returns_slot_indices():
    cache = KvcmasRadixCache.create_simulated()
    assert _insert(cache, [1, 2, 3, 4], first_slot=100) == 0
    assert _insert(cache, [1, 2, 9], first_slot=200) == 2  # [1, 2] already cached
    assert _match(cache, [1, 2, 3, 4, 5]) == (4, [100, 101, 102, 103])
    assert _match(cache, [1, 2, 9]) == (3, [100, 101, 202])
    assert _match(cache, [7, 8]) == (0, [])
    assert cache.total_size() == 5


def test_lock_protects_from_eviction_and_eviction_frees_slots():
    allocator = RecordingAllocator()
    cache = KvcmasRadixCache.create_simulated(mock_allocator=allocator)
    _insert(cache, [1, 2, 3], first_slot=10)
    _insert(cache, [5, 6], first_slot=20)
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]))).last_device_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.evict(EvictParams(num_tokens=100))
    assert sorted(allocator.freed) == [20, 21]  # only the unlocked branch
    assert _match(cache, [1, 2, 3])[0] == 3
    cache.dec_lock_ref(node)
    cache.evict(EvictParams(num_tokens=100))
    assert sorted(allocator.freed) == [10, 11, 12, 20, 21]
    assert cache.total_size() == 0


def test_disabled_cache_matches_nothing():
    cache = KvcmasRadixCache.create_simulated(disable=True)
    _insert(cache, [1, 2, 3], first_slot=0)
    assert _match(cache, [1, 2, 3])[0] == 0


token_lists = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), max_size=8)


@settings(max_examples=60, deadline=None)
@given(inserts=token_lists, queries=token_lists)
def test_same_matches_as_sglang_radix_cache(inserts, queries):
    ours, theirs = KvcmasRadixCache.create_simulated(), RadixCache.create_simulated()
    slot = 0
    for tokens in inserts:
        assert _insert(ours, tokens, slot) == _insert(theirs, tokens, slot)
        slot += len(tokens)
    for tokens in queries:
        assert _match(ours, tokens) == _match(theirs, tokens)
    assert ours.total_size() == theirs.total_size()


def _ctx(**overrides) -> SimpleNamespace:
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=None, page_size=1)
    fields = dict(params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                  enable_hierarchical_cache=False, disable_radix_cache=False, is_dsa=False,
                  tp_rank=0, server_args=None)
    return SimpleNamespace(**{**fields, **overrides})


def test_factory_builds_our_cache_and_logs_it(caplog, monkeypatch):
    monkeypatch.delenv("KVCMAS_SHARE_CONTEXT", raising=False)
    with caplog.at_level("INFO", logger="sglang_kvcmas.integration.tree_cache_factory"):
        cache = build_shared_tree_cache(_ctx())
    assert type(cache) is KvcmasSharedTreeCache and not cache.share_context
    assert "KvcmasSharedTreeCache in use (radix cache backend 'kvcmas'" in caplog.text


@pytest.mark.parametrize("feature", ["is_hybrid_swa", "is_hybrid_ssm",
                                     "enable_hierarchical_cache", "is_dsa"])
def test_factory_rejects_unsupported_features_clearly(feature):
    with pytest.raises(ValueError, match="run without --radix-cache-backend"):
        build_shared_tree_cache(_ctx(**{feature: True}))


def test_sharing_needs_an_attention_backend_that_reads_borrowed_kv(monkeypatch):
    monkeypatch.setenv("KVCMAS_SHARE_CONTEXT", "1")
    args = SimpleNamespace(attention_backend="fa3", prefill_attention_backend=None,
                           decode_attention_backend=None, tokenizer_path=None, model_path=None)
    with pytest.raises(ValueError, match=r"attention backends \['flashinfer', 'kvcmas_delta', "
                                         r"'torch_native', 'triton'\] do; got \['fa3'\]"):
        build_shared_tree_cache(_ctx(server_args=args))
    args.attention_backend, args.decode_attention_backend = "triton", "fa3"  # split: both count
    with pytest.raises(ValueError, match="got \\['fa3', 'triton'\\]"):
        build_shared_tree_cache(_ctx(server_args=args))
    args.decode_attention_backend = None
    for name in ("kvcmas_delta", "torch_native", "triton", "flashinfer"):
        args.attention_backend = name
        assert build_shared_tree_cache(_ctx(server_args=args)).share_context
    paged = CacheInitParams(disable=False, req_to_token_pool=None,
                            token_to_kv_pool_allocator=None, page_size=16)
    with pytest.raises(ValueError, match="--page-size 1"):
        build_shared_tree_cache(_ctx(server_args=args, params=paged))
