"""SGLang's own attention backends as sharing dispatchers: batches that read borrowed KV take the
delta read path, every other batch (and every other method) stays the backend's own; an owners'
probe batch stays on it too, its head mass read beside it as the delta path records it (except
over torch_native); CUDA graphs are declined for readers and probes only."""

from __future__ import annotations

import pkgutil
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe, RowSpans, SharedSpan
from sglang_kvcmas.integration import shared_backends
from sglang_kvcmas.integration.batch_rows import TaggedRids
from sglang_kvcmas.integration.dispatch_route import Route
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
    delta_kernel = True  # the GPU read path

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


class FakeTorchNative(TorchNativeAttnBackend):
    """Stands in for SGLang's torch_native backend (no model runner)."""

    def __init__(self, calls):
        self.calls = calls

    def init_forward_metadata(self, fb):
        self.calls.append(("native", "init"))

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("native", "extend"))
        return "native"


def shared(calls, runner=None, base=FakeGpuBackend):
    runner = runner or SimpleNamespace(use_mla_backend=False, model_config=None)
    return as_shared(base(calls), runner, "triton",
                     delta_factory=lambda r: Recorder("delta", calls))


LAYER = SimpleNamespace(layer_id=0)  # not a probe layer


SHIFTED = BatchRow(RowSpans.of_reads("r1", (SharedSpan(2, 3, 1),)))
PROBED = BatchRow(probe=HeadMassProbe.for_row(0, 2, 8))


@pytest.mark.parametrize("mode, rows, path", [
    ("extend", (None, None), "gpu"),
    ("extend", (None, SHIFTED), "delta"),
    ("extend", (PROBED,), "gpu"),  # an owner's extend: head mass read beside the backend
    ("extend", (PROBED, SHIFTED), "delta"),
    ("decode", (None, None), "gpu"),
    ("decode", (None, SHIFTED), "delta"),
    ("decode", (PROBED,), "gpu"),  # a probe changes nothing in decode
])
def test_each_batch_goes_one_way(mode, rows, path):
    calls = []
    backend = shared(calls)
    fb = batch(mode, *rows)
    backend.init_forward_metadata(fb)
    out = backend.forward(None, None, None, LAYER, fb)
    step = "decode" if mode == "decode" else "extend"
    assert out == path
    assert calls == [(path, "init"), *([("delta", "forward")] if path == "delta" else []),
                     *([("gpu", step)] if path == "gpu" else [])]
    calls.clear()
    method = backend.forward_decode if mode == "decode" else backend.forward_extend
    assert method(None, None, None, LAYER, fb) == path and calls == [(path, step)]


def test_probe_batches_stay_on_the_delta_path_over_torch_native():
    calls = []
    backend = shared(calls, base=FakeTorchNative)
    assert not type(backend).kvcmas_probes_on_stock and type(shared([])).kvcmas_probes_on_stock
    assert issubclass(FakeTorchNative, shared_backends.SharedDispatch.KEEP_PROBES_ON_DELTA)
    probe = batch("extend", PROBED)
    backend.init_forward_metadata(probe)
    assert backend.forward_extend(None, None, None, LAYER, probe) == "delta"
    plain = batch("extend", None)
    backend.init_forward_metadata(plain)
    assert backend.forward_extend(None, None, None, LAYER, plain) == "native"
    assert calls == [("delta", "init"), ("delta", "extend"), ("native", "init"),
                     ("native", "extend")]


class SavingGpuBackend(FakeGpuBackend):
    """As SGLang's GPU backends: saves the layer's new keys into the pool, then attends."""

    def __init__(self, calls, k_cache):
        super().__init__(calls)
        self.k_cache = k_cache

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.k_cache[fb.out_cache_loc] = k
        self.calls.append(("gpu", "extend"))
        return torch.zeros_like(q)


