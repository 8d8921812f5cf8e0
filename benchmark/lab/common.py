"""Shared lab harness: records, timing, the per-turn metric bundle, summary tables and plots.

Used by every lab script (``kvcmas_lab.py``, ``precache_lab.py``) so that all methods are judged
by the same code. The API below is stable; add, don't change.

- ``Reference`` / ``make_reference``: no-sharing ground truth for one agent turn (dense prefill,
  teacher-forced continuation logits, greedy continuation).
- ``fidelity_bundle``: a method's cache + first-token logits -> teacher-forced top-1 / KL, greedy
  exact match and first divergence (shared metrics from ``sglang_kvcmas_lab.correction.fidelity``).
- ``time_call``: warmup + repeats, median.
- ``JsonlWriter``: one record per (method, turn): ``{config, commit, machine, metrics}``.
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

from sglang_kvcmas_lab.correction.fidelity import first_divergence, teacher_forced
from sglang_kvcmas_lab.models.reference_llama import KVCache, RefLlama

__all__ = [
    "JsonlWriter",
    "Reference",
    "Timing",
    "TurnMetrics",
    "fast_greedy",
    "fidelity_bundle",
    "format_table",
    "git_commit",
    "load_lab_model",
    "machine_info",
    "make_reference",
    "plot_methods",
    "summarize",
    "time_call",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- provenance ----------------------------------------------------------------------------
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


def encode(tok, text: str) -> torch.Tensor:
    """``text``'s token ids, no special tokens added: [T] int64."""
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def load_lab_model(model, dtype: torch.dtype = torch.float32) -> tuple[Any, RefLlama]:
    """The tokenizer and reference forward of ``model`` (a ``benchmark.model_arg.BenchModel``).

    Raises:
        ModelPathError: a model the labs do not run (``BenchModel.require_lab_support``).
    """
    from transformers import AutoTokenizer

    model.require_lab_support()
    tok = AutoTokenizer.from_pretrained(str(model.folder))
    model.require_lab_support(tok)
    return tok, RefLlama.from_pretrained(model.folder, dtype)


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


# ---- ground truth and the fidelity bundle ---------------------------------------------------
class Reference(NamedTuple):
    """No-sharing ground truth for one agent turn.

    cache: dense cache of the whole prompt [prompt_len tokens].
    last_logits: [vocab] logits of the prompt's last token (the first generated token).
    cont_ids: [M] int64 greedy continuation used for teacher forcing.
    tf_logits: [M, vocab]: row 0 = last_logits, row i = logits after cont_ids[:i].
    greedy_ids: the same greedy continuation as a list (the exact-match target).
    """

    cache: KVCache
    last_logits: torch.Tensor
    cont_ids: torch.Tensor
    tf_logits: torch.Tensor
    greedy_ids: list[int]


@torch.inference_mode()
def teacher_forced_logits(model: RefLlama, cache: KVCache, last_logits: torch.Tensor,
                          cont_ids: torch.Tensor) -> torch.Tensor:
    """[M, vocab]: the distribution before each of the M continuation tokens."""
    rest = model.forward(cont_ids[:-1], past=cache).logits if cont_ids.numel() > 1 else None
    rows = [last_logits[None]] + ([rest] if rest is not None else [])
    return torch.cat(rows)


@torch.inference_mode()
def make_reference(model: RefLlama, prompt_ids: torch.Tensor, num_tokens: int) -> Reference:
    """Dense prefill of ``prompt_ids: [T]`` and a ``num_tokens`` greedy continuation."""
    out = model.forward(prompt_ids)
    greedy = fast_greedy(model, out.kv, out.logits[-1], num_tokens)
    cont = torch.tensor(greedy, dtype=torch.long)
    tf = teacher_forced_logits(model, out.kv, out.logits[-1], cont)
    return Reference(out.kv, out.logits[-1], cont, tf, greedy)


@torch.inference_mode()
def fast_greedy(model: RefLlama, past: KVCache, first_logits: torch.Tensor, n: int) -> list[int]:
    """``RefLlama.greedy`` with keys rotated once (not at every step): same tokens, ~5x faster.

    Layer pieces are the model's own (qkv, finish_layer, logits); only the per-step re-rotation
    of the whole cache is avoided. ``model.greedy`` is the naive reference (test/lab compares).
    """
    import torch.nn.functional as F

    from sglang_kvcmas_lab.models.reference_llama import rotate

    s = model.spec
    ks = [rotate(k, past.positions, s.rope_theta) for k in past.k]
    vs = list(past.v)
    pos = int(past.positions.max()) + 1
    out = [int(first_logits.argmax())]
    for _ in range(n - 1):
        p = torch.tensor([pos])
        h = model.embed(torch.tensor(out[-1:]))
        for layer in range(s.num_layers):
            q, k, v = model.qkv(layer, h)
            ks[layer] = torch.cat([ks[layer], rotate(k, p, s.rope_theta)])
            vs[layer] = torch.cat([vs[layer], v])
            qr = rotate(q, p, s.rope_theta).transpose(0, 1)[None]
            att = F.scaled_dot_product_attention(qr, ks[layer].transpose(0, 1)[None],
                                                 vs[layer].transpose(0, 1)[None], enable_gqa=True)
            h = model.finish_layer(layer, h, att[0].transpose(0, 1).reshape(1, -1))
        out.append(int(model.logits(h)[-1].argmax()))
        pos += 1
    return out


def fidelity_bundle(model: RefLlama, ref: Reference, cache: KVCache, last_logits: torch.Tensor,
                    *, greedy: bool = True, greedy_tokens: int | None = None) -> dict[str, float]:
    """A method's prompt cache + first-token logits [vocab] against the reference.

    Returns top1, mean_kl, max_kl (teacher-forced over ref.cont_ids), and when ``greedy``
    greedy_exact (1.0 if the whole greedy continuation matches) and first_divergence.
    """
    tf = teacher_forced(ref.tf_logits, teacher_forced_logits(model, cache, last_logits,
                                                             ref.cont_ids))
    out = {"top1": tf.top1, "mean_kl": tf.mean_kl, "max_kl": tf.max_kl,
           "num_positions": tf.num_positions}
    if greedy:
        target = ref.greedy_ids[: greedy_tokens or len(ref.greedy_ids)]
        ids = fast_greedy(model, cache, last_logits, len(target))
        div = first_divergence(target, ids)
        out["greedy_exact"] = float(div == len(target))
        out["first_divergence"] = div
    return out


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
