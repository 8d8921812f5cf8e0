"""``/load_lora_adapter`` checks the adapter against the served model before SGLang loads it.

SGLang loads an adapter's configuration and weights in the scheduler and reports a failure as a
400, but a tensor of the wrong shape (an adapter for another base model) is only found when a
batch first uses it. An AROUND hook on the tokenizer manager's ``load_lora_adapter`` runs
``models.adapter_check`` first (config and safetensors header: rank against ``--max-lora-rank``,
target modules, layer count and shapes) and answers ``success: false`` with the reason (HTTP 400)
without sending anything to the scheduler. Servers without LoRA are unaffected (SGLang answers
them as before).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_kvcmas.models.adapter_check import AdapterError, ModelShape, check_adapter

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.load_lora_adapter"

_shapes: dict[str, ModelShape] = {}


def adapter_problem(model_path: str, adapter_path: str | None,
                    max_rank: int | None) -> str | None:
    """Why the adapter cannot be served on the model (None: it fits)."""
    if not adapter_path:
        return "lora_path is required"
    try:
        shape = _shapes.get(model_path)
        if shape is None:
            shape = _shapes[model_path] = ModelShape.of_folder(model_path)
        check_adapter(adapter_path, shape, max_rank)
    except AdapterError as e:
        return str(e)
    except (OSError, KeyError, ValueError) as e:  # no config.json: leave it to SGLang
        logger.debug("sglang-kvcmas: adapter check skipped: %s", e)
    return None


async def load_around(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: a bad adapter gets ``success: false`` with the reason; SGLang sees nothing."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqOutput

    server_args = getattr(manager, "server_args", None)
    if getattr(server_args, "enable_lora", False):
        problem = adapter_problem(str(server_args.model_path), getattr(obj, "lora_path", None),
                                  getattr(server_args, "max_lora_rank", None))
        if problem is not None:
            logger.warning("sglang-kvcmas: /load_lora_adapter %s refused: %s",
                           getattr(obj, "lora_name", "?"), problem)
            return LoadLoRAAdapterReqOutput(success=False, error_message=problem)
    return await original(manager, obj, *args, **kwargs)
