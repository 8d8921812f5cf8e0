"""``scripts/gpu_check.sh``: its dry run works on any machine and names every step with its
limit (together under 6 minutes), what travels with the tree (under 64 MiB) and the summary's
fields; without a GPU the check itself stops at once, installing nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_dry_run_lists_the_steps(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], check=False,
                         capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python: " in out.stdout and "flashinfer: " in out.stdout
    assert "would run kernel_tests" in out.stdout and "test/lab/kernels" in out.stdout
    assert "would run benchmark" in out.stdout and "delta_attention_gpu_bench.py" in out.stdout
    limits = [int(x) for x in re.findall(r"would run \w+ \(limit (\d+)s\)", out.stdout)]
    assert len(limits) == 2 and sum(limits) <= 330  # 6 minutes with the start and the summary
    assert f"limits {sum(limits)} s in all" in out.stdout
    carried = re.search(r"carried: .* = ([\d.]+) MiB of 64 MiB", out.stdout)
    assert carried and float(carried.group(1)) < 64
    for field in ("kernel_tests.by_name", "delta_vs_plain", "target", "steps"):
        assert f"  {field}: " in out.stdout
    assert not (tmp_path / "gpu_check_steps.jsonl").exists()  # nothing ran


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None,
                    reason="a GPU machine: the check would run")
def test_without_a_gpu_the_check_stops_at_once(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], check=False, capture_output=True,
                         text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 2 and "no GPU here" in out.stderr
    assert (tmp_path / "gpu_check_steps.jsonl").read_text() == ""  # no step, no install
