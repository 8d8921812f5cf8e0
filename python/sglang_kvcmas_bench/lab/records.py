"""The labs' records: one JSON line per (method, turn) with its provenance, the per-turn metric
bundle, timings, and per-method summaries as tables and plots.

Every lab script writes and summarizes through these, so every method is judged by the same
code. The API is stable; add, don't change.

- ``JsonlWriter``: one record per (method, turn): ``{config, commit, machine, metrics}``.
- ``TurnMetrics``: what one (method, turn) reports.
- ``time_call``: warmup + repeats, median.
- ``summarize`` / ``format_table``: per-method medians/means; ``plot_methods``: pictures.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from sglang_kvcmas_bench.provenance import REPO_ROOT

__all__ = ["JsonlWriter", "Timing", "TurnMetrics", "format_table", "git_commit", "machine_info",
           "plot_methods", "summarize", "time_call"]


def git_commit() -> str:
    """HEAD commit of the checkout, with ``+dirty`` when tracked files differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


class JsonlWriter:
    """Appends one JSON record per line: ``{config, commit, machine, metrics, unix_time}``."""

    def __init__(self, path: str | Path, model: str | None = None):
        """``model``: the model's name, written in every record when given."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._commit = git_commit()
        self._machine = machine_info()
        self._model = {} if model is None else {"model": model}

    def write(self, config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
        record = {**self._model, "config": config, "commit": self._commit,
                  "machine": self._machine, "metrics": metrics, "unix_time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
        return record


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "_asdict"):
        return x._asdict()
    raise TypeError(type(x))


# ---- timing ---------------------------------------------------------------------------------
class Timing(NamedTuple):
    median_s: float
    times_s: tuple[float, ...]


def time_call(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 0) -> tuple[Any, Timing]:
    """Run ``fn`` ``warmup`` + ``repeats`` times; return the last result and the median time.

    ``fn`` must be repeatable (stateful methods pass a closure that copies their state).
    """
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, Timing(statistics.median(times), tuple(times))


# ---- per-turn metric bundle -----------------------------------------------------------------
@dataclass
class TurnMetrics:
    """Everything one (method, turn) reports. ``extra`` holds method-specific numbers."""

    method: str
    workload: str
    instance: int
    turn: int
    agent: str
    is_owner_turn: bool
    prompt_tokens: int
    shared_tokens: int
    new_shared_tokens: int
    chain_depth: int
    top1: float = 1.0
    mean_kl: float = 0.0
    max_kl: float = 0.0
    greedy_exact: float = 1.0
    first_divergence: int = 0
    ttft_s: float = 0.0
    ttft_times_s: tuple[float, ...] = ()
    bytes_held: int = 0
    recomputed_tokens: int = 0
    kv_rel_err_k: list[float] = field(default_factory=list)
    kv_rel_err_v: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- summaries ------------------------------------------------------------------------------
def summarize(records: Iterable[dict[str, Any]], *, key: str = "method",
              where: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, dict[str, float]]:
    """Aggregate per-turn metric dicts by ``key``: means of fidelity, sums of times, last bytes.

    Returns {group: {n, top1, mean_kl, greedy_exact, first_divergence, ttft_s (sum),
    ttft_median_s, bytes_held (max), recomputed_frac, kv_err_k, kv_err_v}}.
    """
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if where is None or where(r):
            groups[str(r[key])].append(r)
    out = {}
    for g, rs in groups.items():
        def mean(name):
            vals = [r[name] for r in rs if r.get(name) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        def mean_layers(name):
            vals = [sum(r[name][1:]) / max(1, len(r[name]) - 1) for r in rs if r.get(name)]
            return sum(vals) / len(vals) if vals else float("nan")

        new = sum(r.get("new_shared_tokens", 0) for r in rs)
        out[g] = {
            "n": len(rs),
            "top1": mean("top1"),
            "mean_kl": mean("mean_kl"),
            "greedy_exact": mean("greedy_exact"),
            "first_divergence": mean("first_divergence"),
            "ttft_s": sum(r["ttft_s"] for r in rs),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
            "bytes_held": max(r.get("bytes_held", 0) for r in rs),
            "recomputed_frac": sum(r.get("recomputed_tokens", 0) for r in rs) / max(1, new),
            "kv_err_k": mean_layers("kv_rel_err_k"),
            "kv_err_v": mean_layers("kv_rel_err_v"),
        }
    return out


def format_table(summary: dict[str, dict[str, float]], columns: Sequence[str],
                 *, order: Sequence[str] | None = None) -> str:
    """A fixed-width text table, one row per group, in ``order`` (default: insertion order)."""
    names = [n for n in (order or summary) if n in summary]
    w = max([len("method")] + [len(n) for n in names]) + 2
    head = "method".ljust(w) + "".join(c.rjust(14) for c in columns)
    lines = [head, "-" * len(head)]
    for n in names:
        row = summary[n]
        cells = []
        for c in columns:
            v = row.get(c, float("nan"))
            cells.append((f"{v:.4g}" if isinstance(v, float) else str(v)).rjust(14))
        lines.append(n.ljust(w) + "".join(cells))
    return "\n".join(lines)


def plot_methods(summary: dict[str, dict[str, float]], path: str | Path, *,
                 panels: Sequence[tuple[str, str, str]], title: str = "") -> Path:
    """Scatter each method in each panel ``(x_metric, y_metric, panel_title)`` and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (x, y, t) in zip(axes[0], panels):
        for name, row in summary.items():
            ax.scatter(row[x], row[y], s=30)
            ax.annotate(name, (row[x], row[y]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(t)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
