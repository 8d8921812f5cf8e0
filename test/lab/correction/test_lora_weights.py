"""The shipped role adapters load as rank-8, alpha-16 factors on their declared targets."""

from __future__ import annotations

import random

import pytest

from sglang_kvcmas.adapters import ADAPTER_CONFIGS, ROLES, role_adapter_dir
from sglang_kvcmas.adapters.role_data import role_examples
from sglang_kvcmas_lab.correction.lora_weights import load_peft_adapter

NUM_LAYERS = 30  # SmolLM2-135M


@pytest.mark.parametrize("config", sorted(ADAPTER_CONFIGS))
@pytest.mark.parametrize("role", ROLES)
def test_shipped_adapter_loads(config, role):
    layers = load_peft_adapter(role_adapter_dir(config, role), NUM_LAYERS)
    assert len(layers) == NUM_LAYERS
    for layer in layers:
        assert set(layer) == set(ADAPTER_CONFIGS[config])
        for f in layer.values():
            assert f.rank == 8 and f.scale == 2.0
            assert float(f.b.abs().max()) > 0  # trained: B starts at zero in peft


def test_role_examples_are_role_specific():
    ex = role_examples("Q?", "a = <<1+1=2>>2.\nb = <<2*3=6>>6.\n#### 6", "6", random.Random(0))
    assert [e.role for e in ex] == list(ROLES)
    assert ex[0].target.startswith("PLAN:\n1. Compute a.")
    assert ex[1].target.startswith("SOLUTION:\na = 2.\nb = 6.\nANSWER: 6")
    assert ex[2].target.startswith("VERDICT: ")
    assert "<<" not in ex[1].target
