"""Plugin registration: idempotent, and nothing but registration."""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import pytest
from sglang.srt.mem_cache import registry
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvcmas import plugin
from sglang_kvcmas.integration import registration
from sglang_kvcmas.integration.tree_cache_factory import build_shared_tree_cache
from sglang_kvcmas.integration.server_state import (
    INTERNAL_STATE_TARGET,
    add_tree_cache_to_internal_state,
)


@pytest.fixture
def clean_registries(monkeypatch):
    """Empty SGLang's global registries for one test, restored afterwards."""
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())


def test_register_twice_registers_once(clean_registries):
    plugin.register()
    plugin.register()
    assert registry.registered_radix_cache_backends() == ["kvcmas"]
    assert registry.get_radix_cache_factory("kvcmas") is build_shared_tree_cache
    hooks = HookRegistry._hooks[INTERNAL_STATE_TARGET]
    assert hooks == [(HookType.AFTER, add_tree_cache_to_internal_state, None)]
    assert all(len(v) == 1 for v in HookRegistry._hooks.values())  # each hook once
    assert {registration.turn_order_hook.TARGET, registration.USAGE_TARGET} <= set(
        HookRegistry._hooks)


def test_registration_has_no_other_side_effects(clean_registries):
    env_before, path_before = dict(os.environ), list(sys.path)
    modules_before = set(sys.modules)
    plugin.register()
    assert dict(os.environ) == env_before
    assert sys.path == path_before
    assert "sgl_kernel" not in sys.modules
    assert HookRegistry._patched == set()  # hooks are applied by SGLang's load_plugins, not us
    new = {m for m in set(sys.modules) - modules_before if m.startswith("sglang_kvcmas")}
    assert not any("models" in m or "launch" in m for m in new), new


def test_name_taken_by_someone_else_is_an_error(clean_registries):
    registry.register_radix_cache_backend("kvcmas", lambda ctx: None)
    with pytest.raises(RuntimeError, match="already registered"):
        registration.register_cache_backend()


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvcmas") == "sglang_kvcmas.plugin:register"


def test_internal_state_hook_names_the_tree_cache():
    class Result:
        internal_state: dict = {}

    from sglang_kvcmas.integration.radix_cache_backend import KvcmasRadixCache

    result = Result()
    result.internal_state = {"x": 1}
    controller = type("C", (), {"scheduler": type("S", (), {
        "tree_cache": KvcmasRadixCache.create_simulated()})()})()
    assert add_tree_cache_to_internal_state(result, controller, None) is result
    assert result.internal_state["x"] == 1
    assert result.internal_state["kvcmas"]["tree_cache_class"].endswith(".KvcmasRadixCache")
