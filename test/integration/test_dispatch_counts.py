"""Forward batches and tokens counted once per forward by route, in ``/server_info`` and in
Prometheus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe, RowSpans, SharedSpan
from sglang_kvcmas.integration import dispatch_counts
from sglang_kvcmas.integration.batch_rows import TaggedRids
from sglang_kvcmas.integration.dispatch_counts import count_forward, snapshot
from sglang_kvcmas.integration.dispatch_route import route_of

prometheus_client = pytest.importorskip("prometheus_client")

SHIFTED = BatchRow(RowSpans.of_reads("r", (SharedSpan(2, 3, 1),)))
PROBED = BatchRow(probe=HeadMassProbe.for_row(0, 2, 8))


@pytest.fixture(autouse=True)
def fresh_counts(monkeypatch):
    monkeypatch.setattr(dispatch_counts, "BATCHES", {})
    monkeypatch.setattr(dispatch_counts, "TOKENS", {})


class Backend:
    """A sharing backend's route: probes stay on it, kernels serve; counts its asks."""

    def __init__(self, probes_on_stock=True, kernel=True):
        self.probes_on_stock, self.delta_kernel, self.asked = probes_on_stock, kernel, 0

    def kvcmas_route(self, fb):
        self.asked += 1
        return route_of(fb, self.probes_on_stock, self)


def batch(mode, *rows, tokens=None):
    rids = TaggedRids(f"r{i}" for i in range(len(rows)))
    if any(r is not None for r in rows):
        rids.rows = rows
    return SimpleNamespace(forward_mode=ForwardMode[mode.upper()], rids=rids,
                           batch_size=len(rows), extend_num_tokens=tokens)


def sample(name, path, reason):
    return prometheus_client.REGISTRY.get_sample_value(
        f"kvcmas:forward_{name}_total", {"path": path, "reason": reason}) or 0.0


def test_each_forward_is_counted_once_by_route():
    runner = SimpleNamespace(attn_backend=Backend())
    before = {(n, p, r): sample(n, p, r) for n in ("batches", "tokens")
              for p, r in (("stock", "plain"), ("stock", "probe"), ("kernel", "reader"))}
    for fb in (batch("extend", None, None, tokens=40), batch("decode", None, None),
               batch("decode", PROBED), batch("extend", PROBED, tokens=9),
               batch("extend", PROBED, SHIFTED, tokens=12), batch("decode", SHIFTED, None)):
        assert count_forward("logits", runner, fb) is None  # the forward's result stands
    count_forward(None, runner, forward_batch=batch("idle"))  # nothing runs: not counted
    assert snapshot() == {
        "forward_batches": {"kernel": {"reader": 2}, "stock": {"plain": 3, "probe": 1}},
        "forward_tokens": {"kernel": {"reader": 14}, "stock": {"plain": 43, "probe": 9}},
    }
    assert runner.attn_backend.asked == 6  # one route per forward, not per layer
    for (name, path, reason), value in before.items():
        want = snapshot()[f"forward_{name}"][path][reason]
        assert sample(name, path, reason) - value == want, (name, path, reason)


def test_the_torch_path_says_why():
    runner = SimpleNamespace(attn_backend=Backend(probes_on_stock=False, kernel=False))
    count_forward(None, runner, batch("extend", PROBED, tokens=5))
    count_forward(None, runner, batch("decode", SHIFTED))
    assert snapshot()["forward_batches"] == {
        "torch": {"no_kernel": 1, "probe_on_torch_native": 1}}


def test_other_backends_are_not_counted():
    count_forward(None, SimpleNamespace(attn_backend=object()), batch("extend", tokens=3))
    count_forward(None, SimpleNamespace(), batch("decode", None))
    assert snapshot() == {"forward_batches": {}, "forward_tokens": {}}


def test_server_info_reports_the_counts():
    from sglang_kvcmas.integration.radix_cache_backend import KvcmasRadixCache
    from sglang_kvcmas.integration.server_state import add_tree_cache_to_internal_state

    count_forward(None, SimpleNamespace(attn_backend=Backend()), batch("decode", None))
    result = SimpleNamespace(internal_state={})
    controller = SimpleNamespace(scheduler=SimpleNamespace(
        tree_cache=KvcmasRadixCache.create_simulated()))
    add_tree_cache_to_internal_state(result, controller, None)
    assert result.internal_state["kvcmas"]["dispatch"] == {
        "forward_batches": {"stock": {"plain": 1}}, "forward_tokens": {"stock": {"plain": 1}}}
