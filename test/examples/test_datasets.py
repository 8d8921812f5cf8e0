from __future__ import annotations

from sglang_kvcmas_examples import datasets


def test_gsm8k_loads_with_final_answers():
    items = datasets.gsm8k()
    assert len(items) == 1319
    assert items[0].final == datasets.last_number(items[0].answer.replace("####", ""))


def test_essays_and_humaneval():
    assert len(datasets.essays()) > 20
    assert sum(len(t) for _, t in datasets.essays()) > 300_000
    assert len(datasets.humaneval()) == 164


def test_last_number():
    assert datasets.last_number("so 1,234.5 apples then 18.") == "18"
    assert datasets.last_number("no digits") is None
