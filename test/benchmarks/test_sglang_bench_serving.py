"""SGLang's serving benchmark from the installed environment, and what our script hands it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench_scripts import load_script

SCRIPT = "benchmark/serving/sglang_bench_serving.py"


def test_sglang_bench_serving_starts_in_the_installed_environment():
    """``python -m sglang.bench_serving`` imports ``datasets`` at start: the install brings it."""
    run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--help"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "generated-shared-prefix" in run.stdout and "agentic-trace" in run.stdout


def test_the_trace_is_the_first_conversations_with_enough_user_turns():
    """Each conversation: ``turns`` user messages, cut to ``chars``, no assistant message; the
    same conversations every time (the copy read item by item, in order)."""
    bench = load_script(SCRIPT)
    trace = bench.sharegpt_trace(conversations=5, turns=3, chars=50)
    assert trace == bench.sharegpt_trace(conversations=5, turns=3, chars=50)
    convs = trace["conversations"]
    assert len(convs) == 5 and all(len(c) == 3 for c in convs)
    for turn in (t for c in convs for t in c):
        (message,) = turn["messages"]
        assert message["role"] == "user" and 0 < len(message["content"]) <= 50
    longer = bench.sharegpt_trace(conversations=5, turns=6, chars=50)["conversations"]
    assert all(len(c) == 6 for c in longer)


def test_each_dataset_gets_its_sizes_and_the_fixed_answers(tmp_path):
    """generated-shared-prefix: the sizes as its flags, all requests; agentic-trace: the chat
    backend over a trace written beside the run; both greedy with fixed-length answers."""
    bench = load_script(SCRIPT)
    sizes = bench.SIZES["generated-shared-prefix"][True]
    gsp = bench.bench_args("generated-shared-prefix", sizes, "http://h:1", Path("/tok"), tmp_path)
    flag = {k: v for k, v in itertools.pairwise(gsp) if k.startswith("--")}
    assert flag["--backend"] == "sglang" and flag["--num-prompts"] == "32"
    assert flag["--gsp-system-prompt-len"] == "1024" and flag["--gsp-output-len"] == "64"
    assert json.loads(flag["--extra-request-body"]) == {"ignore_eos": True, "temperature": 0}
    sizes = {"conversations": 2, "turns": 2, "chars": 40, "output": 16}
    trace = bench.bench_args("agentic-trace", sizes, "http://h:1", Path("/tok"), tmp_path)
    flag = {k: v for k, v in itertools.pairwise(trace) if k.startswith("--")}
    assert flag["--backend"] == "sglang-oai-chat" and flag["--agentic-max-turns"] == "2"
    assert flag["--sharegpt-output-len"] == "16"
    assert len(json.loads(Path(flag["--dataset-path"]).read_text())["conversations"]) == 2


@pytest.mark.parametrize("argv", [["--datasets", "sharegpt"], ["--size", "agentic-trace:x=3"],
                                  ["--size", "agentic-trace:turns=0"]])
def test_bad_arguments_end_with_the_reason(argv, capsys):
    bench = load_script(SCRIPT)
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", *argv])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