@pytest.mark.parametrize("fused", [False, True])
def test_a_probe_batch_records_beside_the_backend_what_the_delta_path_records(fused, monkeypatch):
    """Extend rows with probes and nothing borrowed: the backend attends (the delta path is
    never asked), and at a probe layer each probed row's head mass is read from the layer's
    queries and the pool's keys; the records equal the delta path's reference, bit for bit,
    and its CPU path (the mass from the attention's log-sum-exp) to float rounding."""
    from sglang_kvcmas.integration import delta_attention_backend
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    torch.manual_seed(7)
    h, hkv, d = 4, 2, 16
    lens, prefix = [11, 7, 20], [8, 0, 13]
    n_new = [n - p for n, p in zip(lens, prefix)]
    k_cache, v_cache = torch.randn(64, hkv, d), torch.randn(64, hkv, d)
    req_to_token = torch.zeros(5, 32, dtype=torch.int64)
    idx, slots, at = torch.tensor([1, 3, 4]), torch.randperm(64), 0
    for i, n in enumerate(lens):
        req_to_token[idx[i], :n] = slots[at : at + n]
        at += n
    out_loc = torch.cat([req_to_token[idx[i], p:n] for i, (p, n) in enumerate(zip(prefix, lens))])
    new_k = k_cache[out_loc].clone()
    k_cache[out_loc] = 0  # the backend saves them
    q = torch.randn(sum(n_new), h * d)

    def probed():  # row 1 records nothing; row 2's probe ends before its extend does
        return (BatchRow(probe=HeadMassProbe.for_row(1, 5, 11)), None,
                BatchRow(probe=HeadMassProbe.for_row(0, 3, 16)))

    def extend(rows):
        fb = batch("extend", *rows)
        fb.req_pool_indices, fb.out_cache_loc, fb.encoder_lens = idx, out_loc, None
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix, n_new
        return fb

    def layer(layer_id):
        return SimpleNamespace(layer_id=layer_id, tp_q_head_num=h, qk_head_dim=d,
                               scaling=d ** -0.5, is_cross_attention=False,
                               attn_type=AttentionType.DECODER, sliding_window_size=-1)

    calls = []
    pools = SimpleNamespace(  # the delta read path: its pools only (never called here)
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda layer_id: k_cache),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), delta_kernel=True)
    backend = as_shared(SavingGpuBackend(calls, k_cache),
                        SimpleNamespace(use_mla_backend=False, model_config=None), "triton",
                        delta_factory=lambda r: pools)
    stock = probed()
    for layer_id in (1, 2):  # a layer that does not probe, then one that does
        fb = extend(stock)
        backend.init_forward_metadata(fb)
        assert torch.equal(backend.forward(q, new_k, None, layer(layer_id), fb),
                           torch.zeros_like(q))
        assert fb.rids.cache["route"] == Route("stock", "probe")
        if layer_id == 1:
            assert not any(r.probe.counts.any() for r in stock if r is not None)
    assert calls == [("gpu", "init"), ("gpu", "extend")] * 2

    ref = probed()
    if not fused:
        monkeypatch.setattr(delta_attention_backend, "fused_mass_serves", lambda q, causal: False)
    be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the torch path's math; no model runner
    be._layer_id, be._batch_rows = 2, ref
    be._run_sdpa_forward_extend(
        q.view(-1, h, d), torch.empty(sum(n_new), h, d), k_cache, v_cache, req_to_token, idx,
        torch.tensor(lens), torch.tensor(prefix), torch.tensor(n_new), scaling=d ** -0.5,
        enable_gqa=True, causal=True)
    for got, want in zip(stock, ref):
        if want is not None:
            assert want.probe.counts.any()
            assert torch.equal(got.probe.counts, want.probe.counts)
            if fused:
                torch.testing.assert_close(got.probe.sums, want.probe.sums, atol=1e-6,
                                           rtol=1e-5)
            else:
                assert torch.equal(got.probe.sums, want.probe.sums)


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
    assert graph_gate(True, runner, batch("extend", PROBED)) is False  # the probe runs eagerly
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
