"""``docker/Dockerfile`` cannot be built here (no Docker, no GPU): its base and install steps are
checked as text. It must start from SGLang's own image of the pinned release, reinstall nothing
of it, and add our package and the packages we pin beside SGLang at the same versions."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "scripts" / "requirements-cpu.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            out[name.lower()] = version
    return out


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip()]


def test_the_base_is_sglangs_image_of_the_pinned_release():
    steps = _instructions()
    sglang = _pins()["sglang"]
    assert steps[0] == ("ARG", f"SGLANG_IMAGE=lmsysorg/sglang:v{sglang}")
    assert steps[1] == ("FROM", "${SGLANG_IMAGE}")
    run = " ".join(args for op, args in steps if op == "RUN")
    assert f"sglang.__version__ == '{sglang}'" in run  # the build fails on another release


def test_install_steps_add_our_package_and_reinstall_nothing_of_the_image():
    pins = _pins()
    installs = []
    for op, args in _instructions():
        if op != "RUN":
            continue
        for command in args.split("&&"):
            words = shlex.split(command)
            if words[:4] == ["python3", "-m", "pip", "install"]:
                installs.append([w for w in words[4:] if not w.startswith("--")] +
                                [w for w in words[4:] if w == "--no-deps"])
    ours = [w for w in installs if "." in w]
    assert ours == [[".", "--no-deps"]]  # our package, without pulling a CUDA stack
    extras = [w for words in installs for w in words if "==" in w]
    assert extras, "no pinned extra package"
    for spec in extras:
        name, version = spec.split("==")
        assert pins[name.lower()] == version, spec  # the same pin as the CPU install
        assert name.lower() not in {"torch", "sglang", "flashinfer-python", "sglang-kernel"}


def test_copied_paths_exist_and_the_entrypoint_serves_with_sharing_on():
    steps = _instructions()
    for op, args in steps:
        if op == "COPY":
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), src
    entry = next(args for op, args in steps if op == "ENTRYPOINT")
    assert '"sglang_kvcmas.launch_server"' in entry and '"--kvcmas-share-context"' in entry
    assert '"--device", "cuda"' in entry
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    assert "dockerfile: docker/Dockerfile" in compose
