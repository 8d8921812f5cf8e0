"""Every SGLang symbol sglang-kvcmas relies on, with the signature we rely on.

An SGLang upgrade that moves, renames or re-signs one of them fails HERE, in one obvious place,
rather than deep inside a server boot. ``test_contract_lists_every_import`` keeps the list
complete: it scans python/sglang_kvcmas/ for ``from sglang... import`` statements.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import sglang_kvcmas

PACKAGE_DIR = Path(sglang_kvcmas.__file__).parent

# (module, name) -> parameter names we call it with (leading ones, in order), or None for a
# class / value whose presence is what we rely on (further checks below).
CONTRACT: dict[tuple[str, str], tuple[str, ...] | None] = {
    ("sglang.srt.mem_cache.registry", "register_radix_cache_backend"): ("name", "factory"),
    ("sglang.srt.mem_cache.registry", "get_radix_cache_factory"): ("name",),
    ("sglang.srt.mem_cache.registry", "TreeCacheBuildContext"): None,
    ("sglang.srt.plugins.hook_registry", "HookRegistry"): None,
    ("sglang.srt.plugins.hook_registry", "HookType"): None,
    ("sglang.srt.mem_cache.cache_init_params", "CacheInitParams"): (
        "disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size"),
    ("sglang.srt.mem_cache.radix_cache", "RadixCache"): ("params",),
    ("sglang.launch_server", "run_server"): ("server_args",),
    ("sglang.srt.entrypoints.http_server", "app"): None,  # our /kvcmas/workflows routes
    ("sglang.srt.plugins", "load_plugins"): (),
    ("sglang.srt.server_args", "ServerArgs"): None,
    ("sglang.srt.server_args", "prepare_server_args"): ("argv",),
    ("sglang.srt.utils", "kill_process_tree"): ("parent_pid", "include_parent"),
    # shared-context serving path (shared_*.py, delta_attention_backend.py, reuse_accounting.py)
    ("sglang.srt.entrypoints.openai.protocol", "PromptTokensDetails"): ("cached_tokens",),
    ("sglang.srt.layers.attention.attention_registry", "ATTENTION_BACKENDS"): None,
    # sharing over SGLang's own backends: the resolved attention backends (tree_cache_factory.py)
    ("sglang.srt.arg_groups.model_override_base", "resolved_view"): ("server_args",),
    ("sglang.srt.arg_groups.model_override_base", "attention_backends_of"): ("cfg",),
    ("sglang.srt.layers.attention.attention_registry", "register_attention_backend"): ("name",),
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend"): (
        "model_runner",),
    # head mass read beside the user's backend (stock_probes.py): which layers are causal
    ("sglang.srt.layers.radix_attention", "AttentionType"): None,
    ("sglang.srt.managers.schedule_batch", "FINISH_ABORT"): None,
    ("sglang.srt.managers.schedule_batch", "Req"): None,
    ("sglang.srt.managers.schedule_policy", "AddReqResult"): None,
    ("sglang.srt.mem_cache.base_prefix_cache", "EvictParams"): ("num_tokens",),
    ("sglang.srt.mem_cache.base_prefix_cache", "EvictResult"): ("num_tokens_evicted",),
    ("sglang.srt.mem_cache.base_prefix_cache", "MatchPrefixParams"): ("key",),
    ("sglang.srt.mem_cache.base_prefix_cache", "MatchResult"): (
        "device_prefix_len", "last_device_node", "last_host_node", "best_match_node"),
    ("sglang.srt.mem_cache.base_prefix_cache", "TreeLock"): ("node",),
    ("sglang.srt.mem_cache.radix_cache", "RadixKey"): ("token_ids", "extra_key"),
    ("sglang.srt.model_executor.model_runner", "ModelRunner"): None,
    ("sglang.srt.runtime_context", "get_server_args"): (),
    ("sglang.srt.runtime_context", "get_schedule"): (),
    ("sglang.srt.server_args", "ATTENTION_BACKEND_CHOICES"): None,
    ("sglang.srt.server_args", "add_attention_backend_choices"): ("iterable",),
    # the shift's rotary from SGLang's own modules (rope_shift.py)
    ("sglang.srt.layers.rotary_embedding", "get_rope"): (
        "head_size", "rotary_dim", "max_position", "base", "is_neox_style", "rope_scaling"),
    ("sglang.srt.layers.rotary_embedding.base", "RotaryEmbedding"): None,
    ("sglang.srt.layers.rotary_embedding.base", "LinearScalingRotaryEmbedding"): None,
    ("sglang.srt.layers.rotary_embedding.rope_variant", "DynamicNTKAlphaRotaryEmbedding"): None,
    ("sglang.srt.layers.rotary_embedding.rope_variant", "DynamicNTKScalingRotaryEmbedding"): None,
    ("sglang.srt.layers.rotary_embedding.rope_variant", "Llama3RotaryEmbedding"): None,
    ("sglang.srt.layers.rotary_embedding.yarn", "YaRNScalingRotaryEmbedding"): None,
    # LoRA agents: the CPU LoRA backend (cpu_lora.py), /load_lora_adapter's check
    # (lora_hooks.py), prefills the HTTP process sends (head_first.py, fidelity_monitor.py)
    ("sglang.srt.lora.backend.lora_registry", "LORA_SUPPORTED_BACKENDS"): None,
    ("sglang.srt.managers.io_struct", "GenerateReqInput"): ("text", "input_ids"),
    ("sglang.srt.managers.io_struct", "LoadLoRAAdapterReqOutput"): None,  # success=, error_message=
    # agent detection from the served chat template (chat_template_markers.py)
    ("sglang.srt.parser.conversation", "chat_templates"): None,
    ("sglang.srt.parser.conversation", "chat_template_exists"): ("template_name",),
    ("sglang.srt.parser.conversation", "get_conv_template_by_model_path"): ("model_path",),
    # the frontend endpoint that names a workflow (frontend.py): it overrides these three
    ("sglang.lang.backend.runtime_endpoint", "RuntimeEndpoint"): (
        "base_url", "api_key", "verify", "chat_template_name"),
}


@pytest.mark.parametrize(("method", "params"), [
    ("generate", ["s", "sampling_params"]), ("generate_stream", ["s", "sampling_params"]),
    ("_generate_http_request", ["s", "data"])])
def test_the_frontend_endpoint_methods_we_override(method, params):
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sglang.lang.ir import SglSamplingParams

    assert _params(getattr(RuntimeEndpoint, method)) == params
    assert "custom_params" not in SglSamplingParams().to_srt_kwargs()  # ours adds it


def _resolve(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


@pytest.mark.parametrize(("module", "name"), sorted(CONTRACT))
def test_symbol_and_signature(module, name):
    obj = _resolve(module, name)
    expected = CONTRACT[(module, name)]
    if expected is not None:
        params = _params(obj)
        assert params[: len(expected)] == list(expected), f"{module}.{name}{params}"


def _sglang_imports_by_file() -> dict[str, set[tuple[str, str]]]:
    found: dict[str, set[tuple[str, str]]] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "sglang" or node.module.startswith("sglang.")
            ):
                found.setdefault(rel, set()).update((node.module, a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.startswith("sglang.")]
                assert not bad, f"{rel}: use `from ... import` so the contract can check {bad}"
    return found


def test_contract_lists_every_import():
    used = set().union(*_sglang_imports_by_file().values())
    missing = used - set(CONTRACT)
    assert not missing, f"add these SGLang symbols to CONTRACT: {sorted(missing)}"


def test_only_integration_imports_sglang_srt():
    """integration/ is the one adapter layer (examples use the frontend only)."""
    offenders = {
        rel: sorted(m for m, _ in imports if m.startswith("sglang.srt"))
        for rel, imports in _sglang_imports_by_file().items()
        if not rel.startswith("integration/")
    }
    offenders = {rel: mods for rel, mods in offenders.items() if mods}
    assert not offenders, offenders


# ---- deeper parts of the contract: fields, methods and flags we use by name ----------------


def _dotted_sglang_targets() -> set[str]:
    """String constants in our code that name an SGLang object (hook targets and the like)."""
    pattern = re.compile(r"^sglang\.srt(\.\w+)+$")
    return {
        node.value
        for path in PACKAGE_DIR.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and pattern.match(node.value)
    }


def test_dotted_targets_resolve():
    """Every HookRegistry target (any dotted ``sglang.srt...`` string we hold) still exists."""
    targets = _dotted_sglang_targets()
    assert "sglang.srt.managers.scheduler_components.internal_state." \
           "SchedulerInternalStateController.get_internal_state" in targets
    unresolved = []
    for target in sorted(targets):
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as e:
            unresolved.append(f"{target}: {e}")
    assert not unresolved, unresolved


def test_tree_cache_build_context_fields():
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    fields = {f.name for f in dataclasses.fields(TreeCacheBuildContext)}
    assert {"params", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache",
            "disable_radix_cache", "tp_rank", "is_dsa"} <= fields


def test_radix_cache_api_used_by_backend_and_tests():
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    assert _params(RadixCache.create_simulated)[:3] == ["disable", "mock_allocator", "page_size"]
    assert _params(RadixCache.match_prefix) == ["params"]
    assert _params(RadixCache.insert) == ["params"]
    assert {"key"} <= {f.name for f in dataclasses.fields(MatchPrefixParams)}
    assert {"key", "value"} <= {f.name for f in dataclasses.fields(InsertParams)}
    from sglang.srt.mem_cache.radix_cache import RadixKey

    assert "cache_salt" in _params(RadixKey)


def test_admission_hook_target():
    """``admission_hook`` wraps the admission choice: first argument the request, a result
    with ``is_chunked`` or an ``AddReqResult``; it reads the adder's batch and tree cache."""
    from sglang.srt.managers import schedule_policy

    from sglang_kvcmas.integration.admission_hook import TARGET

    method = pkgutil.resolve_name(TARGET)
    assert _params(method)[0] == "req"
    assert "is_chunked" in {f.name for f in dataclasses.fields(schedule_policy._PrefillAdmission)}
    assert schedule_policy.AddReqResult.OTHER
    init = inspect.getsource(schedule_policy.PrefillAdder.__init__)
    assert "self.can_run_list" in init and "self.tree_cache" in init


