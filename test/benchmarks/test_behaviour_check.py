"""``behaviour_check.py --compare``: identical records pass only when some turn borrowed."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.bench_scripts import load_script

check = load_script("benchmark/serving/behaviour_check.py")


def _turn(borrowed: int, output_ids: list[int]) -> dict:
    return {"kind": "debate", "wid": 0, "step": 1, "agent": "Ben", "prompt_tokens": 300,
            "output_ids": output_ids, "exact": 40, "borrowed": borrowed, "recomputed": 20}


def _write(path: Path, *turns: dict) -> Path:
    path.write_text(json.dumps({"commit": "abc", "turns": list(turns)}))
    return path


def test_identical_records_that_borrowed_pass(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.json", _turn(0, [1]), _turn(200, [2, 3]))
    b = _write(tmp_path / "b.json", _turn(0, [1]), _turn(200, [2, 3]))
    assert check.compare(a, b) == 0


def test_a_differing_output_fails(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.json", _turn(200, [2, 3]))
    b = _write(tmp_path / "b.json", _turn(200, [2, 4]))
    assert check.compare(a, b) == 1


def test_records_that_never_borrowed_fail(tmp_path: Path, capsys) -> None:
    a = _write(tmp_path / "a.json", _turn(0, [1]))
    b = _write(tmp_path / "b.json", _turn(0, [1]))
    assert check.compare(a, b) == 1
    assert "no turn borrowed" in capsys.readouterr().out

