"""The router benchmark's CPU accounting (no server): schedulers apart from everything else."""

from __future__ import annotations

import os

from helpers.bench_scripts import load_script

rs = load_script("benchmark/serving/router_scale.py")


def test_cpu_used_splits_schedulers_from_the_rest_and_counts_new_processes():
    before = {1: ("sglang::scheduler", 10.0), 2: ("sglang::scheduler", 5.0), 3: ("python", 2.0)}
    after = {1: ("sglang::scheduler", 30.0), 2: ("sglang::scheduler", 24.0),
             3: ("python", 2.5), 4: ("smg::router", 0.7)}  # pid 4 started in between
    assert rs.cpu_used(before, after, 20.0) == {"schedulers": 39.0, "other": 1.2, "wall": 20.0}


def test_cpu_seconds_sees_this_process():
    name, seconds = rs.cpu_seconds()[os.getpid()]
    assert seconds > 0 and name
