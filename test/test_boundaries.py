"""The parts stay apart: only the SGLang adapter imports ``sglang.srt``, and the server never
imports the lab (``sglang_kvcmas_lab``) or the client programs (``sglang_kvcmas_examples``),
statically or at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PYTHON = Path(__file__).resolve().parents[1] / "python"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_server_package_never_imports_the_lab_or_the_examples():
    apart = ("sglang_kvcmas_lab", "sglang_kvcmas_examples")
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
        "'sglang_kvcmas_examples'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
