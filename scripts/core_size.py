"""How big the product core is: the served package, its knobs, the README and the structure doc.

    python scripts/core_size.py              # this checkout
    python scripts/core_size.py --at REV     # a commit (git archive), e.g. to compare before/after
    python scripts/core_size.py --json       # one JSON object instead of the report

What it counts, all from the files (no import, so any commit can be measured):

- the served package ``python/sglang_kvcmas``: lines and modules, split into code, docstrings
  (every string statement in a body), comments and blank lines; the lines the server reaches
  from its entry points (``launch_server``, ``plugin``) by static imports, and the modules it
  does not (tools run beside the server: the cluster launcher, client helpers; and the
  ``sgl_kernel`` stand-in, which the CPU launcher puts on ``sys.path``); the modules
  over :data:`MODULE_LINES` lines and whether their docstring gives a reason (``NOTE:``);
- knobs a user sets: each ``ServingConfig`` field once (flag, variable and request field are
  its spellings), plus the request fields that are not a field's spelling, leaving out identity
  (agent, head, shared end, workflow) and the fields only the server sets;
- the README's lines, characters and results-table rows; the longest table cell of
  ``docs/structure.md``.

The caps these are held to are :data:`CAPS`; ``test/scripts/test_core_size.py`` checks them.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "python/sglang_kvcmas"
ENTRY_POINTS = ("sglang_kvcmas.launch_server", "sglang_kvcmas.plugin")
MODULE_LINES = 500
"""Longest module that needs no reason in its docstring."""
IDENTITY_FIELDS = ("kvcmas_agent", "kvcmas_head_len", "kvcmas_shared_end", "kvcmas_workflow")
CAPS = {"knobs": 15, "readme_lines": 200, "readme_chars": 15_000, "result_rows": 8,
        "structure_cell_chars": 300}
"""What the product core is held to (the served package's line count is reported, not capped)."""


@dataclass(frozen=True)
class Module:
    name: str
    lines: int
    code: int
    docstrings: int
    comments: int
    blank: int
    imports: tuple[str, ...]
    noted: bool
    """Whether the module docstring says why the module is as long as it is (``NOTE:``)."""


@dataclass(frozen=True)
class CoreSize:
    lines: int
    modules: int
    code: int
    docstrings: int
    comments: int
    blank: int
    reached_lines: int
    reached_modules: int
    not_reached: tuple[str, ...]
    """Modules no entry point imports (a package of them by its name alone)."""
    long_modules: tuple[tuple[str, int, bool], ...]
    """(module, lines, noted) of every module over :data:`MODULE_LINES` lines."""
    config_knobs: tuple[str, ...]
    request_knobs: tuple[str, ...]
    readme_lines: int
    readme_chars: int
    result_rows: int
    structure_cell_chars: int

    @property
    def knobs(self) -> int:
        return len(self.config_knobs) + len(self.request_knobs)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root / "python").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Absolute names of the modules (or their attributes) ``tree`` imports anywhere."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def read_module(path: Path, root: Path) -> Module:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    docs: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else ():
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                docs.update(range(stmt.lineno, stmt.end_lineno + 1))
    rest = [line.strip() for i, line in enumerate(lines, 1) if i not in docs]
    blank = sum(1 for line in rest if not line)
    comments = sum(1 for line in rest if line.startswith("#"))
    name = _module_name(path, root)
    return Module(name, len(lines), len(rest) - blank - comments, len(docs), comments, blank,
                  tuple(sorted(_imports(tree, name, path.name == "__init__.py"))),
                  "NOTE:" in (ast.get_docstring(tree) or ""))


def _reached(modules: dict[str, Module]) -> set[str]:
    seen: set[str] = set()
    todo = [m for m in ENTRY_POINTS if m in modules]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [m for m in (*modules[name].imports, *parents) if m in modules]
    return seen