def test_chat_split_hook_target():
    """The chat route's conversion: ``(request, raw_request)`` -> ``(GenerateReqInput,
    request)``, rendering ``messages`` through the template manager's named template or the
    tokenizer's Jinja one, with ``custom_params`` passed into the sampling params."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    from sglang_kvcmas.integration.chat_split_hook import TARGET

    method = pkgutil.resolve_name(TARGET)
    assert _params(method)[:2] == ["request", "raw_request"]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    custom_params={"kvcmas_head_len": 3})
    assert request.to_sampling_params(stop=[], model_generation_config={})[
        "custom_params"] == {"kvcmas_head_len": 3}
    from sglang.srt.parser.template_manager import TemplateManager

    assert isinstance(inspect.getattr_static(TemplateManager, "chat_template_name"), property)


def test_hook_registry_api():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert _params(HookRegistry.register)[:3] == ["target", "hook", "hook_type"]
    assert isinstance(HookRegistry._hooks, dict)  # registration reads it to stay idempotent
    assert HookType.AFTER.value == "after"


def test_dispatch_counts_hook_target():
    """``dispatch_counts.count_forward`` follows ``ModelRunner.forward(forward_batch, ...)``,
    reads the runner's ``attn_backend`` and the batch's mode, size and new tokens;
    ``stock_probes`` reads an extend's prefix and new lengths and its layers' attention kind."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_kvcmas.integration.dispatch_counts import TARGET

    assert pkgutil.resolve_name(TARGET) is ModelRunner.forward
    assert _params(ModelRunner.forward)[0] == "forward_batch"
    assert "self.attn_backend" in inspect.getsource(ModelRunner)
    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert {"forward_mode", "batch_size", "extend_num_tokens", "extend_prefix_lens",
            "extend_prefix_lens_cpu", "extend_seq_lens", "extend_seq_lens_cpu", "encoder_lens",
            "req_pool_indices", "rids"} <= fields
    init = inspect.getsource(RadixAttention.__init__)
    for name in ("is_cross_attention", "attn_type", "sliding_window_size", "tp_q_head_num",
                 "qk_head_dim", "scaling"):
        assert f"self.{name}" in init, name
    assert AttentionType.ENCODER_ONLY.value == "encoder_only"


