"""The fence before a row write under the overlap scheduler (``integration/inflight_fence``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang_kvcmas.integration import inflight_fence


class Stream:
    def __init__(self):
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other)


def test_the_current_stream_waits_for_the_registered_forward_stream(monkeypatch):
    monkeypatch.setattr(inflight_fence, "_STREAMS", {})
    assert not inflight_fence.fence("cuda:0")  # none registered: the caller must not write
    inflight_fence.register(SimpleNamespace(device="cpu", forward_stream=Stream()))
    assert inflight_fence._STREAMS == {}  # a CPU forward has ended when it returns
    forward, current = Stream(), Stream()
    inflight_fence.register(SimpleNamespace(device="cuda", forward_stream=forward))
    module = SimpleNamespace(current_stream=lambda: current)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: module)
    assert inflight_fence.fence("cuda:0") and current.waited_for == [forward]
    assert not inflight_fence.fence("cpu")
