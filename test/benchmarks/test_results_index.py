"""``sglang_kvcmas_bench.results``: a result file and its index row in one go; a row is replaced
in place, a new one goes beside the rows of its closest name, and the rest stay in order."""

from __future__ import annotations

import pytest
from sglang_kvcmas_bench.results import (
    HEADER,
    RULE,
    command_line,
    record,
    row,
    row_name,
    upsert_row,
)

INDEX = f"""# Results

Intro.

{HEADER}
{RULE}
{row("scale_quick.json", "quick", "python benchmark/serving/scale.py --quick")}
| `frontier.txt` | hand-written | `python benchmark/serving/frontier.py` |
{row("frontier.json", "its figures", "python benchmark/serving/frontier.py")}
{row("soak.txt", "soak", "python benchmark/serving/soak.py")}

After the table.
"""


def names(text: str) -> list[str]:
    return [row_name(line) for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(HEADER)]


def test_a_row_names_its_file_by_link_code_span_or_text():
    assert row_name(row("a_b.json", "x", "y")) == "a_b.json"
    assert row_name("| `a.txt` (`.json`) | x | y |") == "`a.txt` (`.json`)"
    assert row_name("| `a.txt` | x | y |") == "a.txt"
    assert row_name("| a.txt | x | y |") == "a.txt"


def test_a_new_row_goes_after_its_closest_names_and_the_rest_keep_their_order():
    got = upsert_row(INDEX, "frontier.png", "its plot", "python benchmark/serving/frontier.py")
    assert names(got) == ["scale_quick.json", "frontier.txt", "frontier.json", "frontier.png",
                          "soak.txt"]
    got = upsert_row(got, "scale.json", "full", "python benchmark/serving/scale.py")
    assert names(got)[:2] == ["scale_quick.json", "scale.json"]
    got = upsert_row(got, "zzz.txt", "no kin", "python x.py")
    assert names(got)[-1] == "zzz.txt"
    assert got.endswith("\nAfter the table.\n") and got.startswith("# Results\n\nIntro.\n")


def test_a_row_is_replaced_in_place_whatever_its_old_form():
    got = upsert_row(INDEX, "frontier.txt", "rerun | with a pipe", "python f.py --quick")
    assert names(got) == names(INDEX)
    line = next(ln for ln in got.splitlines() if row_name(ln) == "frontier.txt")
    assert line == row("frontier.txt", "rerun | with a pipe", "python f.py --quick")
    assert "rerun \\| with a pipe" in line
    assert upsert_row(got, "frontier.txt", "rerun | with a pipe", "python f.py --quick") == got


def test_an_index_without_the_table_is_refused():
    with pytest.raises(ValueError, match="no index table"):
        upsert_row("# Results\n\n| file | date |\n|---|---|\n", "a.txt", "x", "y")


def test_record_writes_the_file_and_its_row_together(tmp_path):
    (tmp_path / "README.md").write_text(INDEX)
    record(tmp_path / "soak.txt", "SOAK minutes=1\n", what="one-minute soak",
           command="python benchmark/serving/soak.py --minutes 1")
    assert (tmp_path / "soak.txt").read_text() == "SOAK minutes=1\n"
    text = (tmp_path / "README.md").read_text()
    assert row("soak.txt", "one-minute soak", "python benchmark/serving/soak.py --minutes 1") \
        in text.splitlines()
    record(tmp_path / "soak.txt", "more\n", what="appended", command="c", append=True)
    assert (tmp_path / "soak.txt").read_text() == "SOAK minutes=1\nmore\n"
    record(tmp_path / "soak.png", lambda p: p.write_bytes(b"\x89PNG"), what="its plot",
           command="c")
    assert names((tmp_path / "README.md").read_text())[-2:] == ["soak.txt", "soak.png"]
    (tmp_path / "soak.jsonl").write_text("{}\n")  # written record by record as the run went
    record(tmp_path / "soak.jsonl", None, what="its samples", command="c")
    assert (tmp_path / "soak.jsonl").read_text() == "{}\n"
    assert "soak.jsonl" in names((tmp_path / "README.md").read_text())
    with pytest.raises(FileNotFoundError):
        record(tmp_path / "never.txt", None, what="x", command="c")


def test_a_folder_without_an_index_gets_the_file_alone(tmp_path):
    record(tmp_path / "out" / "x.json", b"{}", what="x")
    assert (tmp_path / "out" / "x.json").read_bytes() == b"{}"
    assert not (tmp_path / "out" / "README.md").exists()


def test_the_command_is_the_script_from_the_repository_root():
    from sglang_kvcmas_bench.provenance import REPO_ROOT

    script = str(REPO_ROOT / "benchmark" / "serving" / "scale.py")
    assert command_line([script, "--quick", "--out", "a b"]) == (
        "python benchmark/serving/scale.py --quick --out 'a b'")
    assert command_line(["/elsewhere/x.py"]) == "python /elsewhere/x.py"


def test_every_committed_result_has_one_row_and_every_row_a_file():
    """Each ``benchmark/<area>/results/README.md`` indexes exactly the files beside it."""
    from sglang_kvcmas_bench.provenance import REPO_ROOT

    folders = sorted((REPO_ROOT / "benchmark").glob("*/results"))
    assert folders
    for folder in folders:
        text = (folder / "README.md").read_text()
        assert HEADER in text and "git log -1 --format='%h %ad' -- <file>" in text, folder
        rows = names(text)
        files = {p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md"}
        assert len(rows) == len(set(rows)), (folder, sorted({n for n in rows if rows.count(n) > 1}))
        assert set(rows) == files, (folder, sorted(files - set(rows)), sorted(set(rows) - files))


def test_committed_result_names_follow_the_one_naming_rule():
    """``<benchmark>[_<variant>][_<part>][_<model>].<ext>``: the model as ``BenchModel.slug``
    spells it (no dots), none for the embedded model, and nothing that says when."""
    import re

    from sglang_kvcmas_bench.model_arg import BenchModel
    from sglang_kvcmas_bench.provenance import REPO_ROOT

    assert BenchModel.slug.fget(type("M", (), {"name": "qwen2.5-coder-0.5b"})()) == (
        "qwen2-5-coder-0-5b")
    bad = []
    for path in (REPO_ROOT / "benchmark").glob("*/results/*.*"):
        if path.name == "README.md":
            continue
        stem = path.name.rsplit(".", 1)[0]
        if (not re.fullmatch(r"[a-z0-9_-]+", stem) or "embedded" in stem
                or re.search(r"_(before|after|final|run\d)(_|$)", stem)):
            bad.append(path.name)
    assert not bad, sorted(bad)
