"""The deployment's knobs as the HTTP process reads them (once), and prefill requests it sends
on its own, drained and counted (``head_first``).
"""

from __future__ import annotations

from typing import Any

_CONFIG: list[Any] = []
"""The deployment's ``ServingConfig`` once read (tests put their own here)."""


def serving_config() -> Any:
    """The deployment's knobs as the launcher set them (``ServingConfig``, read from the
    environment once)."""
    if not _CONFIG:
        from sglang_kvcmas.config import ServingConfig

        _CONFIG.append(ServingConfig.from_env())
    return _CONFIG[0]


async def run_counted(original: Any, manager: Any, req: Any, totals: dict[str, int],
                      counter: Any) -> None:
    """Send ``req`` through ``original`` (SGLang's ``generate_request``), drain it, and add its
    tokens to ``totals`` (``requests``, ``prompt``, ``prefilled``) and to ``counter`` (labels
    ``kind=prompt|prefilled``; ``None``: no Prometheus). Raises what the request raises."""
    meta: dict = {}
    async for out in original(manager, req, None):
        meta = out.get("meta_info", meta) if isinstance(out, dict) else meta
    prompt = int(meta.get("prompt_tokens", 0))
    prefilled = prompt - int(meta.get("cached_tokens", 0))
    totals["requests"] += 1
    totals["prompt"] += prompt
    totals["prefilled"] += prefilled
    if counter is not None:
        counter.labels(kind="prompt").inc(prompt)
        counter.labels(kind="prefilled").inc(prefilled)
