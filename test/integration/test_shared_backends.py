"""SGLang's own attention backends as sharing dispatchers: batches that read borrowed KV take the
delta read path, every other batch (and every other method) stays the backend's own; CUDA graphs
are declined for the former only."""

from __future__ import annotations

import pkgutil
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe, RowSpans, SharedSpan
from sglang_kvcmas.integration import shared_backends
from sglang_kvcmas.integration.batch_rows import TaggedRids
from sglang_kvcmas.integration.shared_backends import (
    GRAPH_GATE_TARGETS,
    SHARED_BACKENDS,
    as_shared,
    graph_gate,
    shared_factory,
    wrap_registry,
)


def batch(mode: str, *rows: BatchRow | None) -> SimpleNamespace:
    rids = TaggedRids(f"r{i}" for i in range(len(rows)))
    if any(r is not None for r in rows):
        rids.rows = rows
    return SimpleNamespace(forward_mode=ForwardMode[mode.upper()], rids=rids)


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def init_forward_metadata(self, fb):
        self.calls.append((self.name, "init"))

    def forward(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append((self.name, "forward"))
        return self.name

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append((self.name, "extend"))
        return self.name

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append((self.name, "decode"))
        return self.name


class FakeGpuBackend(AttentionBackend):
    """Stands in for TritonAttnBackend: records what SGLang's backend would have run."""

    def __init__(self, calls):
        self.calls = calls
        self.workspace = "planned by the backend"

    def init_forward_metadata(self, fb):
        self.calls.append(("gpu", "init"))

    def init_forward_metadata_capture_cuda_graph(self, *args, **kwargs):
        self.calls.append(("gpu", "capture"))

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("gpu", "extend"))
        return "gpu"

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("gpu", "decode"))
        return "gpu"


def shared(calls, runner=None):
    runner = runner or SimpleNamespace(use_mla_backend=False, model_config=None)
    return as_shared(FakeGpuBackend(calls), runner, "triton",
                     delta_factory=lambda r: Recorder("delta", calls))


SHIFTED = BatchRow(RowSpans.of_reads("r1", (SharedSpan(2, 3, 1),)))
PROBED = BatchRow(probe=HeadMassProbe.for_row(0, 2, 8))


@pytest.mark.parametrize("mode, rows, path", [
    ("extend", (None, None), "gpu"),
    ("extend", (None, SHIFTED), "delta"),
    ("extend", (PROBED,), "delta"),  # an owner's extend records head mass
    ("decode", (None, None), "gpu"),
    ("decode", (None, SHIFTED), "delta"),
    ("decode", (PROBED,), "gpu"),  # a probe changes nothing in decode
])
def test_each_batch_goes_one_way(mode, rows, path):
    calls = []
    backend = shared(calls)
    fb = batch(mode, *rows)
    backend.init_forward_metadata(fb)
    out = backend.forward(None, None, None, None, fb)
    step = "decode" if mode == "decode" else "extend"
    assert out == path
    assert calls == [(path, "init"), *([("delta", "forward")] if path == "delta" else []),
                     *([("gpu", step)] if path == "gpu" else [])]
    calls.clear()
    method = backend.forward_decode if mode == "decode" else backend.forward_extend
    assert method(None, None, None, None, fb) == path and calls == [(path, step)]


def test_the_backend_stays_itself_for_everything_else():
    calls = []
    backend = shared(calls)
    assert isinstance(backend, FakeGpuBackend) and isinstance(backend, AttentionBackend)
    assert type(backend).__name__ == "SharedFakeGpuBackend"
    assert backend.workspace == "planned by the backend"
    backend.init_forward_metadata_capture_cuda_graph(1, 2)
    assert calls == [("gpu", "capture")]
    assert type(shared([])) is type(backend)  # one class per base
    idle = batch("idle", SHIFTED)
    out = backend.forward(torch.zeros(3, 4), None, None,
                          SimpleNamespace(tp_q_head_num=2, v_head_dim=5), idle)
    assert out.shape == (3, 10) and calls == [("gpu", "capture")]  # idle: the base's answer


def test_extra_attention_inputs_are_refused_on_the_delta_path():
    backend = shared([])
    with pytest.raises(RuntimeError, match=r"passed \['sinks'\]"):
        backend.forward_extend(None, None, None, None, batch("extend", SHIFTED), sinks=1)


def test_mla_is_refused_naming_the_model():
    runner = SimpleNamespace(use_mla_backend=True,
                             model_config=SimpleNamespace(model_path="deepseek-v2-lite"))
    with pytest.raises(ValueError, match="MLA attention \\(deepseek-v2-lite, attention backend"):
        shared([], runner)


def test_factories_wrap_only_with_sharing_on(monkeypatch):
    built = []

    def original(runner):
        built.append(runner)
        return FakeGpuBackend([])

    monkeypatch.setattr(shared_backends, "DeltaAttnBackend", lambda r: Recorder("delta", []))
    factory = shared_factory("triton", original)
    monkeypatch.setenv("KVCMAS_SHARE_CONTEXT", "0")
    assert type(factory("runner")) is FakeGpuBackend
    monkeypatch.setenv("KVCMAS_SHARE_CONTEXT", "1")
    monkeypatch.setattr(shared_backends, "as_shared", lambda b, r, n: ("shared", n))
    assert factory("runner") == ("shared", "triton") and built == ["runner", "runner"]


def test_registry_wrapping_is_idempotent():
    registry = {name: (lambda r, n=name: n) for name in (*SHARED_BACKENDS, "fa3")}
    originals = dict(registry)
    wrap_registry(registry)
    wrapped = dict(registry)
    wrap_registry(registry)
    assert registry == wrapped and registry["fa3"] is originals["fa3"]
    for name in SHARED_BACKENDS:
        assert registry[name].kvcmas_original is originals[name]


def test_graphs_are_declined_for_batches_that_read_borrowed_kv():
    runner = object()
    assert graph_gate(True, runner, batch("decode", None, SHIFTED)) is False
    assert graph_gate(True, runner, batch("decode", PROBED)) is None  # the graph's answer stands
    assert graph_gate(True, runner, batch("decode", None)) is None
    assert graph_gate(False, runner, batch("decode", SHIFTED)) is None


@pytest.mark.parametrize("target", GRAPH_GATE_TARGETS)
def test_graph_gate_targets_exist(target):
    owner, name = target.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(owner), name))


def test_sglang_registry_holds_the_wrapped_factories():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from sglang_kvcmas.integration.registration import register_attention_backend_once

    register_attention_backend_once()
    for name in SHARED_BACKENDS:
        assert hasattr(ATTENTION_BACKENDS[name], "kvcmas_original"), name