def test_internal_state_hook_target():
    from sglang_kvcmas.integration.server_state import INTERNAL_STATE_TARGET

    module, cls_name, method = INTERNAL_STATE_TARGET.rsplit(".", 2)
    cls = _resolve(module, cls_name)
    assert _params(getattr(cls, method)) == ["recv_req"]
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    assert "internal_state" in GetInternalStateReqOutput.__struct_fields__


def test_fidelity_monitor_targets():
    """The HTTP process's ``get_internal_state`` (``/server_info``'s states) is an async method
    of ``TokenizerManager`` taking nothing; SGLang's ``GenerateReqInput`` has the logprob fields
    the monitor sets, and puts the log-probabilities where it reads them."""
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_kvcmas.integration.fidelity_monitor import INTERNAL_STATE_TARGET, LOGPROB_KEYS

    method = pkgutil.resolve_name(INTERNAL_STATE_TARGET)
    assert asyncio.iscoroutinefunction(method) and _params(method) == []
    assert TokenizerManager.get_internal_state is method
    fields = {f.name for f in dataclasses.fields(GenerateReqInput)}
    assert {"return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
            "cache_salt", "extra_key"} <= fields
    source = inspect.getsource(TokenizerManager.add_logprob_to_meta_info)
    for key in ("output_token_logprobs", "output_top_logprobs", "input_top_logprobs",
                "input_token_ids_logprobs"):
        assert key in LOGPROB_KEYS and f'meta_info["{key}"]' in source, key


