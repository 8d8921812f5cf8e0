"""Every knob defined once: names derived, values parsed strictly, environment round trip."""

from __future__ import annotations

import math

import pytest

from sglang_kvcmas.config import KNOBS, ConfigError, ServingConfig, knob, resolve
from sglang_kvcmas.policy.recompute import RecomputeConfig


def test_names_derive_from_the_field():
    k = knob("recompute_boundary")
    assert (k.flag, k.env, k.request_field) == (
        "--kvcmas-recompute-boundary", "KVCMAS_RECOMPUTE_BOUNDARY", "kvcmas_recompute_boundary")
    assert knob("share_context").request_field is None
    assert len({k.env for k in KNOBS}) == len(KNOBS)


def test_policy_defaults_come_from_the_config():
    cfg = ServingConfig()
    assert RecomputeConfig() == RecomputeConfig.from_serving(cfg)
    assert RecomputeConfig.from_serving(cfg, recompute_boundary=3).boundary_tokens == 3


@pytest.mark.parametrize("name, value", [
    ("recompute_boundary", True), ("recompute_boundary", 1.5), ("recompute_boundary", -1),
    ("recompute_boundary", None), ("recompute_boundary", "16"), ("recompute_boundary", [16]),
    ("recompute_mass_fraction", math.nan), ("recompute_mass_fraction", math.inf),
    ("recompute_mass_fraction", 2), ("leaf_mode", "random"), ("share_context", 1),
])
def test_parse_is_strict(name, value):
    with pytest.raises(ConfigError, match="custom_params.x"):
        knob(name).parse(value, "custom_params.x")


def test_parse_accepts_the_right_types():
    assert knob("recompute_mass_fraction").parse(0, "f") == 0.0
    assert knob("leaf_budget").parse(None, "f") is None
    assert knob("leaf_budget").parse_text("", "f") is None
    assert knob("share_context").parse_text("on", "f") is True


def test_environment_round_trip():
    cfg = ServingConfig(share_context=True, recompute_boundary=4, leaf_budget=0.05)
    assert ServingConfig.from_env(cfg.to_env()) == cfg
    assert "KVCMAS_STOCK_CACHE" not in cfg.to_env()  # launcher-only knobs stay with the launcher


def test_resolve_order_flag_env_default():
    assert resolve({}, {}).recompute_boundary == 16
    assert resolve({}, {"KVCMAS_RECOMPUTE_BOUNDARY": "2"}).recompute_boundary == 2
    assert resolve({"recompute_boundary": "5"},
                   {"KVCMAS_RECOMPUTE_BOUNDARY": "2"}).recompute_boundary == 5
    with pytest.raises(ConfigError, match="--kvcmas-recompute-boundary"):
        resolve({"recompute_boundary": "five"}, {})


def test_config_validates_its_own_fields():
    with pytest.raises(ConfigError):
        ServingConfig(recompute_mass_fraction=3.0)


def test_readme_lists_every_knob():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [k.flag for k in KNOBS if f"`{k.flag}`" not in readme or f"`{k.env}`" not in readme]
    assert not missing, f"README's knob table lacks {missing}"


def test_a_removed_knob_fails_naming_what_replaced_it(monkeypatch):
    from sglang_kvcmas import config
    from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions
    from sglang_kvcmas.server.options import parse_launcher_args

    monkeypatch.setitem(config.REMOVED, "old_knob", "use --kvcmas-new-knob")
    monkeypatch.setitem(config.REMOVED_CHOICES, ("leaf_mode", "old"), "use 'factored'")
    with pytest.raises(ConfigError, match="--kvcmas-old-knob is no longer served: use --kvcmas"):
        resolve({"old_knob": "3"}, {})
    with pytest.raises(ConfigError, match="KVCMAS_OLD_KNOB is no longer served"):
        ServingConfig.from_env({"KVCMAS_OLD_KNOB": "1"})
    with pytest.raises(RequestOptionError, match="custom_params.kvcmas_old_knob is no longer"):
        RequestOptions.parse({"kvcmas_old_knob": 1})
    with pytest.raises(ConfigError, match="leaf_mode=old is no longer served: use 'factored'"):
        knob("leaf_mode").parse("old", "leaf_mode")
    with pytest.raises(SystemExit, match="--kvcmas-old-knob is no longer served"):
        parse_launcher_args(["--kvcmas-old-knob", "2", "--port", "1"])


RETIRED = ("lora_centroid_ahead", "lora_centroid_handoff", "lora_leaves",
           "lora_recompute_boundary_at", "lora_recompute_tail", "lora_recompute_boundary",
           "lora_recompute_mass_fraction", "cpu_lora_ops", "cpu_threads", "turn_order",
           "turn_max_wait_s", "turn_min_gain", "min_borrowed", "cache_agent_outputs",
           "recompute_mass_max_tokens", "recompute_segment_share", "recompute_max_fraction",
           "recompute_batch_tokens", "leaf_mass_fraction", "factored_reread",
           "allow_sgl_kernel_standin", "lowrank_rank", "lowrank_chain", "cache_dir")
"""Knobs (and environment variables) this package once served, each in ``REMOVED``."""


