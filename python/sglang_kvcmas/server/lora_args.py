"""The LoRA adapters a launch names (``--lora-paths``, ``--max-lora-rank``), checked before boot.

SGLang accepts ``--lora-paths`` entries as ``name=path``, a bare ``path`` (named by itself) or a
JSON object ``{"lora_name": ..., "lora_path": ..., "pinned": ...}``; a bad adapter surfaces only
after the model has loaded, as a traceback from the scheduler. The launcher checks each one
against the model first (``models.adapter_check``) and stops with one line naming the adapter.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from sglang_kvcmas.models.adapter_check import AdapterError, ModelShape, check_adapter


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """Every value given to ``flag`` (``--flag v1 v2``, ``--flag=v``, or repeated), read by
    argparse as SGLang's parser reads it (cf. ``options._peek`` for one value)."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument(flag, dest="values", nargs="*", action="extend", default=[])
    known, _ = peek.parse_known_args(list(argv))
    return known.values


def named_adapters(argv: Sequence[str]) -> dict[str, str]:
    """``--lora-paths`` as {name: path}, in SGLang's three spellings."""
    out: dict[str, str] = {}
    for value in flag_values(argv, "--lora-paths"):
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                out[str(item["lora_name"])] = str(item["lora_path"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AdapterError(f"--lora-paths: {value!r} is not "
                                   '{"lora_name": ..., "lora_path": ...}') from None
        elif "=" in value:
            name, path = value.split("=", 1)
            out[name] = path
        else:
            out[value] = value
    return out


def check_lora_paths(argv: Sequence[str], model_dir: str | Path) -> dict[str, int]:
    """Check every adapter of ``--lora-paths`` against the model at ``model_dir``.

    Returns:
        {name: rank}.

    Raises:
        AdapterError: the first adapter that does not fit, named.
    """
    adapters = named_adapters(argv)
    if not adapters:
        return {}
    ranks = flag_values(argv, "--max-lora-rank")
    max_rank = int(ranks[-1]) if ranks else None
    shape = ModelShape.of_folder(model_dir)
    out = {}
    for name, path in adapters.items():
        try:
            out[name] = check_adapter(path, shape, max_rank)
        except AdapterError as e:
            raise AdapterError(f"--lora-paths {name}: {e}") from None
    return out