def test_server_flags_our_launcher_sets():
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_kvcmas.server.options import default_flags, parse_launcher_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {s: a.dest for a in parser._actions for s in a.option_strings}
    for flag in default_flags(parse_launcher_args([])):
        assert options.get(flag.tokens[0]) == flag.dest, flag
    assert options["--model-path"] == options["--model"] == "model_path"
    assert "--radix-cache-backend" in options


def test_output_streamer_hook_target():
    """``reuse_accounting.request_level_streamer`` subclasses the class SGLang's scheduler asks
    for, and SGLang emits a request-level key once, unsliced."""
    from sglang.srt.managers.scheduler_components import output_streamer
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )

    from sglang_kvcmas.integration import reuse_accounting as ra

    assert _params(pkgutil.resolve_name(ra.STREAMER_TARGET)) == []
    ours = ra.request_level_streamer(SchedulerOutputStreamer)
    assert issubclass(ours, SchedulerOutputStreamer)
    assert ra.request_level_streamer(SchedulerOutputStreamer) is ours  # one subclass per base
    probe = object.__new__(ours)
    assert probe.is_request_level_customized_info_key(ra.META_KEY)
    assert not probe.is_request_level_customized_info_key("other_key")
    source = inspect.getsource(output_streamer)
    assert "values = req_values" in source and "is_request_level_customized_info_key(key)" in \
        source
