"""Check a PEFT LoRA adapter against the served model before SGLang loads it.

SGLang finds out that an adapter does not fit its base model only while copying weights into its
LoRA buffers (a shape error deep in the scheduler), or not at all (an adapter trained for another
model of the same shape is served silently). This reads the adapter's ``adapter_config.json`` and
the *header* of its ``adapter_model.safetensors`` (names and shapes, no weights) and the model's
``config.json``, and says in one sentence what does not fit:

- no ``adapter_config.json`` / weights, not a LoRA adapter, DoRA or other PEFT types;
- a rank above the server's ``--max-lora-rank``;
- a target module this model does not have (or one SGLang does not serve with LoRA, such as
  ``embed_tokens``);
- a layer index beyond the model's layers, or a tensor whose shape is not the model's (an adapter
  for another base model).

Used by the launcher for ``--lora-paths`` (exit status 2 before SGLang boots) and by the HTTP
hook of ``/load_lora_adapter`` (a 400, nothing loaded).

Pure Python + ``json``: no torch, no SGLang.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path


class AdapterError(ValueError):
    """The adapter cannot be served on this model; the message says why."""


SERVABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "qkv_proj", "gate_up_proj")
"""Target modules a Llama / Qwen2 family model serves with LoRA in SGLang."""

_WEIGHT = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's tensors must match.

    Attributes:
        layers: decoder layers.
        in_out: module name -> (in features, out features).
    """

    layers: int
    in_out: dict[str, tuple[int, int]]

    @classmethod
    def of_config(cls, config: dict) -> ModelShape:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config.get("intermediate_size") or 4 * hidden)
        return cls(int(config["num_hidden_layers"]), {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        })

    @classmethod
    def of_folder(cls, model_dir: str | Path) -> ModelShape:
        return cls.of_config(json.loads((Path(model_dir) / "config.json").read_text()))


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a ``.safetensors`` header (the weights are not read)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path.name} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise AdapterError(f"{path.name}: header of {size} bytes is not a safetensors header")
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def check_adapter(adapter_dir: str | Path, model: ModelShape, max_rank: int | None = None) -> int:
    """Raise :class:`AdapterError` unless the adapter at ``adapter_dir`` fits ``model``.

    Returns:
        the adapter's rank.
    """
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a folder")
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{config_path} is not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder.name} is a {config.get('peft_type')} adapter; only LoRA "
                           "adapters are served")
    if config.get("use_dora"):
        raise AdapterError(f"{folder.name} is a DoRA adapter; SGLang serves plain LoRA only")
    rank = int(config.get("r") or 0)
    if rank <= 0:
        raise AdapterError(f"{folder.name}: adapter_config.json has no rank r")
    if config.get("rank_pattern"):
        rank = max(rank, *map(int, config["rank_pattern"].values()))
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{folder.name} has rank {rank}, above this server's --max-lora-rank "
                           f"{max_rank}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(t for t in targets if t not in SERVABLE)
    if unknown:
        raise AdapterError(f"{folder.name} targets {unknown}, which this model does not serve "
                           f"with LoRA (servable: {', '.join(SERVABLE)})")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            return rank  # a pickled checkpoint: shapes are checked by SGLang when it loads
        raise AdapterError(f"{folder} has no adapter_model.safetensors")
    for name, shape in safetensors_shapes(weights).items():
        m = _WEIGHT.search(name)
        if m is None:
            continue
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if layer >= model.layers:
            raise AdapterError(f"{folder.name}: {name} is for layer {layer}, but the model has "
                               f"{model.layers} layers (an adapter for another base model)")
        if module not in model.in_out:
            continue
        fan_in, fan_out = model.in_out[module]
        want = [shape[0], fan_in] if side == "A" else [fan_out, shape[1]]
        if list(shape) != want:
            raise AdapterError(f"{folder.name}: {name} has shape {list(shape)}, the model needs "
                               f"{want} (an adapter for another base model)")
    return rank
