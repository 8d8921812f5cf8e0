"""One-token prefill requests the HTTP process sends on its own (LoRA ``catchup`` and ``rebase``).

Also the knobs both hooks act on, read once (:func:`serving_config`, :func:`mode`).

Both LoRA modes that prefill a prompt under another adapter do it the same way: a copy of the
client's prompt (its ids or text, namespace and ``extra_key``) under that adapter with one greedy
output token, sent through SGLang's unhooked ``generate_request`` and drained, and its prompt and
prefilled tokens added to the mode's totals and Prometheus counter.
"""

from __future__ import annotations

import copy
import uuid
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


def mode() -> str:
    """``lora_share`` as the launcher set it."""
    return serving_config().lora_share


def one_token_request(obj: Any, adapter: str, rid_prefix: str, *, keep_custom: bool) -> Any:
    """``obj``'s prompt under ``adapter``, one greedy output token, a fresh rid under
    ``rid_prefix``; ``keep_custom`` copies its ``custom_params`` (the ``kvcmas_*`` head and
    shared end) so the copy splits the prompt as ``obj`` does."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    ids = getattr(obj, "input_ids", None)
    sampling: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0}
    params = getattr(obj, "sampling_params", None)
    custom = params.get("custom_params") if isinstance(params, dict) else None
    if keep_custom and isinstance(custom, dict):
        sampling["custom_params"] = copy.deepcopy(custom)
    return GenerateReqInput(
        text=None if ids is not None else obj.text, input_ids=ids, lora_path=adapter,
        sampling_params=sampling, rid=f"{rid_prefix}{uuid.uuid4().hex}",
        cache_salt=getattr(obj, "cache_salt", None), extra_key=getattr(obj, "extra_key", None))


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