def test_retired_knobs_are_listed_as_removed_and_served_no_more():
    from sglang_kvcmas.config import REMOVED

    assert set(RETIRED) == set(REMOVED)
    assert not {k.name for k in KNOBS} & set(REMOVED)
    assert len(KNOBS) <= 13  # with kvcmas_exact and kvcmas_read_leaves: 15


@pytest.mark.parametrize("name", RETIRED)
def test_a_retired_knob_fails_by_flag_variable_and_field(name):
    import re

    from sglang_kvcmas.config import REMOVED
    from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions
    from sglang_kvcmas.server.options import parse_launcher_args

    why = re.escape(REMOVED[name])
    flag, env = "--kvcmas-" + name.replace("_", "-"), "KVCMAS_" + name.upper()
    with pytest.raises(ConfigError, match=f"{flag} is no longer served: {why}"):
        resolve({name: "1"}, {})
    with pytest.raises(ConfigError, match=f"{env} is no longer served: {why}"):
        ServingConfig.from_env({env: "1"})
    with pytest.raises(RequestOptionError, match=f"custom_params.kvcmas_{name} is no longer"):
        RequestOptions.parse({f"kvcmas_{name}": 1})
    with pytest.raises(SystemExit, match=f"{flag} is no longer served"):
        parse_launcher_args([flag, "1", "--port", "1"])


def test_the_low_rank_leaf_modes_and_their_knobs_fail_naming_what_to_use():
    import re

    from sglang_kvcmas.policy.request_options import RequestOptionError, RequestOptions
    from sglang_kvcmas.server.options import parse_launcher_args

    gone = ("is no longer served: low-rank corrections read worse than naive re-positioning; "
            "use 'factored' (the default) or 'exact'")
    renamed = ("is no longer served: renamed --kvcmas-leaf-rank (KVCMAS_LEAF_RANK, "
               "custom_params.kvcmas_leaf_rank)")
    for mode in ("lowrank", "lowrank+exact"):
        with pytest.raises(SystemExit, match=re.escape(f"--kvcmas-leaf-mode={mode} {gone}")):
            parse_launcher_args(["--kvcmas-leaf-mode", mode, "--port", "1"])
        with pytest.raises(ConfigError, match=re.escape(f"KVCMAS_LEAF_MODE={mode} {gone}")):
            ServingConfig.from_env({"KVCMAS_LEAF_MODE": mode})
        with pytest.raises(RequestOptionError,
                           match=re.escape(f"custom_params.kvcmas_leaf_mode={mode} {gone}")):
            RequestOptions.parse({"kvcmas_leaf_mode": mode})
    with pytest.raises(ConfigError, match="KVCMAS_LOWRANK_CHAIN is no longer served: it tuned "
                                          "leaf mode 'lowrank\\+exact', gone too: low-rank"):
        ServingConfig.from_env({"KVCMAS_LOWRANK_CHAIN": "0.5"})
    with pytest.raises(SystemExit, match="--kvcmas-lowrank-chain is no longer served"):
        parse_launcher_args(["--kvcmas-lowrank-chain", "0", "--port", "1"])
    with pytest.raises(RequestOptionError,
                       match=re.escape(f"custom_params.kvcmas_lowrank_rank {renamed}")):
        RequestOptions.parse({"kvcmas_lowrank_rank": 8})
    with pytest.raises(SystemExit, match=re.escape(f"--kvcmas-lowrank-rank {renamed}")):
        parse_launcher_args(["--kvcmas-lowrank-rank", "8", "--port", "1"])
    with pytest.raises(ConfigError, match=re.escape(f"KVCMAS_LOWRANK_RANK {renamed}")):
        ServingConfig.from_env({"KVCMAS_LOWRANK_RANK": "8"})
    assert RequestOptions.parse({"kvcmas_leaf_rank": 8}).overrides == {"leaf_rank": 8}
    assert knob("leaf_mode").choices == ("exact", "factored")
    assert ServingConfig.from_env({"KVCMAS_LEAF_RANK": "8"}).leaf_rank == 8


def test_the_retired_lora_modes_fail_naming_what_to_use():
    import re

    from sglang_kvcmas.server.options import parse_launcher_args

    use = ("use 'borrow' (an adapter reads the transcript another computed, bounded by the "
           "fidelity monitor) or 'separate' (the default: each adapter's own exact cache)")
    for mode, why in (("catchup", "it was exact as 'separate' is"),
                      ("rebase", "its centroid prefill sat on every turn's critical path")):
        with pytest.raises(SystemExit, match=re.escape(
                f"--kvcmas-lora-share={mode} is no longer served: {why}")) as err:
            parse_launcher_args(["--kvcmas-lora-share", mode, "--port", "1"])
        assert use in str(err.value)
        with pytest.raises(ConfigError, match=re.escape(f"KVCMAS_LORA_SHARE={mode} is no "
                                                        "longer served")):
            ServingConfig.from_env({"KVCMAS_LORA_SHARE": mode})
    assert ServingConfig.from_env({"KVCMAS_LORA_SHARE": "borrow"}).lora_share == "borrow"
