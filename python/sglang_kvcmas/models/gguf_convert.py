"""Convert a GGUF checkpoint (Llama / Qwen2 families) into an ordinary Hugging Face folder, once.

transformers can load a GGUF file (``gguf_file=``) into a dequantized PyTorch model but refuses to
``save_pretrained`` it, so the weights are copied into a model built ``from_config`` and that one
is saved. The folder is written next to its final place and renamed into it, under a file lock, so
concurrent processes (server ranks, tests, benchmarks) never see a half-written folder. A manifest
records the source file's sha256 and every output file's sha256; :func:`verify_folder` checks it
on every reuse, so a corrupt cache is found and reported instead of served.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "kvcmas_manifest.json"
SUPPORTED_ARCHS = ("llama", "qwen2")


class ModelPathError(ValueError):
    """A model path that cannot be served: missing, corrupt, or of an unsupported family."""


@dataclass(frozen=True)
class ConvertedModel:
    folder: Path
    source_sha256: str
    model_type: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def verify_folder(folder: Path) -> dict:
    """Check a converted folder against its manifest; return the manifest.

    Raises:
        ModelPathError: the manifest is missing, or a file is missing or has another checksum.
    """
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ModelPathError(f"{folder} has no {MANIFEST}: not a folder made by this converter")
    manifest = json.loads(manifest_path.read_text())
    for name, want in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise ModelPathError(f"converted model {folder} is missing {name}; delete the folder")
        got = sha256_file(p)
        if got != want:
            raise ModelPathError(
                f"converted model file {p} is corrupt (sha256 {got[:12]}…, expected {want[:12]}…); "
                f"delete {folder} and it will be converted again"
            )
    return manifest


def convert_gguf(gguf_path: Path, out_root: Path, *, name: str | None = None) -> ConvertedModel:
    """Convert ``gguf_path`` (a Llama- or Qwen2-family GGUF) into ``out_root/<name>-<sha12>``
    unless a verified copy exists; ``name`` defaults to the GGUF file's stem."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelPathError(f"GGUF file not found: {gguf_path}")
    source_sha = sha256_file(gguf_path)
    folder = Path(out_root) / f"{name or gguf_path.stem}-{source_sha[:12]}"
    with _file_lock(Path(out_root) / f".{folder.name}.lock"):
        if folder.is_dir():
            manifest = verify_folder(folder)
            return ConvertedModel(folder, manifest["source_sha256"], manifest["model_type"])
        tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model_type = _convert_into(gguf_path, tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = {
                "source": str(gguf_path),
                "source_sha256": source_sha,
                "model_type": model_type,
                "files": files,
                "created_unix": int(time.time()),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ConvertedModel(folder, source_sha, model_type)


def _convert_into(gguf_path: Path, out: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s into a Hugging Face folder (one time)", gguf_path)
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=fname)
    except Exception as e:  # transformers raises several types for unreadable GGUF files
        raise ModelPathError(f"cannot read GGUF file {gguf_path}: {e}") from e
    if config.model_type not in SUPPORTED_ARCHS:
        raise ModelPathError(
            f"{gguf_path} is a {config.model_type!r} model; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return config.model_type
