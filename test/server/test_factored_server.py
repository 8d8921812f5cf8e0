"""End to end on SGLang's server under ``--kvcmas-leaf-mode factored``: a reader keeps the tokens
it recomputes as factored leaves (their deviation from the owner's KV at rank r: ``/server_info``
and the ``kvcmas:leaf_bytes`` gauge; no exact leaves, no pool slots; its recomputed slots freed
right after its prefill, its decode reading them through the leaves), and its next turn reads
them through those factors (``reused_factored`` in its usage), in extend and decode."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from test_shared_server import SA, SB, T1, T2, chat  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_kvcmas_bench.server_arms import ArmServer

    log = tmp_path_factory.mktemp("kvcmas_factored") / "server.log"
    with ArmServer("kvcmas", log, ["--kvcmas-leaf-mode", "factored",
                                   "--kvcmas-leaf-rank", "8"]) as s:
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


def test_a_reader_keeps_factored_leaves_and_reads_through_them(server):
    chat(server, SA, T1)
    chat(server, SB, T1)  # both heads cached now
    chat(server, SA, T2)
    out = chat(server, SB, T2)
    reader = out["usage"]["prompt_tokens_details"]
    picks = reader["kvcmas_recomputed_borrowed"]
    assert picks > 0 and reader["kvcmas_reused_factored"] == 0, reader
    assert out["choices"][0]["message"]["content"]
    tree = _tree(server)
    assert tree["invariants"] == [] and tree["exact_leaf_tokens"] == 0, tree
    assert tree["factored_tokens"] == picks and tree["factored_bytes"] > 0, tree
    # no overlap scheduler on CPU: its recomputed slots went right after its prefill, and its
    # decode read the picks through the leaves it had just kept
    assert tree["factored_rows_reread"] == 1, tree
    # the high-water mark of slots held counts them while they were held
    assert tree["peak_held_tokens"] > 0, tree
    assert any(b["factored"] == tree["factored_bytes"]
               for b in tree["leaf_bytes_by_agent"].values())
    # its decode held the picks' deviations expanded, and gave them back when it finished
    held = tree["materialized_leaf_bytes"]
    assert held["peak"] > 0 and held["now"] == 0, held
    again = chat(server, SB, T2 + " Once more.")
    used = again["usage"]["prompt_tokens_details"]
    # the picks are held as factored leaves: read through them, not recomputed again (the
    # transcript's last tokens tokenize differently before the new text: a few fall outside)
    assert picks - 4 <= used["kvcmas_reused_factored"] <= picks, used
    assert used["kvcmas_exact_from_leaves"] == 0
    assert again["choices"][0]["message"]["content"]  # decode read them too
    time.sleep(1.2)  # the gauge is set at most once a second, after a checkpoint
    chat(server, SA, T1)
    factored = {k: v for k, v in _gauge(server, "kvcmas:leaf_bytes").items()
                if 'type="factored"' in k}
    assert _tree(server)["factored_bytes"] in factored.values(), factored