def _strings(node: ast.AST, constants: dict[str, str]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    if isinstance(node, ast.Tuple):
        return [s for e in node.elts for s in _strings(e, constants)]
    return []


def _assignments(tree: ast.Module) -> dict[str, ast.AST]:
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def count_knobs(package: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(config fields, request-only user fields) as the module docstring counts them."""
    config = ast.parse((package / "config.py").read_text())
    serving = next(n for n in config.body if isinstance(n, ast.ClassDef)
                   and n.name == "ServingConfig")
    fields = tuple(n.target.id for n in serving.body if isinstance(n, ast.AnnAssign)
                   and isinstance(n.target, ast.Name))
    options = package / "policy" / "request_options.py"
    if not options.exists():
        return fields, ()
    values = _assignments(ast.parse(options.read_text()))
    constants = {k: v.value for k, v in values.items()
                 if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    own = _strings(values.get("_OWN_FIELDS", ast.Tuple(elts=[])), constants)
    server_only = set(_strings(values.get("SERVER_ONLY_FIELDS", ast.Tuple(elts=[])), constants))
    spelled = {"kvcmas_" + f for f in fields}
    request = tuple(f for f in own if f not in IDENTITY_FIELDS and f not in server_only
                    and f not in spelled)
    return fields, request


def _readme(root: Path) -> tuple[int, int, int]:
    text = (root / "README.md").read_text()
    section = text.split("\n## Results", 1)[-1].split("\n## ", 1)[0] if "\n## Results" in text \
        else ""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return len(text.splitlines()), len(text), max(0, len(rows) - 2)  # header and rule


def _longest_cell(path: Path) -> int:
    if not path.exists():
        return 0
    cells = [cell.strip() for line in path.read_text().splitlines() if line.startswith("|")
             for cell in line.strip().strip("|").split(" | ")]
    return max((len(c) for c in cells), default=0)


def measure(root: Path) -> CoreSize:
    """The product core's size in the checkout at ``root``."""
    package = root / PACKAGE
    modules = {m.name: m for m in (read_module(p, root) for p in sorted(package.rglob("*.py")))}
    reached = _reached(modules)
    config_knobs, request_knobs = count_knobs(package)
    readme_lines, readme_chars, rows = _readme(root)
    short = len("sglang_kvcmas.")
    return CoreSize(
        lines=sum(m.lines for m in modules.values()), modules=len(modules),
        code=sum(m.code for m in modules.values()),
        docstrings=sum(m.docstrings for m in modules.values()),
        comments=sum(m.comments for m in modules.values()),
        blank=sum(m.blank for m in modules.values()),
        reached_lines=sum(modules[m].lines for m in reached), reached_modules=len(reached),
        not_reached=tuple(sorted(m[short:] for m in set(modules) - reached
                                 if m.rpartition(".")[0] in reached | {"sglang_kvcmas"})),
        long_modules=tuple((m.name[short:], m.lines, m.noted) for m in modules.values()
                           if m.lines > MODULE_LINES),
        config_knobs=config_knobs, request_knobs=request_knobs,
        readme_lines=readme_lines, readme_chars=readme_chars, result_rows=rows,
        structure_cell_chars=_longest_cell(root / "docs" / "structure.md"))


def export(rev: str, into: Path) -> Path:
    """The files of commit ``rev`` that :func:`measure` reads, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, PACKAGE, "README.md"]
                             + (["docs/structure.md"] if _has(rev, "docs/structure.md") else []),
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _has(rev: str, path: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{path}"],
                          check=False, capture_output=True).returncode == 0


def over_caps(size: CoreSize) -> list[str]:
    """Each cap of :data:`CAPS` the core exceeds, and each long module without a reason."""
    actual = {"knobs": size.knobs, "readme_lines": size.readme_lines,
              "readme_chars": size.readme_chars, "result_rows": size.result_rows,
              "structure_cell_chars": size.structure_cell_chars}
    out = [f"{k} {actual[k]} > {cap}" for k, cap in CAPS.items() if actual[k] > cap]
    return out + [f"{name} has {n} lines and no NOTE: in its docstring"
                  for name, n, noted in size.long_modules if not noted]


def report(size: CoreSize, where: str) -> str:
    long = ", ".join(f"{n} {k}{'' if ok else ' (no reason given)'}"
                     for n, k, ok in size.long_modules) or "none"
    lines = [
        f"served package ({PACKAGE}) at {where}: {size.lines:,} lines in {size.modules} modules",
        (f"  code {size.code:,} · docstrings {size.docstrings:,} · comments {size.comments:,}"
         f" · blank {size.blank:,}"),
        (f"  reached from the server's entry points: {size.reached_lines:,} lines in "
         f"{size.reached_modules} modules; not reached: {', '.join(size.not_reached) or 'none'}"),
        f"  modules over {MODULE_LINES} lines: {long}",
        (f"knobs: {size.knobs} ({len(size.config_knobs)} config fields; request-only: "
         f"{', '.join(size.request_knobs) or 'none'})"),
        (f"README: {size.readme_lines} lines, {size.readme_chars:,} characters, "
         f"{size.result_rows} result rows"),
        f"docs/structure.md: longest table cell {size.structure_cell_chars} characters",
    ]
    over = over_caps(size)
    lines.append("caps: " + ("all held" if not over else "OVER: " + "; ".join(over)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", metavar="REV", help="measure this commit instead of the checkout")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.at:
            try:
                root = export(args.at, Path(tmp))
            except subprocess.CalledProcessError as e:
                print(f"core_size: cannot read {args.at}: {e.stderr.decode().strip()}",
                      file=sys.stderr)
                return 2
        else:
            root = ROOT
        size = measure(root)
    if args.json:
        print(json.dumps({**asdict(size), "knobs": size.knobs, "over_caps": over_caps(size)}))
    else:
        print(report(size, args.at or "this checkout"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
