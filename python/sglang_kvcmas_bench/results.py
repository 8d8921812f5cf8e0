"""A result file and its row in its folder's index, written in one go.

Every results folder (``benchmark/<area>/results/``) holds an index, ``README.md``, whose table
has one row per file::

    | file | what it measured | command |
    |---|---|---|
    | [scale_quick.json](scale_quick.json) | host ms per admission ... | `python benchmark/...` |

:func:`record` writes a file and replaces its row, or adds one beside the rows of its closest
name (the longest common prefix; at the end when none shares one), so the table stays in the
order it has. The date and commit of a file are git's: ``git log -1 --format='%h %ad' --
<file>``; no column repeats them. A folder without an index (an ``--out`` elsewhere) gets the
file alone.

Standard library only: the GPU check imports it on a machine with PyTorch and Triton alone.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from sglang_kvcmas_bench.provenance import REPO_ROOT

INDEX = "README.md"
HEADER = "| file | what it measured | command |"
RULE = "|---|---|---|"

__all__ = ["HEADER", "INDEX", "RULE", "command_line", "record", "row", "row_name", "upsert_row"]


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as run from the repository root (``argv``: default
    ``sys.argv``): ``python benchmark/serving/scale.py --quick``."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(REPO_ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def record(path: str | Path, content: str | bytes | Callable[[Path], object] | None, *,
           what: str, command: str | None = None, append: bool = False) -> Path:
    """Write ``content`` to ``path`` and upsert the file's row in ``path``'s folder's index
    (when the folder has one).

    Args:
        content: text or bytes, or a function that writes the file given its path (a plot:
            ``lambda p: fig.savefig(p)``); None: the file is written already (record by record
            as the run went), only its row is.
        what: what the file measured (the row's second cell; one line).
        command: the command that made it (default: :func:`command_line`).
        append: add ``content`` (text or bytes) to the end of the file instead of replacing it.

    Raises:
        ValueError: the folder's index has no ``HEADER`` table.
        FileNotFoundError: ``content`` is None and there is no file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        if not path.is_file():
            raise FileNotFoundError(path)
    elif callable(content):
        content(path)
    elif isinstance(content, bytes):
        with path.open("ab" if append else "wb") as f:
            f.write(content)
    else:
        with path.open("a" if append else "w") as f:
            f.write(content)
    index = path.parent / INDEX
    if index.is_file() and path.name != INDEX:
        text = index.read_text()
        updated = upsert_row(text, path.name, what, command or command_line())
        if updated != text:
            index.write_text(updated)
    return path


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(name: str, what: str, command: str) -> str:
    """The index row of file ``name``."""
    return f"| [{name}]({name}) | {_cell(what)} | `{_cell(command)}` |"


def row_name(line: str) -> str | None:
    """The file a table row names: its first cell's link target, else its code span, else the
    cell's text."""
    cells = line.strip().strip("|").split("|")
    first = cells[0].strip() if cells else ""
    m = re.fullmatch(r"\[[^\]]*\]\(([^)]+)\)", first) or re.fullmatch(r"`([^`]+)`", first)
    return (m.group(1) if m else first) or None


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def upsert_row(text: str, name: str, what: str, command: str) -> str:
    """``text`` (an index) with the row of file ``name`` replaced in place, or inserted after
    the last row whose name shares the longest prefix with ``name`` (at the table's end when
    none shares one).

    Raises:
        ValueError: ``text`` has no ``HEADER`` table.
    """
    lines = text.splitlines()
    squeeze = re.compile(r"\s+")
    header = next((i for i, line in enumerate(lines)
                   if squeeze.sub("", line) == squeeze.sub("", HEADER)), None)
    if header is None:
        raise ValueError(f"no index table ({HEADER})")
    first = header + 2
    end = first
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    new = row(name, what, command)
    names = [row_name(lines[i]) for i in range(first, end)]
    if name in names:
        lines[first + names.index(name)] = new
    else:
        shared = [_common_prefix(name, n or "") for n in names]
        best = max(shared, default=0)
        at = end if best == 0 else first + len(shared) - 1 - shared[::-1].index(best) + 1
        lines.insert(at, new)
    return "\n".join(lines) + ("\n" if text.endswith("\n") or not text else "")
