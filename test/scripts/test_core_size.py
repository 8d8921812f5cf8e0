"""``scripts/core_size.py``: the product core holds its caps (knobs, README, long modules, the
structure doc's cells), and each count is what it says on a small tree whose counts are known."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "core_size.py"


@pytest.fixture(scope="module")
def core_size():
    spec = importlib.util.spec_from_file_location("core_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["core_size"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["core_size"]


def test_the_product_core_holds_its_caps(core_size):
    size = core_size.measure(ROOT)
    assert core_size.over_caps(size) == []
    assert size.knobs <= 15 and size.long_modules  # the two long ones say why
    assert size.reached_lines < size.lines and "server.cluster" in size.not_reached


CONFIG = '''"""Knobs."""
from dataclasses import dataclass


def _knob(default, help, **kw):
    return default


@dataclass(frozen=True)
class ServingConfig:
    """The knobs."""

    share_context: bool = _knob(False, "on")
    leaf_rank: int = _knob(4, "rank")

    def with_values(self, **values):
        return self
'''

OPTIONS = '''AGENT_FIELD = "kvcmas_agent"
EXACT_FIELD = "kvcmas_exact"
RANK_FIELD = "kvcmas_leaf_rank"
SERVER_FIELD = "kvcmas_head_first"
SERVER_ONLY_FIELDS = (SERVER_FIELD,)
_OWN_FIELDS = (AGENT_FIELD, EXACT_FIELD, RANK_FIELD, SERVER_FIELD, "kvcmas_workflow")
'''

LAUNCHER = '''"""Entry point.

NOTE: long on purpose.
"""
# a comment
from sglang_kvcmas import config  # noqa

X = 1
'''


def _tree(tmp_path: Path, readme_rows: int = 2, cell: int = 10) -> Path:
    package = tmp_path / "python" / "sglang_kvcmas"
    (package / "policy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "policy" / "__init__.py").write_text("")
    (package / "config.py").write_text(CONFIG)
    (package / "policy" / "request_options.py").write_text(OPTIONS)
    (package / "launch_server.py").write_text(LAUNCHER)
    (package / "tool.py").write_text("'''A tool beside the server.'''\n" + "x = 1\n" * 600)
    rows = "".join(f"| {i} | row |\n" for i in range(readme_rows))
    (tmp_path / "README.md").write_text(
        f"# x\n\n## Results\n\n| a | b |\n|---|---|\n{rows}\n## More\n\n| c |\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "structure.md").write_text(f"| a | {'y' * cell} |\n|---|---|\n")
    return tmp_path


def test_counts_on_a_known_tree(core_size, tmp_path):
    size = core_size.measure(_tree(tmp_path))
    assert size.modules == 6
    assert size.lines == 0 + 0 + len(CONFIG.splitlines()) + len(OPTIONS.splitlines()) \
        + len(LAUNCHER.splitlines()) + 601
    assert size.docstrings == 2 + 1 + 3 + 1  # config: module + class; launcher: 3; tool: 1
    assert size.comments == 1 and size.blank == 6 + 1  # config: 6; launcher: 1
    assert size.code == size.lines - size.docstrings - size.comments - size.blank
    # launch_server imports config and, through its parent, the package; nothing imports tool
    assert size.not_reached == ("policy", "tool")
    assert size.reached_modules == 3
    assert size.config_knobs == ("share_context", "leaf_rank")
    assert size.request_knobs == ("kvcmas_exact",)  # identity, server-only, a knob's spelling out
    assert size.knobs == 3
    assert size.long_modules == (("tool", 601, False),)
    assert (size.readme_lines, size.result_rows, size.structure_cell_chars) == (12, 2, 10)
    assert core_size.over_caps(size) == ["tool has 601 lines and no NOTE: in its docstring"]


def test_caps_name_what_is_over(core_size, tmp_path):
    size = core_size.measure(_tree(tmp_path, readme_rows=9, cell=301))
    over = core_size.over_caps(size)
    assert "result_rows 9 > 8" in over and "structure_cell_chars 301 > 300" in over


def test_a_commit_is_measured_from_git_and_a_bad_one_fails(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      check=False, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    out = subprocess.run([sys.executable, str(SCRIPT), "--at", "HEAD", "--json"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["modules"] > 0 and record["knobs"] == len(record["config_knobs"]) + len(
        record["request_knobs"])
    bad = subprocess.run([sys.executable, str(SCRIPT), "--at", "no-such-rev"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read no-such-rev" in bad.stderr
