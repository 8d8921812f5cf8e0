"""Fixtures of the HTTP-process hook tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def knobs(monkeypatch):
    """``knobs(lora_share="borrow", ...)``: the deployment's knobs as the LoRA hooks read them
    (``prefill_requests.serving_config``), defaults elsewhere; each call changes the ones named."""
    from sglang_kvcmas.config import ServingConfig
    from sglang_kvcmas.integration import prefill_requests

    def set_knobs(**values) -> None:
        current = prefill_requests._CONFIG[0] if prefill_requests._CONFIG else ServingConfig()
        monkeypatch.setattr(prefill_requests, "_CONFIG", [current.with_values(**values)])

    monkeypatch.setattr(prefill_requests, "_CONFIG", [ServingConfig()])
    return set_knobs
