"""The PReCache lab's methods and batched decode on a tiny random model (no adapters to train)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab" / "correction"))

import sglang_kvcmas_lab.correction.lora_baselines  # noqa: E402,F401
import sglang_kvcmas_lab.correction.precache_block  # noqa: E402,F401
import sglang_kvcmas_lab.correction.precache_delta  # noqa: E402,F401
import sglang_kvcmas_lab.correction.precache_methods  # noqa: E402,F401
from sglang_kvcmas_lab.correction.lora_forward import LoraForward  # noqa: E402
from sglang_kvcmas_lab.correction.precache_base import (  # noqa: E402
    Segment,
    create_lora_method,
    registered_lora_methods,
)
from test_precache import tiny_lora  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def lora() -> LoraForward:
    return tiny_lora()


def _segments() -> list[Segment]:
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, 97, (n,), generator=g)  # noqa: E731
    return [Segment(ids(9), None), Segment(ids(6), 0), Segment(ids(7), 1), Segment(ids(5), 2)]


def _methods(lora):
    out = {}
    for name in registered_lora_methods():
        kw = {"start": 1, "width": 1} if name in ("droidspeak", "rebase_mean_block") else {}
        m = create_lora_method(name, **kw)
        m.reset(lora)
        out[name] = m
    return out


def test_every_method_ttft_path_matches_its_view(lora):
    """first_token's logits (split reads, rebuilds) == the reader's view + dense suffix."""
    methods, suffix = _methods(lora), torch.tensor([5, 7])
    for t, seg in enumerate(_segments()):
        for m in methods.values():
            m.append(seg)
        for reader in {t % 3, (t + 1) % 3}:
            dense = lora.forward(torch.cat([methods["no_sharing"].all_ids(), suffix]),
                                 agent=reader).logits[-1]
            for name, m in methods.items():
                got = m.first_token(reader, suffix)()
                view = m.view(reader)
                want = lora.forward(suffix, past=view, agent=reader).logits[-1]
                torch.testing.assert_close(got, want, **TOL, msg=name)
                if m.exact:
                    torch.testing.assert_close(got, dense, **TOL, msg=name)


def test_rebuilt_store_is_the_neutral_pass_and_leaks_no_adapter(lora):
    """ReBaseShared's store equals one neutral pass over the transcript; PreLRShared's differs
    exactly on the agents' messages."""
    methods = _methods(lora)
    segs = _segments()
    for seg in segs:
        for m in methods.values():
            m.append(seg)
    ids = methods["no_sharing"].all_ids()
    neutral = lora.forward(ids, agent=None).kv
    rebase = methods["rebase_after_turn"].store.base
    for layer in range(3):
        torch.testing.assert_close(rebase.v[layer], neutral.v[layer], **TOL)
    prelr = methods["prelr_shared"].store.base
    n_input = segs[0].ids.numel()
    torch.testing.assert_close(prelr.v[2][:n_input], neutral.v[2][:n_input], **TOL)
    assert (prelr.v[2][n_input:] - neutral.v[2][n_input:]).abs().max() > 1e-6


def test_bytes_held_ordering(lora):
    methods = _methods(lora)
    for seg in _segments():
        for m in methods.values():
            m.append(seg)
    b = {k: m.bytes_held(3) for k, m in methods.items()}
    assert b["no_sharing"] == 3 * b["naive"]
    assert b["naive"] < b["prelr_shared"] == b["rebase_after_turn"] < b["no_sharing"]


def test_batched_decode_runs_for_every_method(lora):
    from sglang_kvcmas_bench.lab.decode_throughput import batched_decode_throughput

    methods = _methods(lora)
    segs = _segments()
    for seg in segs:
        for m in methods.values():
            m.append(seg)
    out = batched_decode_throughput(lora, segs, methods, torch.tensor([5, 7]), num_tokens=3)
    assert set(out) == set(methods)
    assert all(v["decode_tok_s"] > 0 for v in out.values())
