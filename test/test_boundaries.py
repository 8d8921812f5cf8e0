"""The parts stay apart: only the SGLang adapter imports ``sglang.srt``; the server never
imports the lab (``sglang_kvcmas_lab``), the client programs (``sglang_kvcmas_examples``) or the
benchmarks' harness (``sglang_kvcmas_bench``), statically or at run time; and the benchmark
scripts under ``benchmark/`` are run by path, import no other module there and leave
``sys.path`` alone (what they share is in ``sglang_kvcmas_bench``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / "python"
BENCHMARK = ROOT / "benchmark"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_server_package_never_imports_the_lab_the_examples_or_the_bench_harness():
    apart = ("sglang_kvcmas_lab", "sglang_kvcmas_examples", "sglang_kvcmas_bench")
    offenders = {str(p.relative_to(PYTHON)): sorted(m for m in _imports(p)
                                                    if m.split(".")[0] in apart)
                 for p in (PYTHON / "sglang_kvcmas").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_adapter_imports_sglang_srt():
    offenders = {}
    for root in ("sglang_kvcmas", "sglang_kvcmas_lab", "sglang_kvcmas_examples"):
        for p in (PYTHON / root).rglob("*.py"):
            rel = str(p.relative_to(PYTHON))
            if rel.startswith("sglang_kvcmas/integration/"):
                continue
            bad = sorted(m for m in _imports(p) if m.startswith("sglang.srt"))
            if bad:
                offenders[rel] = bad
    assert not offenders, offenders


def test_loading_the_plugin_imports_no_lab_module():
    """What every server process imports (the plugin's registrations and our launcher) pulls in
    no lab module."""
    code = (
        "import sys\n"
        "import sglang_kvcmas.launch_server, sglang_kvcmas.plugin as p\n"
        "p.register()\n"
        "import sglang_kvcmas.integration.shared_tree_cache\n"
        "print(sorted(m for m in sys.modules if m.startswith(('sglang_kvcmas_lab', "
        "'sglang_kvcmas_examples', 'sglang_kvcmas_bench'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _scripts() -> list[Path]:
    return sorted(BENCHMARK.rglob("*.py"))


def test_no_benchmark_script_edits_sys_path():
    """A script finds the packages as installed (``pip install -e .``); none adds a folder."""
    offenders = []
    for p in _scripts():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_benchmark_script_imports_another_module_under_benchmark():
    """Neither ``benchmark.*`` nor a sibling by its bare name (``common``, ``head_to_head``)
    nor a relative import: what scripts share lives in ``sglang_kvcmas_bench``."""
    names = {p.stem for p in _scripts()} | {"benchmark"}
    offenders = {}
    for p in _scripts():
        bad = []
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad.append("." * node.level + (node.module or ""))
            elif isinstance(node, ast.ImportFrom) and node.module:
                bad += [node.module] if node.module.split(".")[0] in names else []
            elif isinstance(node, ast.Import):
                bad += [a.name for a in node.names if a.name.split(".")[0] in names]
        if bad:
            offenders[str(p.relative_to(ROOT))] = sorted(bad)
    assert not offenders, offenders
