"""End to end on SGLang's server under ``--kvcmas-leaf-mode lowrank``: a reader fits its low-rank
correction from the tokens it recomputes and reads its other borrowed tokens through it
(``reused_corrected`` in its usage, nothing re-positioned only), keeps the factors as its agent's
low-rank leaf (``/server_info`` and the ``kvcmas:leaf_bytes`` gauge) and no exact leaves, and its
next turn reads them again."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from test_shared_server import SA, SB, T1, T2, chat  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from benchmark.serving.server_arms import ArmServer

    log = tmp_path_factory.mktemp("kvcmas_lowrank") / "server.log"
    with ArmServer("kvcmas", log, ["--kvcmas-leaf-mode", "lowrank",
                                   "--kvcmas-lowrank-rank", "8"]) as s:
        yield s


def _tree(server) -> dict:
    with urllib.request.urlopen(server.url + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    (state,) = [s["kvcmas"] for s in info["internal_states"] if "kvcmas" in s]
    return state["shared_tree"]


def _gauge(server, name: str) -> dict[str, float]:
    """The samples of one metric on ``/metrics``: label text -> value."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_a_reader_reads_borrowed_tokens_corrected_under_lowrank(server):
    chat(server, SA, T1)
    chat(server, SB, T1)  # both heads cached now
    owner = chat(server, SA, T2)["usage"]["prompt_tokens_details"]
    out = chat(server, SB, T2)
    reader = out["usage"]["prompt_tokens_details"]
    assert owner["kvcmas_reused_corrected"] == 0
    assert reader["kvcmas_reused_corrected"] > 40, reader
    assert reader["kvcmas_reused_repositioned"] == 0 and reader["kvcmas_recomputed_borrowed"] > 0
    assert out["choices"][0]["message"]["content"]
    tree = _tree(server)
    assert tree["invariants"] == [] and tree["delta_tokens"] == 0, tree
    assert tree["lowrank_leaves"] == 1 and tree["lowrank_bytes"] > 0
    assert any(b["lowrank"] == tree["lowrank_bytes"] for b in tree["leaf_bytes_by_agent"].values())
    again = chat(server, SB, T2 + " Once more.")["usage"]["prompt_tokens_details"]
    # the prompt's last tokens differ; the borrowed part is read corrected again
    assert again["kvcmas_reused_corrected"] > 40 and again["kvcmas_reused_repositioned"] == 0
    assert again["kvcmas_exact_from_leaves"] == 0
    time.sleep(1.2)  # the gauge is set at most once a second, after a checkpoint
    chat(server, SA, T1)
    lowrank = {k: v for k, v in _gauge(server, "kvcmas:leaf_bytes").items()
               if 'type="lowrank"' in k}
    assert _tree(server)["lowrank_bytes"] in lowrank.values(), lowrank
