"""SGLang plugin entry point (``sglang.srt.plugins`` group)."""

from __future__ import annotations


def register() -> None:
    """Register sglang-kvcmas with SGLang. Idempotent; no model load, no device init."""
    from sglang_kvcmas.integration import registration

    registration.register_all()
