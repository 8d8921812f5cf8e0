"""Sample an SGLang scheduler process with py-spy and say where its time goes.

``head_to_head.py --profile`` attaches one :class:`SchedulerProfile` per arm for the whole
workload (py-spy samples from outside the process, ~2% of a core at the default rate) and
writes ``profile_<arm>.txt``: the share of samples spent inside each function (inclusive), for
the model's phases, the attention backend and every ``sglang_kvcmas`` function.

    python -m sglang_kvcmas_bench.scheduler_profile RAW_STACKS.txt    # summarize a raw file
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PHASES = ("_execute_extend", "_execute_decode", "LlamaMLP.forward", "LlamaAttention.forward",
          "forward_extend", "forward_decode", "_get_new_batch_prefill_raw", "process_batch_result")
"""Function names (substrings) reported besides our own, to place our share among SGLang's."""


def find_scheduler(launcher_pid: int, timeout_s: float = 30.0) -> int:
    """Pid of the ``sglang::scheduler`` child of a launcher process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if "scheduler" in child.name() or "scheduler" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.5)
    raise RuntimeError(f"no scheduler process under pid {launcher_pid}")


class SchedulerProfile:
    """py-spy ``record --format raw`` of one scheduler, from ``start()`` to ``stop()``."""

    def __init__(self, launcher_pid: int, raw_path: Path, rate: int = 25):
        self.launcher_pid, self.raw_path, self.rate = launcher_pid, raw_path, rate
        self.proc: subprocess.Popen | None = None

    def start(self) -> SchedulerProfile:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        pid = find_scheduler(self.launcher_pid)
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
             "--nonblocking", "-o", str(self.raw_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        return self

    def stop(self) -> Path | None:
        """Stop sampling; py-spy writes the file on SIGINT. Returns it, or None if empty."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.raw_path if self.raw_path.exists() else None


def inclusive_shares(raw_path: Path) -> tuple[int, dict[str, float]]:
    """(samples, ``function (file) -> share of samples with it on the stack``)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        names = set()
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            names.add(f"{name} ({where.split(':')[0]})")
        for name in names:
            counts[name] += int(n)
    return total, {k: v / max(1, total) for k, v in counts.items()}


def report(raw_path: Path, top: int = 25) -> str:
    """The lines of ``profile_<arm>.txt``."""
    total, shares = inclusive_shares(raw_path)
    ours = sorted(((s, k) for k, s in shares.items() if "sglang_kvcmas" in k), reverse=True)
    phases = sorted(((s, k) for k, s in shares.items()
                     if any(p in k for p in PHASES) and "sglang_kvcmas" not in k), reverse=True)
    lines = [f"# {raw_path.name}: {total} samples (inclusive share of scheduler time)",
             "## SGLang phases"]
    lines += [f"{s:7.2%}  {k}" for s, k in phases[:top]]
    lines += ["## sglang_kvcmas functions"]
    lines += [f"{s:7.2%}  {k}" for s, k in ours[:top]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(report(Path(path)))
