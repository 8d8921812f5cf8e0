"""The centroid adapter of ``--kvcmas-lora-share rebase``: the mean of the named adapters' deltas.

For adapters ``i = 1..N`` with factors ``A_i: [r_i, in]``, ``B_i: [out, r_i]`` and scaling
``s_i`` (``lora_alpha / r_i``, or ``/ sqrt(r_i)`` with rsLoRA), the centroid's delta of a
module is their mean, ``ΔW = (1/N) Σ s_i B_i A_i``, written as one LoRA adapter of rank
``R = Σ r_i`` with scaling 1:

    A = [A_1; ...; A_N]: [R, in],    B = [s_1/N · B_1, ..., s_N/N · B_N]: [out, R],

so ``B·A = ΔW`` exactly, and SGLang serves it as it serves any PEFT adapter. A module that
some adapters do not target contributes zero blocks for them. The folder is written once per
set of inputs under the cache folder (named by a hash of the adapters' files).

Pure PyTorch and safetensors; no SGLang import.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_kvcmas.models.adapter_check import AdapterError

_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

if TYPE_CHECKING:  # torch is imported where used: the launcher sets threads before it loads
    import torch


def scaling(config: dict) -> float:
    """PEFT's scaling of an adapter's delta: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _load(path: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(config, {module: {"A": [r, in], "B": [out, r]}}) of one PEFT adapter folder."""
    import torch
    from safetensors.torch import load_file

    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: cannot read {CONFIG}: {e}") from None
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{path}: per-module ranks (rank_pattern, alpha_pattern) are not "
                           "supported by lora_share=rebase")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(path / WEIGHTS)).items():
        m = _FACTOR.match(name)
        if m is None:
            raise AdapterError(f"{path}: tensor {name!r} is not a LoRA factor; lora_share=rebase "
                               "needs plain LoRA adapters")
        modules.setdefault(m["module"], {})[m["ab"]] = t.to(torch.float32)
    return config, modules


def centroid_factors(adapters: list[tuple[dict, dict[str, dict[str, torch.Tensor]]]]
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": [R, in], "B": [out, R]}} of the centroid (module docstring)."""
    import torch

    n = len(adapters)
    names = sorted({m for _, mods in adapters for m in mods})
    out = {}
    for module in names:
        shape = next(mods[module] for _, mods in adapters if module in mods)
        a_in, b_out = shape["A"].shape[1], shape["B"].shape[0]
        a_parts, b_parts = [], []
        for config, mods in adapters:
            r = int(config["r"])
            f = mods.get(module)
            if f is None:
                a_parts.append(torch.zeros(r, a_in))
                b_parts.append(torch.zeros(b_out, r))
            else:
                a_parts.append(f["A"])
                b_parts.append(f["B"] * (scaling(config) / n))
        out[module] = {"A": torch.cat(a_parts), "B": torch.cat(b_parts, dim=1)}
    return out


def build_centroid(paths: list[str | Path], cache_dir: str | Path) -> Path:
    """Write (once) and return the folder of the centroid of the adapters at ``paths``.

    Raises:
        AdapterError: fewer than two adapters, or one that is not a plain LoRA adapter.
    """
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise AdapterError("lora_share=rebase needs at least two adapters in --lora-paths")
    digest = hashlib.sha256()
    for p in paths:
        for f in (CONFIG, WEIGHTS):
            try:
                digest.update((p / f).read_bytes())
            except OSError as e:
                raise AdapterError(f"{p}: cannot read {f}: {e}") from None
    folder = Path(cache_dir) / "lora-centroids" / digest.hexdigest()[:16]
    if (folder / WEIGHTS).exists() and (folder / CONFIG).exists():
        return folder
    from safetensors.torch import save_file

    adapters = [_load(p) for p in paths]
    factors = centroid_factors(adapters)
    rank = sum(int(c["r"]) for c, _ in adapters)
    config = dict(adapters[0][0])
    config.update(r=rank, lora_alpha=rank, use_rslora=False, rank_pattern={}, alpha_pattern={},
                  target_modules=sorted({t for c, _ in adapters for t in c["target_modules"]}))
    tensors = {f"{m}.lora_{ab}.weight": f[ab].contiguous() for m, f in factors.items()
               for ab in ("A", "B")}
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / WEIGHTS))
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    if folder.exists():  # another launch wrote it meanwhile: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(folder)
    return folder


def with_centroid(argv: list[str], folder: Path, rank: int, name: str) -> list[str]:
    """SGLang's argv with the centroid added to ``--lora-paths`` (SGLang keeps only the last
    ``--lora-paths``, so the centroid joins that one) and ``--max-lora-rank`` raised to its rank
    when set lower."""
    out = list(argv)
    at = max(i for i, a in enumerate(out) if a == "--lora-paths" or a.startswith("--lora-paths="))
    if out[at].startswith("--lora-paths="):
        out[at:at + 1] = ["--lora-paths", out[at].split("=", 1)[1]]
    end = at + 1
    while end < len(out) and not out[end].startswith("--"):
        end += 1
    out.insert(end, f"{name}={folder}")
    for i, a in enumerate(out):
        if a == "--max-lora-rank" and i + 1 < len(out) and int(out[i + 1]) < rank:
            out[i + 1] = str(rank)
        elif a.startswith("--max-lora-rank=") and int(a.split("=", 1)[1]) < rank:
            out[i] = f"--max-lora-rank={rank}"
    return out
